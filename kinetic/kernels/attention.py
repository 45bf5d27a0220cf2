"""Paged attention in C++ (csrc/attention.h), batch-invariant by construction: a row's output
bits depend only on its own query, its slot's keys and values, its position and its end,
never on the other rows of the step, on T, on the page table's width, on the thread count or
on the ISA.

    paged_attention(q, k_cache, v_cache, step, scale, window=0, softcap=0.0, ends=None)
        layers.paged_attention's signature and meaning, through the XLA FFI (jit, CPU)
    attention_host(q, k_cache, v_cache, page_table, slots, positions, scale, ..., ends=None)
        the same kernel on numpy arrays through the C ABI, on a chosen ISA and thread count
    reference_attention(..., ends=None)
        numpy, float32, the kernel's own order of operations (bitwise equal to it)

Row t sees the keys lo..end of its slot: end = ends[t] (>= positions[t]; None: the
positions, causal), lo = 0, or max(0, positions[t] - window + 1) with a window (always from
the row's own position). An image that attends to itself both ways (Gemma 3's) gives each of
its rows the image's last position as end, as llama.cpp masks key p0 for query p1 when
(causal and p0 > p1) or p1 - p0 >= n_swa.

The arithmetic per (row t, query head h), keys l = lo..end of the row's slot in order:
qs = round_to_cache_dtype(q) * scale; score_l = sum over j in order of qs[j] * k_l[j]
(each product rounded, then added); optional softcap * tanhf(score / softcap);
p_l = exp_softmax(score_l - max) (below: float32 operations only, the kernel's on every path);
out = (sum over l in order of p_l * v_l) / (sum over l of p_l).
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from kinetic import kernels
from kinetic.kernels import ffi
from kinetic.kernels import reference
from kinetic.kernels.reference import exp_softmax

F32, F16, Q8_0, BF16 = 0, 1, 8, 30  # GGML type ids, as the kernel takes them
_host_ready = False


def _fmt(dtype) -> int:
    """The kernel's id for a cache dtype (float32, float16, bfloat16; uint8: q8_0 blocks,
    kinetic/model/layers.py kv_storage), or ValueError."""
    name = np.dtype(dtype).name
    if name not in ("float32", "float16", "bfloat16", "uint8"):
        raise ValueError(f"the KV cache must be float32, float16, bfloat16 or q8_0 (uint8), "
                         f"not {name}")
    return {"float32": F32, "float16": F16, "bfloat16": BF16, "uint8": Q8_0}[name]


def _values(cache: np.ndarray) -> int:
    """Values in a cache row (its last dimension; a q8_0 row is GGUF's Q8_0 blocks)."""
    if cache.dtype != np.uint8:
        return cache.shape[-1]
    f = reference.FORMATS[reference.Q8_0]
    return cache.shape[-1] // f.bytes * f.qk


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, step, scale: float,
                    window: int = 0, softcap: float = 0.0, ends=None) -> jax.Array:
    """Attention of each row's queries q [T, H, Q] over its own slot's keys
    (step.page_table [S, P], step.slots [T], step.positions [T]) up to its end (ends [T],
    each >= the row's position; None: the positions, causal); k_cache
    [pages, page_size, K, Q], v_cache [pages, page_size, K, Qv]. Returns f32 [T, H, Qv]."""
    ffi.register()
    _fmt(k_cache.dtype), _fmt(v_cache.dtype)
    T, H, _ = q.shape
    positions = step.positions.astype(jnp.int32)
    ends = positions if ends is None else jnp.asarray(ends).astype(jnp.int32)
    out = jax.ShapeDtypeStruct((T, H, _values(v_cache)), jnp.float32)
    return jax.ffi.ffi_call("kinetic_attention", out)(
        q.astype(jnp.float32), k_cache, v_cache, step.page_table.astype(jnp.int32),
        step.slots.astype(jnp.int32), positions, ends,
        scale=np.float32(scale), window=np.int64(window), softcap=np.float32(softcap))


def _host_lib() -> ctypes.CDLL:
    global _host_ready
    lib = kernels._need()
    if not _host_ready:
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.kn_attention.argtypes = [ptr, i64, i64, i64, ptr, i32, ptr, i32, i64, i64, i64, i64,
                                     ptr, i64, i64, ptr, ptr, ptr, f32, i64, f32, ptr, i32, i32,
                                     i32, ctypes.c_char_p, i32]
        _host_ready = True
    return lib


def attention_host(q, k_cache, v_cache, page_table, slots, positions, scale: float,
                   window: int = 0, softcap: float = 0.0, isa: str | None = None,
                   threads: int = 1, max_group: int | None = None, ends=None) -> np.ndarray:
    """The kernel on numpy arrays (C ABI). isa: a path from kernels.supported_isas()
    (default: the active one); max_group: most rows of a prompt chunk (one slot,
    consecutive positions) that share a unit's key work, 1 for every row on its own
    (default: the kernel's); ends: [T] each row's last visible key (None: the positions,
    passed to the kernel as a null pointer). Raises kernels.KernelError with the kernel's
    message."""
    lib = _host_lib()
    q = np.ascontiguousarray(q, dtype=np.float32)
    k_cache, v_cache = np.ascontiguousarray(k_cache), np.ascontiguousarray(v_cache)
    page_table = np.ascontiguousarray(page_table, dtype=np.int32)
    slots = np.ascontiguousarray(slots, dtype=np.int32)
    positions = np.ascontiguousarray(positions, dtype=np.int32)
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4 or page_table.ndim != 2:
        raise ValueError("q [T, H, Q], caches [pages, page_size, K, *], page_table [S, P]")
    T, H, Q = q.shape
    pages, page_size, K, _ = k_cache.shape
    if _values(k_cache) != Q or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"cache shapes {k_cache.shape}, {v_cache.shape} do not fit q {q.shape}")
    ends = None if ends is None else np.ascontiguousarray(ends, dtype=np.int32)
    if slots.shape != (T,) or positions.shape != (T,) or getattr(ends, "shape", (T,)) != (T,):
        raise ValueError("slots, positions and ends must be [T]")
    Qv = _values(v_cache)
    out = np.empty((T, H, Qv), np.float32)
    code = kernels.ISAS.index(isa) if isa is not None else lib.kn_active_isa()
    kernels._call(lib.kn_attention, q.ctypes.data, T, H, Q, k_cache.ctypes.data,
                  _fmt(k_cache.dtype), v_cache.ctypes.data, _fmt(v_cache.dtype), pages,
                  page_size, K, Qv, page_table.ctypes.data, page_table.shape[0],
                  page_table.shape[1], slots.ctypes.data, positions.ctypes.data,
                  None if ends is None else ends.ctypes.data, float(scale),
                  int(window), float(softcap), out.ctypes.data, code, int(threads),
                  int(max_group or 0))
    return out


def _libm_tanhf():
    """C's tanhf, the function the kernel calls for a softcap (numpy's float32 tanh is its
    own code and need not give libm's bits)."""
    fn = ctypes.CDLL("libm.so.6").tanhf
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
    return fn


def reference_attention(q, k_cache, v_cache, page_table, slots, positions, scale: float,
                        window: int = 0, softcap: float = 0.0, ends=None) -> np.ndarray:
    """The kernel's arithmetic in numpy float32, in its order (module docstring): the
    scores as a loop over j of vectors across keys (lane-per-key order), the values as a
    loop over keys of vectors across j. Slow; for tests. Infinite and NaN inputs are
    computed as the kernel computes them, without numpy's warnings."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return _reference_attention(q, k_cache, v_cache, page_table, slots, positions, scale,
                                    window, softcap, ends)


def _reference_attention(q, k_cache, v_cache, page_table, slots, positions, scale, window,
                         softcap, ends) -> np.ndarray:
    tanhf = _libm_tanhf()
    f32 = np.float32
    k_cache, v_cache = np.asarray(k_cache), np.asarray(v_cache)
    # q meets the cache in its storage type (round to nearest even, as the kernel does; q8_0
    # keys: each head's row quantized in blocks of 32 and read back)
    q = np.asarray(q, np.float32)
    q = (reference.q8_0_values(reference.q8_0_blocks(q)) if k_cache.dtype == np.uint8
         else q.astype(k_cache.dtype).astype(np.float32))
    kc, vc = (reference.q8_0_values(c) if c.dtype == np.uint8 else c.astype(np.float32)
              for c in (k_cache, v_cache))  # exact
    T, H, Q = q.shape
    page_size, K = kc.shape[1], kc.shape[2]
    G = H // K
    out = np.zeros((T, H, vc.shape[3]), np.float32)
    for t in range(T):
        pos, slot = int(positions[t]), int(slots[t])
        end = pos if ends is None else int(ends[t])
        lo = max(0, pos - window + 1) if window > 0 else 0
        ls = np.arange(lo, end + 1)
        pages = np.asarray(page_table)[slot, ls // page_size]
        keys, vals = kc[pages, ls % page_size], vc[pages, ls % page_size]  # [n, K, *]
        for h in range(H):
            kh = h // G
            qs = q[t, h] * f32(scale)
            s = np.zeros(len(ls), np.float32)
            for j in range(Q):
                s = s + qs[j] * keys[:, kh, j]
            if softcap > 0:
                c = f32(softcap)
                s = np.array([c * f32(tanhf(float(x / c))) for x in s], np.float32)
            m = s.max()
            p = exp_softmax(s - m)
            den = np.add.accumulate(p)[-1]  # sequential, in order of l
            o = np.zeros(vc.shape[3], np.float32)
            for i in range(len(ls)):
                o = o + p[i] * vals[i, kh]
            out[t, h] = o / den
    return out
