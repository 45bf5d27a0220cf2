"""Fairness: the order in which the Scheduler's waiting sequences take free slots.

Every sequence has a group (`Sequence.group`: the API gives all the prompts of one HTTP
request one group; by default a sequence is a group of its own). Free slots go to the
waiting sequences round-robin across groups, not in arrival order: each admission is a
group's turn, the next free slot goes to the group whose last turn is the oldest (a group
new to the queue comes right before the one served last), and it takes its oldest waiting
sequence (`_fair_order`). So a one-prompt request that arrives behind a 256-prompt one takes
the next slot that frees instead of waiting for 256 answers, and the big one still has a
turn in every round, however many others come. With one sequence per group this is the
arrival order. Preempted sequences still go first.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from kinetic.engine.sequence import Sequence, Status


def group_of(seq: Sequence) -> object:
    return seq if seq.group is None else seq.group


class Fairness:
    """The Scheduler's admission order: a base of Scheduler, whose __init__ makes the state
    these methods use (`waiting`, `_groups`, `_turn`)."""

    def _admission_order(self) -> list[Sequence]:
        """The waiting sequences to admit into the free slots: the preempted ones first, then
        round-robin across groups (`_fair_order`), but for those whose next prefix page a
        running (or earlier admitted) sequence is computing: they wait for it, to find it
        cached rather than compute it twice, and the ones behind them that do not share it go
        past them. (_admit may still find one does not fit.)"""
        free = self._slots.count(None)
        if not free:
            return []
        computing = {k for s in self.running if len(s.tokens) - s.num_computed > 1
                     for k in self._future_keys(s)}
        out = []
        for seq in self._fair_order(lambda seq: not self._waits_for_prefix(seq, computing)):
            out.append(seq)
            computing.update(self._future_keys(seq))
            if len(out) == free:
                break
        return out

    def _fair_order(self, admissible) -> Iterator[Sequence]:
        """The waiting sequences that `admissible` accepts, in the order they would take
        free slots: the preempted ones (at the front of the queue) first; then turn by turn,
        the group whose last turn is the oldest (one that has had none counts the turn given
        just before it arrived as its own: it comes before the group served last) takes its
        oldest waiting sequence; on a tie, the group waiting longest. So one request's 256
        prompts take turns with a later request's one instead of all going first, and with
        one sequence per group (the default) this is the queue's order. A sequence
        `admissible` refuses is passed over and takes no turn."""
        queues: dict[object, deque[tuple[int, Sequence]]] = {}
        for i, seq in enumerate(self.waiting):
            if seq.status is Status.PREEMPTED:
                if admissible(seq):
                    yield seq
            else:
                queues.setdefault(group_of(seq), deque()).append((i, seq))
        # (the group's last turn, the queue position of its oldest waiting, the group): the
        # positions differ, so groups themselves are never compared
        turns = [(self._groups[g][1], q[0][0], g) for g, q in queues.items()]
        heapq.heapify(turns)
        turn = self._turn
        while turns:
            last, _, g = heapq.heappop(turns)
            q = queues[g]
            seq = q.popleft()[1]
            if admissible(seq):
                yield seq
                turn += 1
                last = turn
            if q:
                heapq.heappush(turns, (last, q[0][0], g))

    def _took_turn(self, seq: Sequence) -> None:
        """Count `seq`'s admission as its group's turn (_fair_order)."""
        self._turn += 1
        self._groups[group_of(seq)][1] = self._turn
