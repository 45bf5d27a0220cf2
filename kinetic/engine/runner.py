"""The runner: the one place that builds device arrays and calls the device, for the model's
steps and for sampling (Runner.sample: engine/sample_device.py); the engine calls it with
host arrays and gets host values back, and imports no JAX.

A step carries up to `step_tokens` rows, whatever mix of prompt chunks and decode rows.
With the C++ kernels (cfg.kernel "ffi") or the Pallas ones ("pallas") a row's result does
not depend on how many rows the step has (docs/architecture.md, the determinism contract;
exact_rows), so each step runs at the smallest of a few compiled row buckets (1, 2, 4, ...
step_tokens) that holds its rows: one stream decodes at M = 1. With XLA's
dot (kernel "xla"), which is not batch-invariant, every step runs at step_tokens rows. The
rows a caller does not fill are padding that writes into the reserved page 0 and whose
logits are dropped. The KV cache is one (k, v) pair of page arrays per layer, donated to
each step so XLA updates it in place.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from kinetic import compile_cache
from kinetic.kernels import REPACK16
from kinetic.kernels import ffi as native
from kinetic.kernels import target
from kinetic.engine.recurrent_state import RecurrentState, StateSnapshot
from kinetic.engine.sample_batch import SampleBatch, SampleShape
from kinetic.engine.sample_device import DeviceSampler, Drawn, greedy_tokens
from kinetic.engine import hosts, split as splits
from kinetic.engine.engine_config import Split
from kinetic.model import delta_net
from kinetic.memory import drop_file_pages, file_pages
from kinetic.model.layers import Proj, StepInput, kv_storage
from kinetic.model.loader import LoadedModel
from kinetic.model.weights import join_buffer, split_buffer

RESERVED_PAGE = 0  # padding rows write here; no sequence's valid positions ever map to it
PAGE_COPY_BATCH = 8  # pages restored from host memory per compiled copy
KEY_BUCKET_TOKENS = 128  # smallest key axis a step reads; the next ones are 4x larger
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # compiled step sizes (exact_rows)
EMBEDDING_DROP_STEPS = 4  # device calls between two drop_embedding_pages


@dataclass(frozen=True)
class RunnerConfig:
    step_tokens: int = 16     # T: most rows per step
    num_slots: int = 1        # S: sequences whose pages a step can read
    page_size: int = 16
    num_pages: int = 129      # including the reserved page 0
    pages_per_slot: int = 128  # P: a slot's page table length; context = P * page_size
    kv_dtype: str = "float16"  # the cache's type (EngineConfig.kv_dtype)
    decode_steps: int = 1     # most greedy decode steps one device call runs (decode_steps)
    max_draft: int = 0        # most draft rows of one sequence in a step (recurrent models:
                              # the places its drafts' inputs are kept until verified)
    image_rows: bool = False  # steps may take rows as embeddings (a vision model's images)
    split: Split = field(default_factory=Split)   # the devices the weights are split over

    def __post_init__(self) -> None:
        if self.step_tokens < 1:
            raise ValueError("step_tokens must be at least 1")
        if self.num_pages < 2 or self.pages_per_slot < 1 or self.page_size < 1:
            raise ValueError("the KV cache needs at least one page besides the reserved one")

    @property
    def max_context(self) -> int:
        return self.pages_per_slot * self.page_size


def mirrored(method):
    """A Runner method that runs programs over the mesh. With several processes the leader
    sends each call (its host arguments; a progress callback stays here) to the followers
    before it runs, and they make it too (engine/hosts.py): the calls it makes itself are
    theirs as well, so only the outermost is sent."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self._leader is None or self._mirroring:
            return method(self, *args, **kwargs)
        self._leader.send(method.__name__, args,
                          {k: v for k, v in kwargs.items() if k != "progress"})
        self._mirroring = True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._mirroring = False
    return call


class Runner:
    """Owns the weights, the KV cache and the compiled step of one model. role: "target",
    or "draft" for --model-draft's (which of a follower's Runners a mirrored call is for:
    engine/hosts.py)."""

    def __init__(self, model: LoadedModel, config: RunnerConfig, role: str = "target"):
        self.model, self.config = model, config
        cfg = model.config
        self._cache: list | None = None   # allocated on first use: see `cache`
        self._step = _compiled_step(model.arch.forward, cfg)
        self._decode = _compiled_decode(model.arch.forward, cfg)
        self._buffer, self._skeleton = split_buffer(model.weights)   # see split_buffer
        # --split-mode row or layer: the buffer split over a mesh of devices
        # (engine/split.py), the sampler's inputs on the main device
        self.mesh, self._main = None, None
        self._heads = None   # the mesh when the cache is split by heads (split.heads_split)
        # several processes (engine/hosts.py): the leader sends each mirrored call first
        self._leader: hosts.Leader | None = None
        self._mirroring = False   # inside a mirrored call (the ones it makes are not sent)
        if config.split.active:
            splits.check(config.split, cfg)
            self.mesh = splits.mesh(config.split)
            self._main = jax.devices()[config.split.main_device]
            if self._main.process_index != jax.process_index():   # a follower (hosts.py)
                self._main = jax.local_devices()[0]
            model.finish_repack()   # the shares are copied from the rearranged bytes
            if self._buffer is None:   # the pallas kernel's planes (no file buffer)
                self._skeleton = splits.shard_planes(self._skeleton, self.mesh, config.split)
            else:
                self._buffer, self._skeleton = splits.shard_weights(
                    self._buffer, self._skeleton, self.mesh, config.split)
            self._heads = self.mesh if splits.heads_split(cfg, self.mesh) else None
            if hosts.joined() and hosts.is_leader():
                if role == "target":   # (the draft's runner is made right after it)
                    hosts.wait_for_all("loaded")
                self._leader = hosts.Leader(role)
                self._leader.send("__init__", (config, cfg), {})
        self._warming = False   # compile's warm-up steps run (on zero weights)
        # the C++ kernels and the pallas kernel give a row the same bits in any step
        self.exact_rows = cfg.kernel in ("ffi", "pallas")
        # the C++ kernel computes and writes only a mask's rows of the output projection, so
        # one logits shape a bucket serves every want (_logit_shape)
        self._mask_costs_its_rows = cfg.kernel == "ffi"
        T = config.step_tokens
        self.row_buckets = ([b for b in ROW_BUCKETS if b < T] + [T]) if self.exact_rows else [T]
        self.state = RecurrentState(config) if cfg.recurrent else None
        self._no_images: dict[int, jax.Array] = {}   # bucket -> zero embedding rows
        # the layers whose cache is pages (k, v) and those whose is a per-slot state
        recurrent = cfg.recurrent_layers or (False,) * cfg.n_layer
        self._paged = tuple(i for i, r in enumerate(recurrent) if not r)
        self._recurrent = tuple(i for i, r in enumerate(recurrent) if r)
        # the sliding-window layers whose passed rows can be handed back to the system: the
        # C++ kernels' cache is host memory from lazy_zeros (release_window_rows)
        sliding = cfg.sliding_layers if cfg.sliding_window > 0 else ()
        self._windowed = tuple(i for i in self._paged if cfg.kernel == "ffi" and not self.mesh
                               and i < len(sliding) and sliding[i])
        self.sampler = DeviceSampler(cfg.vocab_size, cfg.kernel == "ffi")
        self._calls = 0   # device calls of steps, for drop_embedding_pages
        self._embedding_pages: list | None = None   # its file pages, once the weights are final

    def close(self) -> None:
        """The runner's last call: the followers stop (engine/hosts.py)."""
        if self._leader is not None:
            self._leader.send("close", (), {})
            self._leader = None

    def failed(self, error: Exception) -> str:
        """What the requests are told when the engine's thread dies of `error`. With several
        processes (most likely a step's collective failing as one of them stopped) the
        leader exits after their error events leave (hosts.Leader.lost)."""
        if self._leader is None:
            return f"engine error: {type(error).__name__}: {error}"
        reason = (f"a process serving this model stopped or cannot be reached "
                  f"({type(error).__name__}: {error})")
        self._leader.lost(reason)
        return reason

    def _put(self, host: np.ndarray) -> jax.Array:
        """A step's input on the device; under a split on every device of the mesh (a
        computation over devices of several processes takes only arrays placed over them
        all: engine/hosts.py)."""
        return jax.device_put(host) if self.mesh is None else splits.replicate(host, self.mesh)

    @property
    def split(self) -> dict:
        """How the weights are split (/props, the start line): mode and device count."""
        if self.mesh is None:
            return {"mode": "none", "devices": 1}
        return {"mode": self.config.split.mode, "devices": int(self.mesh.devices.size)}

    @property
    def cache(self) -> list:
        """The KV cache: per layer a (k, v) pair of page arrays [num_pages, page_size,
        n_kv_head, head_dim] (a convolution layer's pair: its inputs [.., 1, d_model] and an
        empty array; a delta-rule layer's three per-slot arrays instead: RecurrentState).
        Allocated (zeroed) on first use rather than with the runner, so
        that what runs before the first step (the engine compiles its sampler) does not hold
        its peak memory on top of the cache's. With the C++ kernels the zeros are lazy
        (kernels.ffi.lazy_zeros): the whole cache is allocated, but the system gives it memory
        page by page as the steps first write there, as it does for calloc."""
        if self._cache is None:
            cfg, config = self.model.config, self.config
            # a q8_0 cache's rows are its blocks' bytes (layers.kv_storage)
            (wk, dt), (wv, _) = (kv_storage(config.kv_dtype, w)
                                 for w in (cfg.head_dim, cfg.v_head_dim))
            shape_k = (config.num_pages, config.page_size, cfg.n_kv_head, wk)
            shape_v = (config.num_pages, config.page_size, cfg.n_kv_head, wv)
            # the C++ kernels: memory taken as pages are written
            zeros = native.lazy_zeros if cfg.kernel == "ffi" else jnp.zeros
            pages = (config.num_pages, config.page_size)
            recurrent = delta_net.state_shapes(cfg, config.num_slots, config.max_draft)
            self._cache = [
                # a short convolution's layer keeps its input rows (float32, as llama.cpp
                # keeps its state) and has no second array
                (zeros((*pages, 1, cfg.d_model), jnp.float32), jnp.zeros((*pages, 1, 0)))
                if cfg.conv_layers and cfg.conv_layers[i] else
                # a delta-rule layer: its per-slot state (RecurrentState), no pages
                tuple(jnp.zeros(shape, jnp.float32) for shape in recurrent)
                if cfg.recurrent_layers and cfg.recurrent_layers[i] else
                (zeros(shape_k, dt), zeros(shape_v, dt)) for i in range(cfg.n_layer)]
            if self.mesh is not None:   # each device its heads' share, or the whole cache
                self._cache = splits.place_cache(self._cache, self.mesh,
                                                 self._heads is not None)
        return self._cache

    @cache.setter
    def cache(self, value: list) -> None:
        self._cache = value

    @property
    def release_window(self) -> int:
        """The sliding window of the layers whose rows release_window_rows hands back (0:
        none here: no sliding-window layers, or a kernel whose cache is device memory)."""
        return self.model.config.sliding_window if self._windowed else 0

    def release_window_rows(self, runs: list[tuple[int, int]]) -> int:
        """Hand back to the system the memory of the sliding-window layers' rows (k and v)
        of the pages in `runs` ((first page, count) each), in place: pages that every query
        of the sequences holding them is past by the window (engine/sliding_window.py). Whole
        memory pages only: a run's ends share theirs with the pages beside it. The rows read
        as zeros after, and take memory again when next written. Returns the bytes handed
        back.

        It first waits for the steps already dispatched: the scheduler counts a prompt chunk
        computed when it plans the next step, not when the device has run it, and such a
        step's own rows still read the window before them (a prompt chunk samples nothing, so
        nothing else waits for it)."""
        if not self._windowed or not runs:
            return 0
        jax.block_until_ready([self.cache[i] for i in self._windowed])
        return sum(native.release_rows(a, runs) for i in self._windowed for a in self.cache[i])

    def row_bucket(self, n: int) -> int:
        """Rows of the compiled step that holds n rows."""
        return next(b for b in self.row_buckets if b >= n)

    @mirrored
    def step_device(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                    write_index: np.ndarray, page_table: np.ndarray,
                    logit_rows: list[int] | None = None,
                    drafts: np.ndarray | None = None,
                    images: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                    ) -> jax.Array:
        """Run one step over up to T rows (arrays of length n <= T) and update the cache.
        page_table: [S, P]. Returns the device array of logits [B, V] for every row of the
        step's bucket B >= n (rows n.. are padding, unspecified with the ffi kernel). With
        logit_rows (exact_rows only), the caller needs only those rows, and only they are
        computed: the C++ kernel gives [B, V] with those rows' logits and the others
        unspecified (it does not write them: zeroing them cost a prompt step more than its
        sampled rows), [] (a prompt chunk before its last, the draft model following the
        target) skipping the output projection; the pallas kernel gives [r] (a prompt chunk
        samples only its last row) as [1, V] for row r alone and [] at the T-row bucket as
        [0, V] (_logit_shape). drafts [n] bool:
        the rows that are unverified drafts (a recurrent model commits no state for them:
        RecurrentState). images (config.image_rows only): (mask [n], embeddings [n, D], ends
        [n]), the rows where mask is 1 take their embedding as input instead of their
        token's, and each row sees the keys up to its end (its position, or its image's last
        row's when the image attends both ways)."""
        T, n = self.config.step_tokens, len(tokens)
        if n > T:
            raise ValueError(f"{n} rows do not fit a {T}-row step")
        if logit_rows is not None and not self.exact_rows:
            raise ValueError("logit_rows needs the ffi or pallas kernel (XLA's dot is not "
                             "batch-invariant)")
        bucket = self.row_bucket(n)
        pad = bucket - n
        page_size = self.config.page_size
        shape = self._logit_shape(bucket, logit_rows)
        if shape == "mask":
            rows = np.zeros(bucket, np.int64)
            rows[np.arange(n) if logit_rows is None else np.asarray(logit_rows, np.int64)] = 1
        else:
            rows = [] if shape == "all" else shape
        parts = [("tokens", _padded(tokens, pad)), ("positions", _padded(positions, pad)),
                 ("slots", _padded(slots, pad)),
                 ("write_index", np.concatenate(
                     [write_index, RESERVED_PAGE * page_size + np.arange(pad) % page_size])),
                 ("page_table", page_table[:, :self.key_bucket(positions)])]
        if shape != "all":
            parts.append(("logit_mask" if shape == "mask" else "rows", rows))
        if self.config.image_rows:
            parts += self._image_mask(images, bucket, positions)
        if self.state is not None:
            parts.append(("state", self.state.plan(slots, positions, drafts, bucket)))
        packed, layout = _pack(parts)
        args = (self._buffer, self._skeleton, self.cache, self._put(packed), layout,
                self._heads, self._image_embeds(images, bucket))
        if self._warming and self._step.prepare(*args):
            return None
        if not self._warming:
            self.model.finish_repack()
        logits, self.cache = self._step(*args)
        self._called()
        return logits if self.mesh is None else splits.on(logits, self._main)

    def decode_steps_at(self, n: int) -> int:
        """Decode steps one call runs for n sequences (0 or 1: no such call): the config's
        decode_steps. Their rows are planned as one turn of the scheduler (n x steps rows,
        which may pass step_tokens: decode_steps.plan gives that turn its budget), each
        step running at n's row bucket. (Capping them to step_tokens ran 8 streams at -np 8,
        whose steps hold 16 rows, 2 steps a call, each call paying the turn's host work.)"""
        if not self.exact_rows or self.config.decode_steps < 2:
            return 0
        return self.config.decode_steps

    @mirrored
    def decode_steps(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     write_index: np.ndarray, page_table: np.ndarray, bias: tuple,
                     shape: SampleShape | None = None) -> np.ndarray:
        """N greedy decode steps of n sequences, one row each, in one device call (kernel
        "ffi" only): step i runs row r at positions[i, r], writing write_index[i, r], and
        feeds it the token that step i - 1 drew for it (tokens[r] at i = 0); each draw is
        sample_device.greedy_tokens' (the full mask; bias: each row's bias pairs, None for
        none, at shape's width). positions and write_index: [N, n].
        Returns the drawn tokens [N, B] (-1 where a row allowed no token; rows n.. are
        padding). The same tokens as N calls of step_device followed by sampler.greedy: a
        row's logits do not depend on the step's other rows."""
        if not self.exact_rows:
            raise ValueError("decode_steps needs the ffi or pallas kernel (XLA's dot is not "
                             "batch-invariant)")
        N, n = positions.shape
        bucket = self.row_bucket(n)
        pad = bucket - n
        reserved = RESERVED_PAGE * self.config.page_size + np.arange(pad) % self.config.page_size
        parts = [("tokens", _padded(tokens, pad)), ("slots", _padded(slots, pad)),
                 ("positions", np.concatenate([positions, np.zeros((N, pad))], axis=1)),
                 ("write_index", np.concatenate(
                     [write_index, np.broadcast_to(reserved, (N, pad))], axis=1)),
                 ("page_table", page_table[:, :self.key_bucket(positions.ravel())])]
        if self.state is not None:
            parts.append(("state", self.state.plan_decode(slots, positions, bucket)))
        # n travels as data: one compiled loop per bucket
        packed, layout = _pack(parts + [("n", np.asarray([n]))])
        bias = self.sampler.greedy_bias(bias, bucket, shape or self.sample_shape())
        args = (self._buffer, self._skeleton, self.cache, self._put(packed),
                bias if self.mesh is None else splits.replicate(bias, self.mesh), layout,
                self._heads)
        if self._warming and self._decode.prepare(*args):
            return None
        if not self._warming:
            self.model.finish_repack()
        out, self.cache = self._decode(*args)
        self._called()
        return np.asarray(out if self.mesh is None else splits.on(out, self._main))

    def _called(self) -> None:
        self._calls += 1
        if self._calls % EMBEDDING_DROP_STEPS == 0 and not self._warming:
            self.drop_embedding_pages()

    def drop_embedding_pages(self) -> None:
        """Unmap the token embedding's pages from the process (memory.drop_file_pages), every
        EMBEDDING_DROP_STEPS device calls: a step gathers its rows from the mapped file (an
        embedding not tied to the output stays in the file's pages), and the system maps 16
        pages around each row it faults in, so the memory held grew with every token ever
        seen, up to the whole embedding (Qwen2.5-Coder-0.5B: +38 MiB after a 512-token prompt
        of random ids). Every 16 calls, a prompt still held 16 steps' rows between two drops
        (Qwen's served peak at -np 8: 789 MiB; 777 every 4). Unmapped, the rows a step reads
        fault back in from the page cache with the file's bytes: the same values. Nothing for
        an embedding tied to the output (rearranged into the kernel's layout, anonymous
        memory) or not in the file's blocks (the xla and pallas kernels)."""
        if self._embedding_pages is None:
            if self.model.pending_repack:
                return   # huge_pages may still move pieces of the map (finish_repack)
            self._embedding_pages = self._embedding_file_pages()
        drop_file_pages(self._embedding_pages)

    def _embedding_file_pages(self) -> list[tuple[int, int]]:
        w, weights = self.model.weights.get("token_embd"), self.model.weights
        if (not isinstance(w, Proj) or w.fmt < 0 or w.fmt & REPACK16 or weights.get("output") is w
                or self.model.config.kernel != "ffi" or self.mesh is not None):
            return []
        f = self.model.file
        base = f.writable_bytes().ctypes.data
        if w.data.unsafe_buffer_pointer() != base:   # not the file's map itself
            return []
        size = f.tensors["token_embd.weight"].data.nbytes
        return file_pages(os.path.realpath(f.path), base + w.offset, size)

    def sample_shape(self, eog_ids=()) -> SampleShape:
        """The shape of this runner's sampler calls, for a tokenizer with `eog_ids`; on a GPU
        the chain draws a call's rows at once (SampleShape.whole_batch)."""
        return SampleShape.of(self.model.config.vocab_size, self.config.max_context,
                              self.row_buckets, eog_ids,
                              whole_batch=target.backend() == "gpu")

    def sample(self, logits: jax.Array | np.ndarray, batch: SampleBatch) -> Drawn:
        """Draw batch's rows from `logits` (a step's, or host rows): the one place that
        decides between the greedy draw and the whole chain (sample_device.DeviceSampler)."""
        return self.sampler.sample(logits, batch)

    def argmax_rows(self, logits: jax.Array, n: int) -> np.ndarray:
        """The first n rows' argmax, on the host (a draft model's proposals: no mask, no
        bias, so no need for the sampler's greedy draw)."""
        return np.asarray(logits[:n].argmax(-1))

    def host_rows(self, logits: jax.Array, lo: int, n: int) -> np.ndarray:
        """Rows lo .. lo + n of a step's logits, on the host (a scoring request's)."""
        return np.asarray(logits[lo:lo + n])

    def _image_mask(self, images, bucket: int, positions: np.ndarray) -> list:
        """The image rows' mask [bucket] and each row's last visible key [bucket] (its own
        position but in an image that attends both ways), as packed parts."""
        mask, ends = np.zeros(bucket, np.int64), np.zeros(bucket, np.int64)
        ends[:len(positions)] = positions
        if images is not None:
            mask[:len(images[0])] = images[0]
            ends[:len(images[2])] = images[2]
        return [("image_mask", mask), ("ends", ends)]

    def _image_embeds(self, images, bucket: int) -> jax.Array | None:
        """The step's embedding rows [bucket, D] (zeros where a row is a token), or None for
        a runner without image rows."""
        if not self.config.image_rows:
            return None
        D = self.model.config.d_model
        if images is None:
            if bucket not in self._no_images:
                self._no_images[bucket] = self._put(np.zeros((bucket, D), np.float32))
            return self._no_images[bucket]
        rows = np.zeros((bucket, D), np.float32)
        rows[:len(images[1])] = images[1]
        return self._put(rows)

    @mirrored
    def save_state(self, slot: int) -> StateSnapshot:
        """A copy of the slot's committed recurrent state (recurrent models only). Across
        processes (engine/hosts.py) the leader keeps it in host memory, so that load_state's
        call carries it to the followers (the state is whole on every device)."""
        arrays = _read_state(self.cache, slot, self._recurrent)
        if self._leader is not None:
            arrays = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), arrays)
        return StateSnapshot(self.state.committed[slot], arrays, self.state.pending[slot])

    @mirrored
    def load_state(self, slot: int, snapshot: StateSnapshot, pending: bool = False) -> None:
        """Make `snapshot` the slot's committed recurrent state: a sequence resuming from the
        cached prefix the snapshot was taken at, or (pending: the slot's pending drafts'
        inputs are still the snapshot's) the slot put back as it was."""
        arrays = snapshot.arrays
        if hosts.joined():   # host copies (save_state): placed on every device of the mesh
            arrays = jax.tree.map(self._put, arrays)
        self.cache = _write_state(self.cache, np.int32(slot), arrays, self._recurrent)
        self.state.restored(slot, snapshot.position, snapshot.pending if pending else 0)

    def key_bucket(self, positions: np.ndarray) -> int:
        """Pages of each slot's table the step reads: the smallest bucket that covers the
        furthest position. Attention over a padded, masked key axis gives the same bits at
        any padded length (docs/architecture.md, the determinism contract;
        tests/test_invariance.py), so short sequences need not pay for the whole context."""
        need = (int(positions.max()) // self.config.page_size + 1) if len(positions) else 1
        return next(b for b in self.buckets if b >= need)

    @mirrored
    def read_pages(self, pages: list[int]) -> list[list[np.ndarray]]:
        """Host copies of whole cache pages: per page, a list of arrays [page_size, ...],
        k and v of every layer in order."""
        out = []
        for start in range(0, len(pages), PAGE_COPY_BATCH):
            chunk = pages[start:start + PAGE_COPY_BATCH]
            pad = PAGE_COPY_BATCH - len(chunk)  # fixed batch: one compiled shape
            idx = np.asarray(list(chunk) + [RESERVED_PAGE] * pad, np.int32)
            stacked = [np.asarray(a if self.mesh is None else
                                  splits.on(splits.gathered(self.mesh)(a), self._main))
                       for a in _read_pages(self.cache, self._put(idx), self._paged)]
            out += [[a[i] for a in stacked] for i in range(len(chunk))]
        return out

    @mirrored
    def write_pages(self, pages: list[int], data: list[list[np.ndarray]]) -> None:
        """Fill whole cache pages from host copies (read_pages' format), in place."""
        for start in range(0, len(pages), PAGE_COPY_BATCH):
            chunk, rows = pages[start:start + PAGE_COPY_BATCH], data[start:start + PAGE_COPY_BATCH]
            pad = PAGE_COPY_BATCH - len(chunk)  # fixed batch: one compiled shape
            idx = np.asarray(list(chunk) + [RESERVED_PAGE] * pad, np.int32)
            arrays = [np.stack([r[j] for r in rows] + [np.zeros_like(rows[0][j])] * pad)
                      for j in range(len(rows[0]))]
            self.cache = _write_pages(self.cache, self._put(idx),
                                      [self._put(a) for a in arrays], self._paged)

    def _logit_shape(self, bucket: int, want: list[int] | None) -> str | list[int]:
        """The logits a step at `bucket` rows computes for a caller who wants the rows `want`
        (step_device; None: all): "all" (the XLA kernel: every row's), or "mask": [bucket,
        V], the wanted rows computed, the others unspecified. The C++ kernel ("ffi") computes
        and writes only the mask's rows (kinetic_qmatmul_rows; none: no projection at all),
        so the mask serves every want at one compiled shape a bucket: a step shape each for
        one row's logits and for none would only cost memory (10-20 MB an executable) and
        compile time. The pallas kernel computes every row of a mask, so there one row's
        logits alone ([r], [1, V]) and none ([], [0, V], at the T-row bucket only: the prompt
        chunks that need none are full ones) have their own shapes."""
        if not self.exact_rows:
            return "all"
        if self._mask_costs_its_rows:
            return "mask"
        if want is not None and (len(want) == 1 and bucket > 1
                                 or not want and bucket == self.config.step_tokens):
            return list(want)
        return "mask"

    @property
    def buckets(self) -> list[int]:
        """Key buckets (pages of each slot's table a step passes). The ffi attention walks
        only each row's visible keys, so it takes the whole table at one shape."""
        P, first = self.config.pages_per_slot, max(1, KEY_BUCKET_TOKENS // self.config.page_size)
        if self.exact_rows:
            return [P]
        sizes = [first * 4 ** k for k in range(16) if first * 4 ** k < P]
        return sizes + [P]

    @mirrored
    def compile(self, progress=None, shape: SampleShape | None = None) -> None:
        """Compile the step for every row bucket, key bucket and logit shape now (the first
        call of each would otherwise pay for it, stalling every stream), and the decode-step
        loops with `shape`'s bias pairs (None: sample_shape()'s). progress(done, total) is
        called after each. With the compile cache on, each executable is loaded or compiled
        without running (a warm start pays no step's arithmetic: kinetic/compile_cache.py);
        with it off, jax.jit compiles on a call, so each runs once on zero weights, writing
        only into the reserved page."""
        S = self.config.num_slots
        # (rows, key bucket, logit rows): every shape _logit_shape can give
        shapes = [(r, b, want) for r in self.row_buckets for b in self.buckets
                  for want in ((None, [0], []) if self.exact_rows else (None,))
                  if want is None or self._logit_shape(r, want) == want]
        # and the decode-step loops (decode_steps) at each row bucket that has one
        loops = [(r, self.decode_steps_at(r)) for r in self.row_buckets
                 if r <= S and self.decode_steps_at(r)]
        total = len(shapes) + len(loops)
        if self.state is not None:   # the compiling steps touch only the padding state slot
            self.state.compiling = True
        # The warm-up steps read zero weights of the file buffer's shape (the same compiled
        # code): a page never written costs no memory, so the weights (and their 16-column
        # rearrangement, left to the first real step or Engine.compile's end) are not
        # resident while the compiler's own peak is.
        weights, self._warming = self._buffer, True
        if weights is not None and self.mesh is None:
            self._buffer = native.lazy_zeros(weights.shape, weights.dtype)
        try:
            self._warm_up(shapes, loops, total, progress, shape)
        finally:
            self._buffer, self._warming = weights, False
        if self._paged:   # the page copies to and from host memory (the prefix cache's tier)
            self.write_pages([RESERVED_PAGE], self.read_pages([RESERVED_PAGE]))
        if self.state is not None:
            self.state.compiling = False

    def _warm_up(self, shapes, loops, total, progress, shape) -> None:
        S, P, ps = self.config.num_slots, self.config.pages_per_slot, self.config.page_size
        for i, (rows, b, want) in enumerate(shapes):
            pos = np.full(rows, b * ps - 1)
            jax.block_until_ready(self.step_device(
                np.zeros(rows), pos, np.zeros(rows), np.arange(rows) % ps,
                np.zeros((S, P), np.int32), want))
            if progress:
                progress(i + 1, total)
        for i, (rows, n) in enumerate(loops):
            grid = np.zeros((n, rows), np.int64)
            self.decode_steps(np.zeros(rows), grid + P * ps - 1, np.zeros(rows),
                              grid + np.arange(rows) % ps, np.zeros((S, P), np.int32),
                              (None,) * rows, shape)
            if progress:
                progress(len(shapes) + i + 1, total)


@functools.cache
def _compiled_step(forward, cfg):
    """One jitted step per (architecture, config): runners of the same model share its
    compiled shapes instead of compiling again."""
    return compile_cache.jit(partial(_forward, forward, cfg), name="step",
                             context=(forward, cfg), donate_argnums=(2,),
                             static_argnums=(4, 5))


@functools.cache
def _compiled_decode(forward, cfg):
    """decode_steps' jitted loop, shared like _compiled_step."""
    return compile_cache.jit(partial(_decode_loop, forward, cfg), name="decode",
                             context=(forward, cfg), donate_argnums=(2,),
                             static_argnums=(5, 6))


def _pack(parts: list[tuple[str, np.ndarray]]) -> tuple[np.ndarray, tuple]:
    """A step's integer inputs as one int32 array, one host-to-device copy (each copy costs
    tens of microseconds, a sizeable part of a one-row step on a small model), and its layout
    ((name, shape) per part: the compiled step's static argument) that _unpack reads it by."""
    arrays = [(name, np.asarray(a)) for name, a in parts]
    layout = tuple((name, a.shape) for name, a in arrays)
    return np.concatenate([a.ravel() for _, a in arrays]).astype(np.int32), layout


def _unpack(packed: jax.Array, layout: tuple) -> dict[str, jax.Array]:
    """_pack's parts by name, in the compiled step."""
    out, at = {}, 0
    for name, shape in layout:
        size = math.prod(shape)
        out[name] = packed[at:at + size].reshape(shape)
        at += size
    return out


def _padded(values: np.ndarray, pad: int) -> np.ndarray:
    return np.concatenate([values, np.zeros(pad)])


def _step_row(a: jax.Array, i) -> jax.Array:
    """a[i] of a loop's [N, B] integers, as a sum of the rows masked to row i (exact). On a
    GPU, XLA makes a[i] at the loop's index a dynamic-slice fusion, a copy run on its own
    between the CUDA graphs of the loop's body (bench/gpu_compile.py counts the thunks
    outside a graph); the masked sum is a node inside the graph."""
    at = (jnp.arange(a.shape[0]) == i)[:, None]
    return jnp.sum(jnp.where(at, a, 0), axis=0)


def _decode_loop(forward, cfg, buffer, skeleton, cache, packed, bias, layout, heads):
    """Runner.decode_steps' N steps as one loop over _pack's parts: tokens and slots [B],
    positions and write_index [N, B], the page table, the recurrent state's plan, and n,
    the rows that are not padding."""
    x = _unpack(packed, layout)
    B, slots, table = x["tokens"].shape[0], x["slots"], x["page_table"]
    recurs = RecurrentState.unpack_decode(x["state"], B) if cfg.recurrent else None
    weights = join_buffer(buffer, skeleton)
    real = jnp.arange(B) < x["n"][0]
    live = real.astype(jnp.int32)   # the padding rows' logits are not computed

    def body(i, carry):
        cache, tok, out = carry
        step = StepInput(tok, _step_row(x["positions"], i), slots,
                         _step_row(x["write_index"], i), table, None,
                         None if recurs is None else recurs(i), logit_mask=live, heads=heads)
        logits, cache = forward(weights, cfg, cache, step)
        # the loop's rows allow every token: with the C++ kernels one C++ pass over each row
        drawn = greedy_tokens(logits, bias, None, exact=cfg.kernel == "ffi")
        # the next input: the drawn token (0 for padding rows and rows that allowed none,
        # whose later tokens the engine discards)
        return cache, jnp.where(real & (drawn >= 0), drawn, 0), out.at[i].set(drawn)

    N = x["positions"].shape[0]
    out = jnp.zeros((N, B), jnp.int32)
    cache, _, out = jax.lax.fori_loop(0, N, body, (cache, x["tokens"], out))
    return out, cache


@partial(jax.jit, static_argnums=(1, 2))
def _read_state(cache, slot, layers):
    return tuple((cache[i][0][slot], cache[i][1][slot]) for i in layers)


@partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def _write_state(cache, slot, arrays, layers):
    out = list(cache)
    for i, (window, matrix) in zip(layers, arrays):
        out[i] = (cache[i][0].at[slot].set(window), cache[i][1].at[slot].set(matrix), cache[i][2])
    return out


def _read_pages_of(cache, idx, paged):
    """Pages idx of the paged layers (`paged`): k and v of each, in order."""
    return [c[idx] for i in paged for c in cache[i]]


def _write_pages_of(cache, idx, arrays, paged):
    """The cache with pages idx of its paged layers (`paged`) set to `arrays`."""
    flat = iter(arrays)
    return [(layer[0].at[idx].set(next(flat).astype(layer[0].dtype)),
             layer[1].at[idx].set(next(flat).astype(layer[1].dtype))) if i in paged else layer
            for i, layer in enumerate(cache)]


# the page copies compile with the steps (Runner.compile) and are kept on disk like them
_read_pages = compile_cache.jit(_read_pages_of, name="read_pages", static_argnums=(2,))
_write_pages = compile_cache.jit(_write_pages_of, name="write_pages", donate_argnums=(0,),
                                 static_argnums=(3,))


def _forward(forward, cfg, buffer, skeleton, cache, packed, layout, heads, embeds=None):
    """The model's forward (over the weights split_buffer took apart) and the StepInput
    that `packed` holds, _pack's parts as Runner.step_device names them: the rows' tokens,
    positions, slots and write_index (each B long), the page table [S, P'], the logit rows
    ("rows": those alone; "logit_mask": B long; neither: every row's), the image rows' mask
    and ends, the recurrent state's plan."""
    x = _unpack(packed, layout)
    B = x["tokens"].shape[0]
    recur = RecurrentState.unpack(x["state"], B) if cfg.recurrent else None
    return forward(join_buffer(buffer, skeleton), cfg, cache, StepInput(
        x["tokens"], x["positions"], x["slots"], x["write_index"], x["page_table"],
        x.get("rows"), recur, embeds, x.get("image_mask"), x.get("ends"), x.get("logit_mask"),
        heads))
