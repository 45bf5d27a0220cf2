"""What the scheduler plans with (pure Python): its shape (SchedulerConfig), one request's
tokens and cache state (Sequence), one step's rows as the runner takes them (StepPlan, each
sequence's rows a Chunk) and each slot's state for /slots and /metrics (SlotStats). The
Scheduler (scheduler.py) owns every Sequence and makes every StepPlan, which the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np


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
    window: int = 0            # sliding-window layers whose passed rows are handed back:
                               # their window (sliding_window.py); 0: every row kept

    def __post_init__(self) -> None:
        for name in ("step_tokens", "num_slots", "page_size", "pages_per_slot", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.window < 0:
            raise ValueError(f"window must be 0 or more, got {self.window}")
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
    def from_runner(cls, runner_config, chunk_tokens: int = 512,
                    window: int = 0) -> SchedulerConfig:
        """The scheduler shape matching a RunnerConfig (duck-typed: no JAX import here)."""
        rc = runner_config
        return cls(rc.step_tokens, rc.num_slots, rc.page_size, rc.num_pages,
                   rc.pages_per_slot, chunk_tokens, window)


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
    window_done: int = 0            # leading pages past which the sliding-window layers'
                                    # rows were handed back or kept (sliding_window.py)
    slot: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    draft: list[int] = field(default_factory=list)  # proposed tokens to verify next step
    draft_past_max: bool = False   # the draft's rows may pass max_tokens (Scheduler.set_draft)
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
class SlotStats:
    slot: int
    busy: bool
    seq_id: int | None
    n_prompt_tokens: int
    n_cached: int
    n_decoded: int
