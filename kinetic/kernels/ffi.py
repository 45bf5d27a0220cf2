"""The FFI kernels as JAX functions, usable inside jit (CPU only).

    qmatmul(x, data, fmt, offset, n, k, live)  x [..., k] f32 -> [..., n] f32 (live: only
                                             the rows flagged, the others unwritten)
    qmatmul_id(x, ids, data, weights, k, n_expert)  experts' projections: x [R, k],
                                             ids [R, S] -> [R, S, n] per weight
    dequant_rows(rows, data, fmt, offset, n, k)  rows [T] int32 -> [T, k] f32
    rms_norm(x, w, eps)                      x [..., D] f32 -> [..., D] f32
    cos_sin(theta)                           theta f32 -> (cos, sin)
    kv_write(k_cache, v_cache, k, v, index)  the caches with the rows written, in place
    lazy_zeros(shape, dtype)                 zeros whose memory is taken as it is written
    release_rows(array, runs)                rows of such an array whose memory is handed back
    delta_rule(taps, state, events, ...)     Qwen3.5's gated delta rule, states in place
    row_argmax(x, ids, values, mask)         x [B, V] f32 -> [B] int32, the greedy token

`data` is a uint8 device array holding the weight at byte `offset` (kinetic passes the whole
memory-mapped GGUF file, zero-copy); fmt, offset, n and k are static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kinetic import compile_cache, kernels
from kinetic.kernels import target

_registered = False


def usable() -> bool:
    """Whether the FFI kernels can run in what is traced now: the library is built and the
    step is for the CPU (kernels/target.py)."""
    return kernels.available() and target.backend() == "cpu"


def register() -> None:
    """Register the handlers with XLA (once per process)."""
    global _registered
    if _registered:
        return
    lib = kernels._need()
    for name in ("kinetic_qmatmul", "kinetic_qmatmul_rows", "kinetic_qmatmul_id",
                 "kinetic_dequant_rows",
                 "kinetic_attention",
                 "kinetic_rms_norm", "kinetic_layer_norm", "kinetic_cos_sin", "kinetic_kv_write",
                 "kinetic_lazy_zeros", "kinetic_row_argmax", "kinetic_delta_rule",
                 "kinetic_swiglu", "kinetic_hadamard"):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, name)), platform="cpu")
    _registered = True


def qmatmul(x: jax.Array, data: jax.Array, fmt: int, offset: int, n: int, k: int,
            live: jax.Array | None = None) -> jax.Array:
    return qmatmul_many(x, data, [(fmt, offset, n)], k, live)[0]


def qmatmul_many(x: jax.Array, data: jax.Array, weights: list[tuple[int, int, int]],
                 k: int, live: jax.Array | None = None) -> list[jax.Array]:
    """x [..., k] times several weights (fmt, offset, n) of the same buffer, in one call:
    [..., n] per weight, each what qmatmul gives for it alone. live (x's rows flattened,
    int32): only the rows where it is nonzero are computed; the others are not written, so
    their values are unspecified (whatever the output buffer held)."""
    register()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).astype(jnp.float32)
    shapes = [jax.ShapeDtypeStruct((x2.shape[0], n), jnp.float32) for _, _, n in weights]
    args = (x2, data) if live is None else (x2, data, live.reshape(-1).astype(jnp.int32))
    outs = jax.ffi.ffi_call("kinetic_qmatmul" if live is None else "kinetic_qmatmul_rows",
                            shapes)(
        *args, fmts=np.array([w[0] for w in weights], np.int64),
        offsets=np.array([w[1] for w in weights], np.int64),
        ns=np.array([w[2] for w in weights], np.int64), k=int(k))
    return [o.reshape(*lead, n) for o, (_, _, n) in zip(outs, weights)]


def qmatmul_id(x: jax.Array, ids: jax.Array, data: jax.Array,
               weights: list[tuple[int, int, int, int]], k: int,
               n_expert: int) -> list[jax.Array]:
    """A mixture of experts' projections over (row, expert) pairs, in one call: x [R, k],
    ids [R, S] int32 (S experts a row chose; S = 1 with a row of x per pair), weights
    (fmt, offset of expert 0, stride between experts, n) of the same buffer. Returns
    [R, S, n] per weight: pair (r, s) is what qmatmul gives x[r] against expert ids[r, s]
    alone (csrc/ffi_moe.cc)."""
    register()
    R, S = ids.shape
    shapes = [jax.ShapeDtypeStruct((R * S, n), jnp.float32) for *_, n in weights]
    outs = jax.ffi.ffi_call("kinetic_qmatmul_id", shapes)(
        x.reshape(R, k).astype(jnp.float32), data, ids.reshape(-1).astype(jnp.int32),
        fmts=np.array([w[0] for w in weights], np.int64),
        offsets=np.array([w[1] for w in weights], np.int64),
        strides=np.array([w[2] for w in weights], np.int64),
        ns=np.array([w[3] for w in weights], np.int64), k=int(k), n_expert=int(n_expert),
        share=int(S))
    return [o.reshape(R, S, n) for o, (*_, n) in zip(outs, weights)]


def dequant_rows(rows: jax.Array, data: jax.Array, fmt: int, offset: int, n: int,
                 k: int) -> jax.Array:
    register()
    rows = rows.astype(jnp.int32).reshape(-1)
    return jax.ffi.ffi_call("kinetic_dequant_rows",
                            jax.ShapeDtypeStruct((rows.shape[0], k), jnp.float32))(
        rows, data, fmt=int(fmt), offset=int(offset), n=int(n), k=int(k))


def kv_write(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The caches [pages, page_size, K, *] with rows k [T, K, Q] and v [T, K, Qv] written at
    flat rows index [T] (rounded to the cache's type), in place: each result aliases its
    cache (donated by the caller's jit, so nothing is copied)."""
    register()
    return tuple(jax.ffi.ffi_call(
        "kinetic_kv_write",
        (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={0: 0, 1: 1})(
            k_cache, v_cache, k.astype(jnp.float32), v.astype(jnp.float32),
            index.astype(jnp.int32).reshape(-1)))


def delta_rule(taps: jax.Array, state: tuple, events: jax.Array, rows: jax.Array,
               replay: jax.Array, n_replay: jax.Array, heads: int, key_heads: int,
               eps: float) -> tuple[jax.Array, tuple]:
    """A step's rows through Qwen3.5's gated delta rule (csrc/delta_rule.h): taps [C, taps],
    state (windows, matrices, pending), events [T, E], rows int32 [4, T] (read, write, slot,
    pend), replay int32 [2, R] (slot, idx), n_replay [1]. Returns (out [T, H, d], the new
    state), the state updated in place (each result aliases its argument)."""
    register()
    windows, matrices, pending = state
    T, d = events.shape[0], matrices.shape[-1]
    out, *new = jax.ffi.ffi_call(
        "kinetic_delta_rule",
        (jax.ShapeDtypeStruct((T, heads, d), jnp.float32),
         *(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in state)),
        input_output_aliases={1: 1, 2: 2, 3: 3})(
            taps.astype(jnp.float32), windows, matrices, pending, events.astype(jnp.float32),
            rows.astype(jnp.int32), replay.astype(jnp.int32),
            n_replay.astype(jnp.int32).reshape(1), hk=np.int64(key_heads),
            eps=np.float32(eps))
    return out, tuple(new)


def lazy_zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    """jnp.zeros(shape, dtype), but its memory pages are handed back to the system instead of
    filled (csrc/lazyzero.h), so they cost memory only once written: the KV cache."""
    register()
    return _lazy_zeros(tuple(int(d) for d in shape), jnp.dtype(dtype))


def _make_lazy_zeros(shape, dtype):
    return jax.ffi.ffi_call("kinetic_lazy_zeros", jax.ShapeDtypeStruct(shape, dtype))()


# kept on disk like the step (kinetic/compile_cache.py): a warm start loads it untraced
_lazy_zeros = compile_cache.jit(_make_lazy_zeros, name="lazy_zeros", static_argnums=(0, 1))


def release_rows(array: jax.Array, runs: list[tuple[int, int]]) -> int:
    """Hand back to the system the memory of `array`'s rows (along its first axis) in each
    run (first, count), in place (kernels.release_pages: whole memory pages only; a row of a
    page shared with a kept row stays). For a CPU array made by lazy_zeros whose rows in the
    runs nobody reads again: a sliding-window layer's cache pages every sequence has passed
    (Runner.release_window_rows). Waits for the array's pending writes. Returns the bytes
    handed back."""
    from kinetic.kernels import release_pages
    if not runs:
        return 0
    base, row = array.unsafe_buffer_pointer(), array.nbytes // array.shape[0]
    return sum(release_pages(base + first * row, count * row) for first, count in runs)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    register()
    x = x.astype(jnp.float32)
    return jax.ffi.ffi_call("kinetic_rms_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x, w.astype(jnp.float32), eps=np.float32(eps))


def hadamard(x: jax.Array, n: int) -> jax.Array:
    """Each block of n values of x's last axis rotated by the orthonormal Walsh-Hadamard
    matrix (csrc/hadamard.h; reference.hadamard is the same arithmetic)."""
    register()
    x = x.astype(jnp.float32)
    return jax.ffi.ffi_call("kinetic_hadamard", jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x, n=np.int64(n))


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up elementwise, in the kernel's own float32 sequence (csrc/glu.h;
    reference.swiglu), run by the kernel's threads."""
    register()
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    return jax.ffi.ffi_call("kinetic_swiglu", jax.ShapeDtypeStruct(gate.shape, jnp.float32))(
        gate, up)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, a row's bits the same at any
    row count (rownorm.h; reference.layer_norm is the same arithmetic in numpy)."""
    register()
    x = x.astype(jnp.float32)
    return jax.ffi.ffi_call("kinetic_layer_norm", jax.ShapeDtypeStruct(x.shape, jnp.float32))(
        x, w.astype(jnp.float32), b.astype(jnp.float32), eps=np.float32(eps))


def row_argmax(x: jax.Array, ids: jax.Array | None = None, values: jax.Array | None = None,
               mask: jax.Array | None = None) -> jax.Array:
    """sampler.greedy's token for each row of x [B, V], from one C++ pass over it (argmax.h;
    reference.row_argmax): the first index of the largest value after the mask (int32 [B,
    ceil(V/32)] words, None: every token allowed) and the bias pairs (ids int32 and values
    float32 [B, W], -1 for an unused pair; None: no bias), NaN read as -inf; -1 where that
    value is not finite."""
    register()
    B = x.shape[0]
    if ids is None:
        ids, values = jnp.full((B, 0), -1, jnp.int32), jnp.zeros((B, 0), jnp.float32)
    mask = jnp.zeros((B, 0), jnp.int32) if mask is None else mask.astype(jnp.int32)
    return jax.ffi.ffi_call("kinetic_row_argmax", jax.ShapeDtypeStruct((B,), jnp.int32))(
        x.astype(jnp.float32), ids.astype(jnp.int32), values.astype(jnp.float32), mask)


def cos_sin(theta: jax.Array) -> tuple[jax.Array, jax.Array]:
    register()
    theta = theta.astype(jnp.float32)
    out = jax.ShapeDtypeStruct(theta.shape, jnp.float32)
    return tuple(jax.ffi.ffi_call("kinetic_cos_sin", (out, out))(theta))
