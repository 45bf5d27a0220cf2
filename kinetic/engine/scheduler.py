"""The scheduler: which token rows of which sequences go into the next fixed-shape step.

There is no prefill phase and no decode phase (docs/architecture.md, the determinism contract).
A sequence holds `tokens` (prompt plus generated) and `num_computed`, how many of them have K/V
in the cache; the rows it still needs are tokens[num_computed:]. A sequence whose only
uncomputed token is its newest one gets one "decode" row (plus its draft rows, if the engine
set a draft); one with more gets a prompt chunk. The logits of a sequence's row are sampled
only when that row is its newest token, so the same rule covers chunked prompts, prefix reuse
and resumption after preemption.

One step, traced:
  schedule()   a step of at most step_tokens rows, filled in four passes:
               1. decode rows: one for every running sequence that is caught up, oldest
                  first, so a stream never skips a step while prompts are being computed;
               2. prompt rows: the running sequences with prompt rows left (oldest first),
                  then waiting sequences admitted into free slots (round-robin across
                  groups: fairness.py) with their cached prefix, share what is left
                  equally (each at most chunk_tokens; rows a short prompt leaves go to the
                  oldest first), so a short request behind a long prompt gets its first
                  token within a few steps, whatever the long one's length, and the long
                  one still advances every step. A waiting sequence whose next prefix page
                  a running one is computing waits for it (to find it cached, not compute
                  it twice) and the ones behind it go past it;
               3. draft rows: what is left goes to the drafts of the caught-up sequences,
                  oldest first (a draft is a guess; a prompt row is sure work).
               4. prefill rows (/v1/prefill): what is still left goes to the prefills, the
                  lowest priority of all (prefills.py).
               If pages run out, the newest running sequence is preempted (pages released,
               rows it was given this step taken back, re-queued at the FRONT of the waiting
               queue), and nothing is admitted in that step. Older sequences are never
               preempted for newer ones, and the oldest always gets a row: every sequence
               finishes.
  runner.step  the engine runs the plan's rows (kinetic/engine/runner.py)
  complete()   num_computed advances, sampled tokens are appended, newly full pages are
               registered for reuse, and sequences at max_tokens or the context end finish
               and release their pages at once.

Which rows a step holds never changes a row's result (docs/architecture.md, the determinism contract): only when it is computed.

Images. An image's rows (Sequence.image_keys) are keyed in pages by the image's digest,
not by their placeholder ids; an image whose rows attend to each other both ways
(Sequence.blocks: Gemma 3's) is computed within one step: a chunk never ends inside it.

The Scheduler's methods are here and in its three bases, one job each: fairness.py (the
order in which waiting sequences take free slots), prefix_reuse.py (a sequence starting from
its cached prefix: pages on the device or in host memory, a kept partial page, a recurrent
state snapshot), prefills.py (/v1/prefill) and sliding_window.py (the sliding-window layers'
rows that every query has passed, handed back). What it plans with (Sequence,
SchedulerConfig, StepPlan) is in sequence.py. All of it is pure Python, with no JAX.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from kinetic.engine.fairness import Fairness, group_of
from kinetic.engine.kv_cache import PageManager
from kinetic.engine.prefills import Prefilled, Prefills
from kinetic.engine.prefix_reuse import PrefixReuse
from kinetic.engine.sequence import (Chunk, ContextOverflow, SchedulerConfig, Sequence,
                                     SlotStats, Status, StepPlan)
from kinetic.engine.sliding_window import SlidingWindow


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler(Fairness, PrefixReuse, Prefills, SlidingWindow):
    """Continuous batching over S slots and a shared pool of KV pages (see the module
    docstring for one step). Owns the PageManager and every Sequence it was given."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        # released prefixes kept on the device: a quarter of one slot's context (kv_cache's
        # docstring); a whole one held 35 MB more of Gemma 3's float32 pages at -np 16
        self.pages = PageManager(config.num_pages, config.page_size,
                                 retain=max(1, config.pages_per_slot // 4))
        self.sequences: dict[int, Sequence] = {}   # every unfinished sequence
        self.waiting: deque[Sequence] = deque()    # in arrival order; preempted ones re-enter
                                                   # at the front
        self.running: list[Sequence] = []          # oldest arrival first
        self.prefills: deque[Sequence] = deque()   # prefills waiting for a slot, oldest first
        self.filling: list[Sequence] = []          # prefills in a slot, oldest first
        self.ended: list[Prefilled] = []           # prefills ended since take_prefilled
        self.num_preemptions = 0
        self._slots: list[Sequence | None] = [None] * config.num_slots
        self._arrivals = 0
        # fairness (_fair_order): group -> [its unfinished sequences, the number of its last
        # turn], and the number of the latest turn (one per admission)
        self._groups: dict[object, list[int]] = {}
        self._turn = 0
        self._budget = 0                       # while planning: rows left in the step
        self._taken: dict[int, tuple[int, int]] = {}   # while planning: seq id -> (rows, drafts)
        self.host = None       # a container of page keys held in host memory (engine's tier)
        self.keep_partial = True   # a finished sequence's partly filled last page goes to
                                   # host memory too (the engine turns it off with a draft
                                   # model, whose cache need not hold the same rows)
        # every leading run of a kept partial page's tokens -> the key its page is kept
        # under in host memory (most recent last; at most MAX_PARTIAL_KEYS)
        self._partials: OrderedDict[bytes, bytes] = OrderedDict()
        self.restores: list[tuple[int, bytes]] = []  # pages to fill from host this step
        # recurrent models (the engine sets it: recurrent_state.StateSnapshots): a sequence
        # resumes from a cached prefix only where a state snapshot was taken, and prompt
        # chunks end at the prompt's last page boundary so that one is taken there
        self.snapshots = None
        self.state_loads: list[tuple[int, object]] = []   # (slot, snapshot) this step
        self.state_saves: list[tuple[int, bytes, int, object]] = []   # (slot, key, position,
                                                                      # tag) after complete
        # sliding-window layers (config.window): keys of the pages whose rows in them were
        # handed back or listed to be (sliding_window.py)
        self.window_gone: set[bytes] = set()

    # --- requests ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue `seq` (never refused for being busy). Raises ContextOverflow if its prompt
        is longer than a slot's context, ValueError if its id is taken or it was used."""
        if seq.seq_id in self.sequences:
            raise ValueError(f"sequence id {seq.seq_id} is already queued or running")
        if seq.status is not Status.WAITING or seq.num_computed or seq.pages:
            raise ValueError(f"sequence {seq.seq_id} was already scheduled once")
        if seq.prefill:
            raise ValueError(f"sequence {seq.seq_id} is a prefill: add it with add_prefill")
        if len(seq.tokens) > self.config.max_context:
            raise ContextOverflow(
                f"the prompt has {len(seq.tokens)} tokens, more than the context of "
                f"{self.config.max_context} (pages_per_slot * page_size)")
        seq.arrival, self._arrivals = self._arrivals, self._arrivals + 1
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)
        self._groups.setdefault(group_of(seq), [0, self._turn - 1])[0] += 1

    def set_draft(self, seq_id: int, draft: list[int], past_max: bool = False) -> None:
        """Propose `draft` tokens to follow sequence `seq_id`'s newest token; the next step
        that finds it caught up verifies as many as fit (all rows' logits are sampled).
        past_max: rows for them even past the sequence's max_tokens (decode steps' placeholders,
        whose tokens past it are dropped); otherwise drafts stop there."""
        seq = self.sequences[seq_id]
        seq.draft = list(draft)
        seq.draft_past_max = past_max

    def finish(self, seq_id: int, reason: str = "stop") -> Sequence:
        """Finish sequence `seq_id` now (EOG, a stop string, a cancel): its slot and pages are
        released at once and it leaves the scheduler. Returns it."""
        seq = self.sequences.pop(seq_id)
        if seq.status is Status.RUNNING:
            self._keep_partial_page(seq)
            self._release(seq)
            (self.filling if seq.prefill else self.running).remove(seq)
        else:
            (self.prefills if seq.prefill else self.waiting).remove(seq)
        seq.status, seq.finish_reason, seq.draft = Status.FINISHED, reason, []
        if seq.prefill:
            self.ended.append(Prefilled(seq_id, self.cached_tokens(seq.tokens),
                                        max(0, seq.num_computed - seq.num_cached)))
        else:
            group = self._groups[group_of(seq)]
            group[0] -= 1
            if not group[0]:
                del self._groups[group_of(seq)]
        return seq

    def cancel(self, seq_id: int) -> Sequence:
        return self.finish(seq_id, "cancelled")

    # --- one step ---------------------------------------------------------------------
    def schedule(self, rows: int | None = None) -> StepPlan:
        """Plan the next step of at most step_tokens rows (`rows` instead where given:
        decode_steps.plan's turns, n steps of one row per sequence) (the module docstring's four
        passes): a decode row for every caught-up running sequence, oldest first; then
        prompt rows in equal shares for the running sequences still in their prompt and the
        waiting ones admitted into free slots, round-robin across groups (taking their
        cached prefix; see _admission_order for the order and for the ones that wait for a
        prefix being computed); then draft rows; then prefill rows (_fill), every prefill
        having ended first if a request waits. When pages run out (evictable ones are
        reclaimed by the PageManager first), the prefills give theirs up, then the newest
        running sequence is preempted: its pages released, num_computed reset, any rows it
        had in this step dropped, and it is re-queued at the front of the waiting queue; a
        step that preempted admits nothing.
        Allocates the pages of every row."""
        self._budget, self._taken, preempted = rows or self.config.step_tokens, {}, []
        if self.snapshots is not None:   # a snapshot goes with its prefix's last page
            self.snapshots.prune(lambda k: bool(self.pages.lookup([k])) or (
                self.host is not None and k in self.host))
        self._prune_window_gone()
        if self.waiting:   # a request waits for a slot or pages: no prefill may keep either
            for seq in self.filling + list(self.prefills):
                self.finish(seq.seq_id, "cancelled")
        todo = {s.seq_id: len(s.tokens) - s.num_computed for s in self.running}
        # 1. decode rows (caught-up sequences need exactly one row each to advance)
        for seq in list(self.running):
            if self._budget == 0:
                break
            if seq.status is Status.RUNNING and todo[seq.seq_id] == 1:
                self._take(seq, 1, preempted)
        # 2. prompt rows, shared equally by the running prompts and the waiting ones to admit
        # (admitting while preempting would only hand the victims' pages to newer requests)
        prompts = [s for s in self.running if todo[s.seq_id] > 1]
        admit = [] if preempted or not self._budget else self._admission_order()
        if self._budget and (prompts or admit):
            share = max(1, self._budget // (len(prompts) + len(admit)))
            for seq in prompts:
                if self._budget == 0:
                    break
                if seq.status is Status.RUNNING:   # else preempted for an older one
                    n = max(min(todo[seq.seq_id], self.config.chunk_tokens, share),
                            self._block_rows(seq))   # a both-ways image whole, if it can
                    self._take(seq, min(n, self._budget), preempted)
            for seq in admit:
                if preempted or self._budget == 0:
                    break
                n = self._admit(seq, min(share, self._budget))
                if n == 0:
                    break  # it does not fit: the ones after it wait behind it
                self.waiting.remove(seq)
                self._took_turn(seq)
                todo[seq.seq_id] = len(seq.tokens) - seq.num_computed
                self._taken[seq.seq_id] = (n, 0)
                self._budget -= n
            # the rows a short prompt left: oldest first, as far as free pages go
            for seq in self.running:
                if self._budget == 0:
                    break
                taken = self._taken.get(seq.seq_id)
                if taken and todo[seq.seq_id] > 1:
                    want = min(todo[seq.seq_id], self.config.chunk_tokens,
                               taken[0] + self._budget)
                    self._pages_from_prefills(seq, want)
                    self._extend(seq, want, 0)
        # 3. draft rows, oldest first, with what is left (never preempting for a guess)
        for seq in self.running:
            if self._budget == 0:
                break
            if seq.draft and seq.seq_id in self._taken and todo[seq.seq_id] == 1:
                # drafts may neither run past the context nor produce more than max_tokens
                room = self.config.max_context - len(seq.tokens)
                if seq.max_tokens is not None and not seq.draft_past_max:
                    room = min(room, seq.max_tokens - seq.n_decoded - 1)
                k = max(0, min(len(seq.draft), self._budget, room))
                if k:
                    self._extend(seq, 1 + k, None)
        # 4. prefill rows, with what is left (the lowest priority of all)
        self._fill(preempted)
        rows, chunks = [], []
        for seq in self.running + self.filling:   # oldest first, the prefills last
            if seq.seq_id in self._taken:
                n, n_draft = self._taken[seq.seq_id]
                self._emit(seq, n, n_draft, rows, chunks)
        self._taken = {}
        if not rows and not self.running and not self.waiting:
            for seq in self.filling + list(self.prefills):   # none can go on: never spin
                self.finish(seq.seq_id, "cancelled")
        return self._plan(rows, chunks, preempted)

    def complete(self, plan: StepPlan, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Apply a step's results. `sampled` maps each sequence with sampled rows to its new
        token, or for draft verification to the accepted draft tokens plus the target's next
        token. Advances num_computed, appends the tokens, registers newly full pages in the
        prefix cache, and finishes (finish_reason "length") sequences at max_tokens or the
        context end, releasing their pages. Sequences finished or cancelled since `schedule`
        are skipped. Returns the sequences finished here."""
        done = []
        for c in plan.chunks:
            seq = self.sequences.get(c.seq_id)
            if seq is None or seq.status is not Status.RUNNING or seq.num_computed != c.start:
                continue
            if c.sampled:
                new = sampled[c.seq_id]
                new = [int(t) for t in new] if isinstance(new, (list, tuple)) else [int(new)]
                accepted = len(new) - 1
                drafted = plan.tokens[c.first_row + c.num_rows - c.num_draft:
                                      c.first_row + c.num_rows].tolist()
                if not 0 <= accepted <= c.num_draft or new[:accepted] != drafted[:accepted]:
                    raise ValueError(f"sequence {c.seq_id}: {new} is not an accepted prefix "
                                     f"of the draft {drafted} plus one token")
                seq.num_computed = c.start + c.num_rows - c.num_draft + accepted
                seq.tokens.extend(new)
                seq.draft = []
            else:
                seq.num_computed += c.num_rows
            self._register_full_pages(seq)
            self._want_snapshot(seq, c)
            self._pass_window(seq)
            if seq.prefill:
                if seq.num_computed == len(seq.tokens):
                    self.finish(seq.seq_id, "stop")   # every page of it is cached now
                continue
            at_max = seq.max_tokens is not None and seq.n_decoded >= seq.max_tokens
            if at_max or len(seq.tokens) > self.config.max_context:
                done.append(self.finish(seq.seq_id, "length"))
        return done

    # --- inspection -------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.sequences)

    def slot_stats(self) -> list[SlotStats]:
        """One entry per slot, for /slots and /metrics."""
        return [SlotStats(i, False, None, 0, 0, 0) if s is None else
                SlotStats(i, True, s.seq_id, s.n_prompt, s.num_cached, s.n_decoded)
                for i, s in enumerate(self._slots)]

    def check_invariants(self) -> None:
        """Raise AssertionError unless slots, queues, pages and refcounts agree."""
        held: dict[int, int] = {}
        for seq in self.filling:
            assert seq.prefill and seq.seq_id in self.sequences
        for seq in self.prefills:
            assert seq.prefill and seq.status is Status.WAITING and not seq.pages
        for seq in self.running + self.filling:
            assert seq.status is Status.RUNNING and self._slots[seq.slot] is seq
            assert len(seq.pages) * self.config.page_size >= seq.num_computed
            assert len(seq.pages) <= self.config.pages_per_slot
            assert 0 <= seq.num_computed < len(seq.tokens)
            for page in seq.pages:
                held[page] = held.get(page, 0) + 1
        for seq in self.waiting:
            assert seq.status in (Status.WAITING, Status.PREEMPTED), seq.status
            assert not seq.pages and seq.slot is None and seq.num_computed == 0
            assert not seq.prefill
        assert not any(s.prefill for s in self.running)
        assert sum(s is not None for s in self._slots) == len(self.running) + len(self.filling)
        assert [s.arrival for s in self.running] == sorted(s.arrival for s in self.running)
        assert len(self.running) + len(self.waiting) + len(self.prefills) + len(
            self.filling) == len(self.sequences)
        members: dict[object, int] = {}
        for seq in self.running + list(self.waiting):
            members[group_of(seq)] = members.get(group_of(seq), 0) + 1
        assert members == {g: n for g, (n, _) in self._groups.items()}
        assert all(turn <= self._turn for _, turn in self._groups.values())
        self.pages.check_invariants(held)

    # --- internals --------------------------------------------------------------------
    def _take(self, seq: Sequence, n: int, preempted: list[int]) -> None:
        """Give running `seq` up to `n` rows of this step (at least one, preempting the
        newest running sequences while not even one fits; none if seq itself was the
        newest left). Rows of this step a victim was given go back to the budget."""
        n = self._reserve(seq, n, preempted)
        for victim in preempted:
            if victim in self._taken:
                self._budget += self._taken.pop(victim)[0]
        if n:
            self._taken[seq.seq_id] = (n, 0)
            self._budget -= n

    def _extend(self, seq: Sequence, n: int, n_draft: int | None) -> None:
        """Let `seq`, already given rows in this step, take up to `n` rows in all, as far as
        free pages go (no preemption). n_draft None: the rows past the first are drafts."""
        had = self._taken[seq.seq_id][0]
        n = max(had, self._fit(seq, n, self.pages.available))
        self._grow(seq, n)
        self._taken[seq.seq_id] = (n, n - 1 if n_draft is None else n_draft)
        self._budget -= n - had

    def _fit(self, seq: Sequence, n: int, extra_pages: int) -> int:
        """How many of `n` rows from num_computed on fit the pages seq holds plus
        `extra_pages` more."""
        return min(n, (len(seq.pages) + extra_pages) * self.config.page_size - seq.num_computed)

    def _reserve(self, seq: Sequence, n: int, preempted: list[int]) -> int:
        """Give running `seq` the pages for up to `n` rows, preempting the newest running
        sequences while not even one row fits (the prefills give their pages up first: see
        _pages_from_prefills). Returns the rows it may take (0 if it was preempted itself)."""
        self._pages_from_prefills(seq, n)
        while self._fit(seq, n, self.pages.available) < 1:
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return 0
        n = self._fit(seq, n, self.pages.available)
        self._grow(seq, n)
        return n

    def _grow(self, seq: Sequence, n: int) -> None:
        need = _cdiv(seq.num_computed + n, self.config.page_size) - len(seq.pages)
        if need > 0:
            seq.pages = seq.pages + self.pages.allocate(need)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed, seq.num_registered, seq.draft = Status.PREEMPTED, 0, 0, []
        seq.window_done = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.pages)
        self._slots[seq.slot] = None
        seq.pages, seq.slot = [], None

    def _emit(self, seq: Sequence, n: int, n_draft: int, rows: list, chunks: list) -> int:
        """Append seq's next n rows (the last n_draft from its draft) to the plan; returns n."""
        ps, start = self.config.page_size, seq.num_computed
        cut = self._snapshot_at(seq) if self.snapshots is not None and not n_draft else 0
        if start < cut < start + n:
            n = cut - start   # the rest next step, after the snapshot
        for lo, hi in seq.blocks:   # a chunk never ends inside an image that attends both ways
            if lo < start + n < hi and start < hi:
                n = max(0, lo - start)   # up to the image, or (it starts in it) nothing yet
        if n == 0:
            return 0
        toks = seq.tokens[start:start + n - n_draft] + seq.draft[:n_draft]
        chunks.append(Chunk(seq.seq_id, len(rows), start, n, n_draft, sampled=not seq.prefill
                            and start + n - n_draft == len(seq.tokens)))
        for i, tok in enumerate(toks):
            pos = start + i
            rows.append((seq.seq_id, tok, pos, seq.slot, seq.pages[pos // ps] * ps + pos % ps))
        return n

    def _block_rows(self, seq: Sequence) -> int:
        """The rows seq needs in this step when its next row is in an image whose rows attend
        both ways (they are computed together: _emit); else 0."""
        at = seq.num_computed
        return next((hi - at for lo, hi in seq.blocks if lo <= at < hi), 0)

    def page_table(self) -> np.ndarray:
        """[S, P] int32: each running sequence's pages in its slot's row, 0 elsewhere."""
        table = np.zeros((self.config.num_slots, self.config.pages_per_slot), np.int32)
        for seq in self.running + self.filling:
            table[seq.slot, :len(seq.pages)] = seq.pages
        return table

    def _plan(self, rows: list, chunks: list[Chunk], preempted: list[int]) -> StepPlan:
        table = self.page_table()
        cols = [np.array([r[i] for r in rows], np.int32) for i in range(1, 5)]
        plan = StepPlan([r[0] for r in rows], *cols, table, chunks, preempted,
                        self.pages.evicted, self.restores, self.state_loads)
        self.pages.evicted, self.restores, self.state_loads = [], [], []
        return plan
