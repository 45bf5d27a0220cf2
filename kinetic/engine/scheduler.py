"""The scheduler: which token rows of which sequences go into the next fixed-shape step.

There is no prefill phase and no decode phase (DESIGN.md). A sequence holds `tokens` (prompt
plus generated) and `num_computed`, how many of them have K/V in the cache; the rows it still
needs are tokens[num_computed:]. A sequence whose only uncomputed token is its newest one
gets one "decode" row (plus its draft rows, if the engine set a draft); one with more gets a
prompt chunk. The logits of a sequence's row are sampled only when that row is its newest
token, so the same rule covers chunked prompts, prefix reuse and resumption after preemption.

One step, traced:
  schedule()   a step of at most step_tokens rows, filled in four passes:
               1. decode rows: one for every running sequence that is caught up, oldest
                  first, so a stream never skips a step while prompts are being computed;
               2. prompt rows: the running sequences with prompt rows left (oldest first),
                  then waiting sequences admitted into free slots (round-robin across
                  groups: "Fairness" below) with their cached prefix, share what is left
                  equally (each at most chunk_tokens; rows a short prompt leaves go to the
                  oldest first), so a short request behind a long prompt gets its first
                  token within a few steps, whatever the long one's length, and the long
                  one still advances every step. A waiting sequence whose next prefix page
                  a running one is computing waits for it (to find it cached, not compute
                  it twice) and the ones behind it go past it;
               3. draft rows: what is left goes to the drafts of the caught-up sequences,
                  oldest first (a draft is a guess; a prompt row is sure work).
               4. prefill rows (/v1/prefill): what is still left goes to the prefills, the
                  lowest priority of all (see "Prefills" below).
               If pages run out, the newest running sequence is preempted (pages released,
               rows it was given this step taken back, re-queued at the FRONT of the waiting
               queue), and nothing is admitted in that step. Older sequences are never
               preempted for newer ones, and the oldest always gets a row: every sequence
               finishes.
  runner.step  the engine runs the plan's rows (kinetic/engine/runner.py)
  complete()   num_computed advances, sampled tokens are appended, newly full pages are
               registered for reuse, and sequences at max_tokens or the context end finish
               and release their pages at once.

Which rows a step holds never changes a row's result (DESIGN.md): only when it is computed.

Fairness. Every sequence has a group (`Sequence.group`: the API gives all the prompts of one
HTTP request one group; by default a sequence is a group of its own). Free slots go to the
waiting sequences round-robin across groups, not in arrival order: each admission is a
group's turn, the next free slot goes to the group whose last turn is the oldest (a group
new to the queue comes right before the one served last), and it takes its oldest waiting
sequence (`_fair_order`). So a one-prompt request that arrives behind a 256-prompt one takes
the next slot that frees instead of waiting for 256 answers, and the big one still has a
turn in every round, however many others come. With one sequence per group this is the
arrival order. Preempted sequences still go first.

Recurrent models (Qwen3.5: `snapshots` set). A sequence's recurrent state is not in its
pages, so it resumes from a cached prefix only where a state snapshot was kept
(recurrent_state.StateSnapshots, keyed by the page key the snapshot's position ends): a
prompt chunk is cut at the prompt's last page boundary so that a snapshot is taken there,
a decoding sequence's latest full page gets one too, the plan carries the snapshot to
restore (`state_loads`) and `complete` asks for the new ones (`take_state_saves`).
Partial pages are not reused for them.

Images. An image's rows (Sequence.image_keys) are keyed in pages by the image's digest,
not by their placeholder ids; an image whose rows attend to each other both ways
(Sequence.blocks: Gemma 3's) is computed within one step: a chunk never ends inside it.

Prefills. A prefill (`add_prefill`) is a sequence that only fills the prefix cache: its rows
are never sampled, and it ends once its tokens are computed. The prefix cache keeps full
pages only, so a prefill's tokens are cut to whole pages when it is added (one shorter than a
page ends at once). It runs on a free slot with the step's leftover rows (pass 4), never while
a request waits for a slot or pages: a request waiting when a step is planned ends every
prefill at once, and a running sequence that needs pages takes them from the prefills first,
before any preemption. A prefill whose tokens start another's, or that another's start (the
same conversation grown or cut), ends that older one. An ended prefill leaves its full pages
in the cache, and its `Prefilled` record in `ended` for the engine to answer.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kinetic.engine.kv_cache import PageManager, extend_keys, partial_key

MAX_PARTIAL_KEYS = 1 << 14   # leading runs of kept partial pages the scheduler remembers


class ContextOverflow(ValueError):
    """A prompt that cannot fit a slot's context; raised by `Scheduler.add` before any work."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class SchedulerConfig:
    step_tokens: int = 16      # T: rows per step
    num_slots: int = 1         # S: sequences running at once (--parallel)
    page_size: int = 16
    num_pages: int = 129       # including the reserved page 0
    pages_per_slot: int = 128  # P: context = P * page_size
    chunk_tokens: int = 512    # most prompt rows one sequence gets in one step

    def __post_init__(self) -> None:
        for name in ("step_tokens", "num_slots", "page_size", "pages_per_slot", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        # Every running sequence takes a row in each step: decode rows first, so a step that
        # could not hold them all would leave the newest streams, or the oldest prompt, out.
        if self.step_tokens < self.num_slots:
            raise ValueError(f"step_tokens={self.step_tokens} is less than num_slots="
                             f"{self.num_slots}: every running sequence needs a row per step")
        # One sequence alone must always be able to reach its context end, or preemption
        # could not guarantee progress.
        if self.num_pages - 1 < self.pages_per_slot:
            raise ValueError(f"num_pages={self.num_pages} leaves fewer than pages_per_slot="
                             f"{self.pages_per_slot} usable pages (page 0 is reserved)")

    @property
    def max_context(self) -> int:
        return self.pages_per_slot * self.page_size

    @classmethod
    def from_runner(cls, runner_config, chunk_tokens: int = 512) -> SchedulerConfig:
        """The scheduler shape matching a RunnerConfig (duck-typed: no JAX import here)."""
        rc = runner_config
        return cls(rc.step_tokens, rc.num_slots, rc.page_size, rc.num_pages,
                   rc.pages_per_slot, chunk_tokens)


@dataclass(eq=False)
class Sequence:
    """One request's tokens and cache state; the scheduler owns every field but `draft`."""

    seq_id: int
    prompt: list[int]
    max_tokens: int | None = None   # new tokens to generate; None: until the context end
    tokens: list[int] = field(init=False)
    num_computed: int = 0           # tokens whose K/V are in the cache
    num_cached: int = 0             # prompt tokens taken from the prefix cache at first admission
    pages: list[int] = field(default_factory=list)
    page_keys: list[bytes] = field(default_factory=list)  # key chain of tokens' full pages
    num_registered: int = 0         # leading pages known to the prefix cache
    slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    draft: list[int] = field(default_factory=list)  # proposed tokens to verify next step
    arrival: int = -1               # order of `add`; older sequences are never preempted first
    group: object = None            # who asked (one HTTP request's prompts share one): waiting
                                    # sequences are admitted round-robin across groups;
                                    # None: a group of its own
    use_prefix_cache: bool = True   # False: compute every row (teacher-forced scoring)
    prefill: bool = False           # only fills the prefix cache (add_prefill): never sampled
    # image rows: position -> the value the page keys hash in place of the placeholder token
    # (from the image's digest), so a cached page holds the same image's rows only
    image_keys: dict[int, int] = field(default_factory=dict)
    # images whose rows attend to each other both ways: (start, end) positions, each computed
    # in one step (a row reads the keys of the rows after it)
    blocks: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt = list(self.prompt)
        self.tokens = list(self.prompt)
        if not self.prompt:
            raise ValueError(f"sequence {self.seq_id}: empty prompt")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"sequence {self.seq_id}: max_tokens must be at least 1")

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def key_tokens(self) -> list[int]:
        """The tokens as the prefix cache's keys hash them: image rows by their image."""
        if not self.image_keys:
            return self.tokens
        out = list(self.tokens)
        for position, value in self.image_keys.items():
            out[position] = value
        return out

    @property
    def n_decoded(self) -> int:
        return len(self.tokens) - len(self.prompt)


@dataclass(frozen=True)
class Chunk:
    """Rows first_row .. first_row+num_rows-1 of a plan belong to `seq_id`, starting at
    position `start`; the last `num_draft` of them are draft tokens."""

    seq_id: int
    first_row: int
    start: int
    num_rows: int
    num_draft: int
    sampled: bool   # whether the rows' logits are sampled (the chunk reaches the newest token)


@dataclass
class StepPlan:
    """One step's rows as the runner takes them, plus what `complete` needs to know."""

    seq_ids: list[int]          # [n] owner of each row
    tokens: np.ndarray          # [n] int32
    positions: np.ndarray       # [n] int32
    slots: np.ndarray           # [n] int32
    write_index: np.ndarray     # [n] int32: page * page_size + offset
    page_table: np.ndarray      # [S, P] int32, RESERVED_PAGE where unused
    chunks: list[Chunk]
    preempted: list[int]        # sequences preempted while planning this step
    # Before the step runs: save `evicted` pages (still intact on the device) to host memory,
    # then copy `restores` (page, key) from host memory into their new pages.
    evicted: list[tuple[int, bytes]] = field(default_factory=list)
    restores: list[tuple[int, bytes]] = field(default_factory=list)
    # recurrent models: (slot, snapshot) states to restore before the step (a sequence
    # resuming from a cached prefix at the snapshot's position)
    state_loads: list[tuple[int, object]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.seq_ids)

    @property
    def draft_rows(self) -> np.ndarray:
        """[n] bool: the rows that are unverified drafts."""
        out = np.zeros(len(self.seq_ids), bool)
        for c in self.chunks:
            out[c.first_row + c.num_rows - c.num_draft:c.first_row + c.num_rows] = True
        return out

    @property
    def sample_rows(self) -> dict[int, list[int]]:
        """seq id -> the rows whose logits are sampled: the last row of a chunk that reaches
        the newest token, or every draft-verification row (the decode row and its drafts)."""
        out = {}
        for c in self.chunks:
            if c.sampled:
                end = c.first_row + c.num_rows
                out[c.seq_id] = list(range(end - c.num_draft - 1, end))
        return out


@dataclass(frozen=True)
class Prefilled:
    """How a prefill ended: its leading tokens now in the prefix cache (whole pages, on the
    device or in host memory) and the rows it computed itself."""

    seq_id: int
    cached_tokens: int
    computed_tokens: int
    error: str | None = None   # set by the engine when it failed


@dataclass(frozen=True)
class SlotStats:
    slot: int
    busy: bool
    seq_id: int | None
    n_prompt_tokens: int
    n_cached: int
    n_decoded: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _group(seq: Sequence) -> object:
    return seq if seq.group is None else seq.group


class Scheduler:
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
        self._groups.setdefault(_group(seq), [0, self._turn - 1])[0] += 1

    def add_prefill(self, seq_id: int, tokens: list[int]) -> Sequence | None:
        """Queue a prefill of `tokens` cut to whole pages (the module docstring's "Prefills"),
        ending the older prefills of the same conversation. Returns its Sequence, or None when
        not one page is left to compute: it has ended at once (in `ended`). Raises
        ContextOverflow past a slot's context, ValueError if the id is taken."""
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

    def cached_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the prefix cache holds: whole pages, on the
        device or in host memory (a recurrent model: up to the last one with a state
        snapshot, where a sequence can resume)."""
        ps = self.config.page_size
        keys = extend_keys([], tokens, ps, len(tokens) // ps)
        j = len(self.pages.lookup(keys))
        while j < len(keys) and self.host is not None and keys[j] in self.host:
            j += 1
        if self.snapshots is not None:
            j = self.snapshots.best(keys[:j])
        return j * ps

    def forget(self, tokens: list[int]) -> int:
        """Drop the prefix cache's pages of `tokens` that no running sequence uses, on the
        device and in host memory: the whole pages, and the partly filled page kept for the
        tokens past them (_keep_partial_page). Returns how many tokens' pages were dropped."""
        ps = self.config.page_size
        full = len(tokens) // ps
        keys = extend_keys([], tokens, ps, full)
        dropped = self.pages.forget(keys) * ps
        if self.host is not None:
            dropped = max(dropped, sum(self.host.drop(k) for k in keys) * ps)
            tail, parent = tokens[full * ps:], keys[-1] if keys else None
            runs = [self._partials.pop(partial_key(parent, tail[:i]), None)
                    for i in range(1, len(tail) + 1)]
            if [self.host.drop(kept) for kept in set(runs) - {None}].count(True):
                dropped += len(tail)
        return dropped

    def set_draft(self, seq_id: int, draft: list[int]) -> None:
        """Propose `draft` tokens to follow sequence `seq_id`'s newest token; the next step
        that finds it caught up verifies as many as fit (all rows' logits are sampled)."""
        self.sequences[seq_id].draft = list(draft)

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
            group = self._groups[_group(seq)]
            group[0] -= 1
            if not group[0]:
                del self._groups[_group(seq)]
        return seq

    def cancel(self, seq_id: int) -> Sequence:
        return self.finish(seq_id, "cancelled")

    # --- one step ---------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        """Plan the next step of at most step_tokens rows (the module docstring's four
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
        self._budget, self._taken, preempted = self.config.step_tokens, {}, []
        if self.snapshots is not None:   # a snapshot goes with its prefix's last page
            self.snapshots.prune(lambda k: bool(self.pages.lookup([k])) or (
                self.host is not None and k in self.host))
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
                if seq.max_tokens is not None:
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

    @property
    def prefilling(self) -> bool:
        """Whether a prefill is queued or running."""
        return bool(self.prefills or self.filling)

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
            members[_group(seq)] = members.get(_group(seq), 0) + 1
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

    def _future_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the full pages of seq's known tokens that it has not computed yet."""
        ps = self.config.page_size
        full = len(seq.tokens) // ps
        return extend_keys(seq.page_keys, seq.key_tokens, ps, full)[seq.num_computed // ps:full]

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
                queues.setdefault(_group(seq), deque()).append((i, seq))
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
        self._groups[_group(seq)][1] = self._turn

    def _waits_for_prefix(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Whether waiting `seq`'s first page not cached (on the device or in host memory)
        is one a running sequence is computing."""
        if not computing or not seq.use_prefix_cache:
            return False
        ps = self.config.page_size
        cacheable = (len(seq.tokens) - 1) // ps
        keys = extend_keys(seq.page_keys, seq.key_tokens, ps, cacheable)[:cacheable]
        j = len(self.pages.lookup(keys))
        while j < len(keys) and self.host is not None and keys[j] in self.host:
            j += 1
        return j < len(keys) and keys[j] in computing

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

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Start waiting `seq` in a free slot with its cached prefix, if pages for at least
        one row can be had without preempting. Returns the rows it gets (0: not admitted)."""
        ps = self.config.page_size
        # the last token is always computed: its logits are what the step is for (a prefill
        # wants no logits, and its tokens are whole pages)
        last = 0 if seq.prefill else 1
        cacheable = (len(seq.tokens) - last) // ps if seq.use_prefix_cache else 0
        keys = extend_keys(seq.page_keys, seq.key_tokens, ps, cacheable)[:cacheable]
        hits = self.pages.lookup(keys)
        revived = sum(self.pages.refcount(p) == 0 for p in hits)  # leave the evictable list
        # pages of the prefix that were evicted to host memory come back by copy
        from_host = []
        if self.host is not None:
            for key in keys[len(hits):]:
                if key not in self.host:
                    break
                from_host.append(key)
            from_host = from_host[:max(0, self.pages.available - revived - 1)]
        snapshot = None
        if self.snapshots is not None:   # a recurrent state: resume where one was kept
            k = self.snapshots.best(keys[:len(hits) + len(from_host)])
            snapshot = self.snapshots.get(keys[k - 1]) if k else None
            hits, from_host = hits[:k], from_host[:max(0, k - len(hits))]
            revived = sum(self.pages.refcount(p) == 0 for p in hits)
        computed = (len(hits) + len(from_host)) * ps
        partial = self._partial_hit(seq, keys[:len(hits) + len(from_host)], last,
                                    self.pages.available - revived - len(from_host))
        if partial is not None:
            computed += partial[1]
        need = next((hi - computed for lo, hi in seq.blocks if lo <= computed < hi), 0)
        n = min(len(seq.tokens) - computed, self.config.chunk_tokens,   # (a both-ways image
                max(budget, min(need, self._budget)))                  # whole, if it can)
        n = min(n, (len(hits) + self.pages.available - revived) * ps - computed)
        if n < 1:
            return 0
        self.pages.acquire(hits)
        if from_host:
            restored = self.pages.allocate(len(from_host))
            for page, key in zip(restored, from_host):
                self.pages.register(page, key)
                self.restores.append((page, key))
            hits = hits + restored
        seq.pages, seq.num_computed, seq.num_registered = hits, computed, len(hits)
        if partial is not None:   # a private copy: this sequence writes on into the page
            page = self.pages.allocate(1)[0]
            self.restores.append((page, partial[0]))
            seq.pages = hits + [page]
        if seq.status is Status.WAITING:
            seq.num_cached = computed
        self._grow(seq, n)
        seq.slot = self._slots.index(None)
        self._slots[seq.slot] = seq
        seq.status = Status.RUNNING
        if snapshot is not None:
            self.state_loads.append((seq.slot, snapshot))
        if seq.prefill:
            self.filling.append(seq)
            return n
        later = [i for i, s in enumerate(self.running) if s.arrival > seq.arrival]
        self.running.insert(later[0] if later else len(self.running), seq)
        return n

    def _partial_hit(self, seq: Sequence, keys: list[bytes], last: int,
                     pages_left: int) -> tuple[bytes, int] | None:
        """(key, rows) of the longest partly filled page in host memory that continues the
        cached whole pages `keys` with seq's next tokens (leaving `last` tokens to compute),
        if a page is left to copy it into; else None."""
        if (self.host is None or not self.keep_partial or not seq.use_prefix_cache
                or seq.prefill or pages_left < 1 or self.snapshots is not None):
            return None
        ps, start = self.config.page_size, len(keys) * self.config.page_size
        parent = keys[-1] if keys else None
        pending = {key for _, key in self.pages.evicted}   # saved before this plan's restores
        keyed = seq.key_tokens   # (a copy, where the sequence has images: made once)
        for k in range(min(ps - 1, len(seq.tokens) - last - start), 0, -1):
            kept = self._partials.get(partial_key(parent, keyed[start:start + k]))
            if kept is not None and (kept in self.host or kept in pending):
                return kept, k
        return None

    def _keep_partial_page(self, seq: Sequence) -> None:
        """Send the partly filled last page of a finishing sequence to host memory (as an
        evicted page is sent: the engine copies it before the next step writes anywhere), so
        that a later prompt that starts the same reuses those rows too, not only whole pages."""
        if (self.host is None or not self.keep_partial or not seq.use_prefix_cache or seq.prefill
                or self.snapshots is not None):   # (no recurrent state to resume it with)
            return
        ps = self.config.page_size
        full, k = divmod(seq.num_computed, ps)
        if k == 0 or full >= len(seq.pages):
            return
        keyed = seq.key_tokens
        extend_keys(seq.page_keys, keyed, ps, full)
        parent = seq.page_keys[full - 1] if full else None
        tail = keyed[full * ps:full * ps + k]
        kept = partial_key(parent, tail)
        if kept not in self.host:
            self.pages.evicted.append((seq.pages[full], kept))
        for i in range(1, k + 1):
            run = partial_key(parent, tail[:i])
            self._partials.pop(run, None)
            self._partials[run] = kept
        while len(self._partials) > MAX_PARTIAL_KEYS:
            self._partials.popitem(last=False)

    def _grow(self, seq: Sequence, n: int) -> None:
        need = _cdiv(seq.num_computed + n, self.config.page_size) - len(seq.pages)
        if need > 0:
            seq.pages = seq.pages + self.pages.allocate(need)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.num_computed, seq.num_registered, seq.draft = Status.PREEMPTED, 0, 0, []
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.pages.release(seq.pages)
        self._slots[seq.slot] = None
        seq.pages, seq.slot = [], None

    def _register_full_pages(self, seq: Sequence) -> None:
        full = seq.num_computed // self.config.page_size
        extend_keys(seq.page_keys, seq.key_tokens, self.config.page_size, full)
        for i in range(seq.num_registered, full):
            self.pages.register(seq.pages[i], seq.page_keys[i])
        seq.num_registered = max(seq.num_registered, full)

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

    def _snapshot_at(self, seq: Sequence) -> int:
        """Where a recurrent model keeps a state snapshot of seq's prompt: its last page
        boundary before the token whose logits are sampled (a prefill: its end)."""
        ps = self.config.page_size
        return len(seq.tokens) if seq.prefill else (len(seq.tokens) - 1) // ps * ps

    def _want_snapshot(self, seq: Sequence, chunk: Chunk) -> None:
        """After a step: ask for a snapshot of seq's state if the step ended its prompt's
        snapshot position, or (decoding) a page (the sequence's latest, tagged with its id)."""
        ps, at = self.config.page_size, seq.num_computed
        if self.snapshots is None or not seq.use_prefix_cache or at == 0 or at % ps:
            return
        if at == self._snapshot_at(seq) and not chunk.sampled:
            self.state_saves.append((seq.slot, seq.page_keys[at // ps - 1], at, None))
        elif chunk.sampled:
            self.state_saves.append((seq.slot, seq.page_keys[at // ps - 1], at, seq.seq_id))

    def take_state_saves(self) -> list[tuple[int, bytes, int, object]]:
        """The snapshots `complete` asked for: (slot, page key, position, tag)."""
        out, self.state_saves = self.state_saves, []
        return out

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
