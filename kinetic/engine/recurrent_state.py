"""Where each slot's recurrent state stands, and the recurrent part of each step it implies.

A delta-rule layer (kinetic/model/delta_net.py) keeps one state per slot on the device. This
host-side record knows, per slot, how many leading positions of its sequence the committed
state covers (`committed`) and how many draft rows after them left their inputs pending
(`pending`). From a step's rows alone it then plans the step's `Recur`:

- a slot's first row at position 0 starts from zeros (a new sequence);
- a slot's first row at position p > 0 starts from the committed state, after replaying the
  p - committed pending inputs (the drafts the last step verified and accepted); a p outside
  committed .. committed + pending is an error: nobody restored the state the row needs
  (Runner.load_state does, from a snapshot, when a sequence resumes from a cached prefix);
- a slot's later rows continue from the state the row before them wrote; sure rows write
  their slot's state (commit), draft rows the scratch state, keeping their inputs in the
  pending places 0, 1, ....

So the engine says nothing about drafts' outcomes: the next step's first position tells.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from kinetic.model.delta_net import Recur, extra_states


class StateNotRestored(RuntimeError):
    """A step's row needs a recurrent state its slot does not hold."""


@dataclass(frozen=True)
class StateSnapshot:
    """A slot's committed recurrent state at `position` (its sequence's first `position`
    tokens): per delta-rule layer, its (window, matrix) device arrays; and how many draft
    rows after it had their inputs pending in the slot when it was taken."""

    position: int
    arrays: tuple
    pending: int = 0


class RecurrentState:
    def __init__(self, config):
        self.num_slots, self.max_draft = config.num_slots, config.max_draft
        self.replays = max(1, config.num_slots * config.max_draft)   # R: a step's replay places
        self.committed = [0] * config.num_slots
        self.pending = [0] * config.num_slots
        self.compiling = False   # Runner.compile: every row on the padding slot, nothing recorded

    def restored(self, slot: int, position: int, pending: int = 0) -> None:
        """The slot's state now covers `position` positions, `pending` drafts' inputs after
        them still in its pending places (Runner.load_state)."""
        self.committed[slot], self.pending[slot] = position, pending

    def plan(self, slots: np.ndarray, positions: np.ndarray, drafts: np.ndarray | None,
             bucket: int) -> np.ndarray:
        """The packed Recur of a step whose first n rows are real (`unpack` reads it), and the
        record advanced past the step."""
        n, K = len(slots), self.max_draft
        PADDING, SCRATCH, ZERO = extra_states(self.num_slots)
        read, write = np.full(bucket, ZERO), np.full(bucket, PADDING)
        slot, pend = np.full(bucket, PADDING), np.full(bucket, -1)
        replay = []
        if not self.compiling:
            drafted: dict[int, int] = {}
            for r in range(n):
                s, p = int(slots[r]), int(positions[r])
                draft = drafts is not None and bool(drafts[r])
                slot[r] = s
                if r == 0 or int(slots[r - 1]) != s:
                    if draft:
                        raise ValueError(f"slot {s}: a step's first row of a slot is a draft")
                    if s in drafted:
                        raise ValueError(f"slot {s}: its rows are not together in the step")
                    drafted[s] = 0
                    read[r] = ZERO if self._start(s, p, replay) else s
                elif p != int(positions[r - 1]) + 1:
                    raise ValueError(f"slot {s}: row {r} at position {p} does not follow "
                                     f"position {positions[r - 1]}")
                else:   # the state the row before left: its slot's, or a draft chain's
                    read[r] = SCRATCH if drafted[s] else s
                if draft:
                    if drafted[s] >= K:
                        raise ValueError(f"slot {s}: more than max_draft={K} draft rows")
                    pend[r], write[r] = drafted[s], SCRATCH
                    drafted[s] += 1
                else:
                    if drafted[s]:
                        raise ValueError(f"slot {s}: a sure row after a draft row")
                    write[r] = s
                    self.committed[s] = p + 1
            for s, count in drafted.items():
                self.pending[s] = count
        slots_, idx = self._replay_arrays(replay)
        return np.concatenate([read, write, slot, pend, slots_, idx, [len(replay)]])

    def plan_decode(self, slots: np.ndarray, positions: np.ndarray, bucket: int) -> np.ndarray:
        """The packed recurrent part of Runner.decode_steps (`unpack_decode` reads it): N
        steps of one sure row per slot; the first starts as `plan` would, the others from
        the state the step before committed."""
        n = len(slots)
        PADDING, _, ZERO = extra_states(self.num_slots)
        read, write = np.full(bucket, ZERO), np.full(bucket, PADDING)
        replay = []
        for r in range(0 if self.compiling else n):
            s = int(slots[r])
            write[r] = s
            read[r] = ZERO if self._start(s, int(positions[0, r]), replay) else s
            self.committed[s], self.pending[s] = int(positions[-1, r]) + 1, 0
        slots_, idx = self._replay_arrays(replay)
        return np.concatenate([read, write, slots_, idx, [len(replay)]])

    def _start(self, s: int, p: int, replay: list) -> bool:
        """Whether slot s's first row, at position p, starts a new sequence (from zeros);
        queues the replays of the drafts accepted before it."""
        if p == 0:
            self.committed[s], self.pending[s] = 0, 0
            return True
        back = p - self.committed[s]
        if not 0 <= back <= self.pending[s]:
            raise StateNotRestored(
                f"slot {s}: a row at position {p}, but the slot's recurrent state covers "
                f"{self.committed[s]} positions (and {self.pending[s]} pending drafts)")
        replay += [(s, i) for i in range(back)]
        self.committed[s], self.pending[s] = p, 0
        return False

    def _replay_arrays(self, replay: list) -> tuple[np.ndarray, np.ndarray]:
        R = self.replays
        slots, idx = np.zeros(R, np.int64), np.zeros(R, np.int64)
        for i, (s, j) in enumerate(replay):
            slots[i], idx[i] = s, j
        return slots, idx

    @staticmethod
    def unpack(packed, B: int) -> Recur:
        """The Recur that `plan` packed for a B-row step."""
        R = (packed.shape[0] - 4 * B - 1) // 2
        f = [packed[i * B:(i + 1) * B] for i in range(4)]
        at = 4 * B
        return Recur(*f, packed[at:at + R], packed[at + R:at + 2 * R], packed[at + 2 * R:])

    @staticmethod
    def unpack_decode(packed, B: int):
        """i -> the Recur of decode step i, from what `plan_decode` packed."""
        R = (packed.shape[0] - 2 * B - 1) // 2
        read, write = packed[:B], packed[B:2 * B]
        replay_slot, replay_idx = packed[2 * B:2 * B + R], packed[2 * B + R:2 * B + 2 * R]
        n_replay = packed[2 * B + 2 * R:]

        def at(i):   # after the first step, each row continues from what it wrote; its slot
            first = i == 0   # (PADDING for padding rows) is what it writes
            return Recur(jnp.where(first, read, write), write, write, -jnp.ones(B, jnp.int32),
                         replay_slot, replay_idx, jnp.where(first, n_replay, 0))
        return at


class StateSnapshots:
    """The recurrent states kept for prefix reuse (the scheduler's; the runner takes and
    restores them): at most `capacity` snapshots, each under the key of the full page its
    position ends (kv_cache.page_key: the key names the whole token prefix), least recently
    used dropped first; each is a tuple of StateSnapshot, one per runner with recurrent
    layers (the target's, a draft model's). A snapshot whose page has left the cache
    (device and host memory) is dropped with it (`prune`). A sequence keeps one snapshot at its prompt's last page
    boundary, and its latest one while decoding (`tag`: a newer one of the same tag replaces
    it), so that a continued conversation resumes from the last page it shares."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_key: OrderedDict[bytes, tuple[StateSnapshot, object]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._by_key

    def put(self, key: bytes, snapshot: StateSnapshot, tag: object = None) -> None:
        if tag is not None:
            for old in [k for k, (_, t) in self._by_key.items() if t == tag]:
                del self._by_key[old]
        self._by_key.pop(key, None)
        self._by_key[key] = (snapshot, tag)
        while len(self._by_key) > self.capacity:
            self._by_key.popitem(last=False)

    def best(self, keys: list[bytes]) -> int:
        """The most leading pages of the key chain `keys` with a snapshot at their end (0:
        none); that snapshot becomes the most recently used."""
        for k in range(len(keys), 0, -1):
            if keys[k - 1] in self._by_key:
                self._by_key.move_to_end(keys[k - 1])
                return k
        return 0

    def get(self, key: bytes) -> StateSnapshot:
        return self._by_key[key][0]

    def prune(self, alive) -> int:
        """Drop the snapshots whose key `alive(key)` says is gone; returns how many."""
        gone = [k for k in self._by_key if not alive(k)]
        for k in gone:
            del self._by_key[k]
        return len(gone)
