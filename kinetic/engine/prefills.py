"""Prefills (/v1/prefill): the Scheduler's sequences that only fill the prefix cache.

A prefill (`add_prefill`) is a sequence whose rows are never sampled, and it ends once its
tokens are computed. The prefix cache keeps full pages only, so a prefill's tokens are cut
to whole pages when it is added (one shorter than a page ends at once). It runs on a free
slot with the step's leftover rows (pass 4 of scheduler.py), never while a request waits
for a slot or pages: a request waiting when a step is planned ends every prefill at once,
and a running sequence that needs pages takes them from the prefills first, before any
preemption. A prefill whose tokens start another's, or that another's start (the same
conversation grown or cut), ends that older one. An ended prefill leaves its full pages in
the cache, and its `Prefilled` record in `ended` for the engine to answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kinetic.engine.sequence import ContextOverflow, Sequence


@dataclass(frozen=True)
class Prefilled:
    """How a prefill ended: its leading tokens now in the prefix cache (whole pages, on the
    device or in host memory) and the rows it computed itself."""

    seq_id: int
    cached_tokens: int
    computed_tokens: int
    error: str | None = None   # set by the engine when it failed


class Prefills:
    """The Scheduler's prefills: a base of Scheduler, whose __init__ makes the state these
    methods use (`prefills`, `filling`, `ended`)."""

    def add_prefill(self, seq_id: int, tokens: list[int]) -> Sequence | None:
        """Queue a prefill of `tokens` cut to whole pages (the module docstring), ending the
        older prefills of the same conversation. Returns its Sequence, or None when not one
        page is left to compute: it has ended at once (in `ended`). Raises ContextOverflow
        past a slot's context, ValueError if the id is taken."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence id {seq_id} is already queued or running")
        if len(tokens) > self.config.max_context:
            raise ContextOverflow(
                f"the prefill has {len(tokens)} tokens, more than the context of "
                f"{self.config.max_context} (pages_per_slot * page_size)")
        ps = self.config.page_size
        whole = list(tokens[:len(tokens) // ps * ps])
        for old in list(self.prefills) + self.filling:
            n = min(len(old.tokens), len(whole))
            if n and old.tokens[:n] == whole[:n]:
                self.finish(old.seq_id, "cancelled")
        if not whole:
            self.ended.append(Prefilled(seq_id, 0, 0))
            return None
        seq = Sequence(seq_id, whole, prefill=True)
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.sequences[seq_id] = seq
        self.prefills.append(seq)
        return seq

    def take_prefilled(self) -> list[Prefilled]:
        """The prefills ended since the last call (done, cut short or cancelled), to answer."""
        out, self.ended = self.ended, []
        return out

    @property
    def prefilling(self) -> bool:
        """Whether a prefill is queued or running."""
        return bool(self.prefills or self.filling)

    def _pages_from_prefills(self, seq: Sequence, n: int) -> None:
        """End prefills, newest first, while running `seq` lacks the pages for `n` rows: a
        prefill never holds pages a request needs (its full pages stay in the cache)."""
        while self.filling and self._fit(seq, n, self.pages.available) < n:
            self.finish(self.filling[-1].seq_id, "cancelled")

    def _fill(self, preempted: list[int]) -> None:
        """Pass 4: the rows left in this step go to the prefills in a slot, oldest first (a
        prefill that cannot get a page ends, keeping what it has computed), then queued
        prefills take free slots, unless this step preempted (no request waits: schedule
        ended every prefill otherwise). A prefill whose next page a running sequence is
        computing waits for it, as a request does."""
        for seq in list(self.filling):
            if self._budget == 0:
                return
            want = min(len(seq.tokens) - seq.num_computed, self.config.chunk_tokens,
                       self._budget)
            n = self._fit(seq, want, self.pages.available)
            if n < 1:
                self.finish(seq.seq_id, "cancelled")
                continue
            self._grow(seq, n)
            self._taken[seq.seq_id] = (n, 0)
            self._budget -= n
        if preempted or self.waiting:
            return
        computing = {k for s in self.running + self.filling
                     if len(s.tokens) - s.num_computed > 1 for k in self._future_keys(s)}
        for seq in list(self.prefills):
            if self._budget == 0 or None not in self._slots:
                return
            if self._waits_for_prefix(seq, computing):
                continue
            n = self._admit(seq, self._budget)
            if n == 0:   # all of it is cached already, or not one page is to be had
                self.finish(seq.seq_id, "stop")
                continue
            self.prefills.remove(seq)
            self._taken[seq.seq_id] = (n, 0)
            self._budget -= n
            computing.update(self._future_keys(seq))
