"""A step's new rows for attention as one Pallas kernel: q rotated, k rotated and written into
its layer's cache, v written (model/layers.py `rope_write`, a dense layer's on a GPU).

    q, k_cache, v_cache = rope_write(q_parts, k_parts, v_parts, biases, cos, sin,
                                     write_index, k_cache, v_cache, heads, neox)

q, k and v come as their projection's partial sums over the chunks of its K
(pallas_matmul's partials, [chunks, >= T, >= N]), each added in order, then its bias, as
XLA adds them (layers.Pending.value); rotary is layers.apply_rope's arithmetic, over the
whole head; k and v are rounded to the cache's type (float16, bfloat16 or float32) and
stored at their rows' write_index, in place (the caches are aliased to the outputs). XLA
ran this as three kernels a layer at one row (q's rotary, and an in-place update of each
cache with k's rotary and v inside: bench/gpu_compile.py); here it is one.

With norms (Qwen3's, Gemma 3's: q's and k's weights and eps), each head of q and of k is
RMS-normalized before its rotary with pallas_norm's arithmetic, the head as that kernel's
row (`head_scale`): two launches a layer fewer.

One program a row and head (grid [T, H]; programs past K write no k or v): its arithmetic
is its own row's alone, whatever the rows beside it. A head's pairs are read as a [pairs,
2] view of it (adjacent pairs, llama.cpp's normal rope) or a [2, pairs] one (neox's
halves), never by strides (which interpret mode lacks); a head normed is read whole too,
for its sum of squares. (One program a row, all its heads in a block, spilled 38 KB a
thread with the norms at sm_90a and ran a one-row step's heads on one multiprocessor:
bench/triton_sm90.py.) Interpreted wherever JAX's backend is not a
GPU (kernels/pallas_backend.py); tests/test_pallas_rope.py checks it there against the
XLA formulation, bitwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend


def supported(head_dim: int, rot: int, cache_dtype) -> bool:
    """Whether rope_write takes a layer: rotary over the whole head or a power-of-2 part of
    it (the first rot features; Qwen3.5's quarter), a head of a power of 2 (Triton's
    blocks), a float cache (a q8_0 cache is quantized and rotated by XLA)."""
    return (head_dim >= 4 and head_dim & (head_dim - 1) == 0 and 4 <= rot <= head_dim
            and rot & (rot - 1) == 0
            and jnp.dtype(cache_dtype) in (jnp.float16, jnp.bfloat16, jnp.float32))


def rope_write(q_parts, k_parts, v_parts, biases, cos, sin, write_index, k_cache, v_cache,
               heads: tuple[int, int], neox: bool, norms: tuple | None = None,
               interpret: bool | None = None, q_gated: bool = False):
    """q [T, H, Q] rotated, in the cache's type (as the attention rounds it:
    kernels/pallas_attention.py), and the caches [pages, page_size, K, Q] with the T rows'
    rotated k and their v written at write_index [T]. q_parts [Cq, >= T, >= H * Q], k_parts
    and v_parts likewise for K heads; biases (q's, k's, v's: [N] or None each); cos and sin
    [T, rot / 2] (rot < Q: the first rot features of a head rotated, layers.apply_rope's
    partial rotary, the rest as they are); heads (H, K); norms (q's weight [Q], k's weight
    [Q], eps) or None: each head of q and of k RMS-normalized before its rotary (Qwen3's),
    pallas_norm.rms_norm's arithmetic (`head_scale`). q_gated: q_parts hold each head's q
    then its gate ([>= H * 2 * Q], Qwen3.5's gated attention); q is the first of each."""
    interpret = pallas_backend.interpreted(interpret)
    T = write_index.shape[0]
    H, K = heads
    Q = k_cache.shape[-1]
    slots = k_cache.shape[0] * k_cache.shape[1]     # the caches' rows, pages * page_size
    rot = 2 * cos.shape[-1]
    n = Q // rot                        # a head's chunks of rot features (the first rotated)
    pairs = (2, rot // 2) if neox else (rot // 2, 2)
    G = 2 if q_gated else 1

    def view(a, h, g=1):   # a [C, rows, >= h * g * Q] as [C, rows, h, g, n, *pairs]
        return a[:, :, :h * g * Q].reshape(a.shape[0], a.shape[1], h, g, n, *pairs)

    def heads_of(a, h):    # a [C, rows, >= h * Q] as [C, rows, h, Q] (a bitcast)
        return a[:, :, :h * Q].reshape(a.shape[0], a.shape[1], h, Q)

    eps, weights = None, ()
    if (norms is not None or q_gated) and any(b is not None for b in biases[:2]):
        raise ValueError("rope_write: q or k biases with head norms or a gate (no family "
                         "has both)")
    if norms is not None:   # the heads read whole too, for their sums of squares
        *weights, eps = norms
        weights = (heads_of(q_parts, G * H), heads_of(k_parts, K),
                   *(jnp.asarray(w, jnp.float32).reshape(n, *pairs) for w in weights))
    q_out, k_flat, v_flat = _rope_write(
        view(q_parts, H, G), view(k_parts, K), heads_of(v_parts, K),
        tuple(None if b is None else jnp.asarray(b, jnp.float32) for b in biases),
        # (cos and sin as one operand: XLA computes them in one kernel, not one each)
        jnp.stack([jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32)], axis=1),
        jnp.asarray(write_index, jnp.int32),
        k_cache.reshape(slots, K, n, *pairs), v_cache.reshape(slots, K, Q), weights, T, neox,
        None if eps is None else float(eps), interpret)
    return (q_out.reshape(T, H, Q), k_flat.reshape(k_cache.shape),
            v_flat.reshape(v_cache.shape))


def head_scale(whole_ref, row, h, Q: int, eps: float) -> jax.Array:
    """Inside a kernel: [1, 1], head h of row `row`'s 1 / sqrt(mean of its squares + eps)
    from its values whole_ref[C, rows, heads, Q] (the partial sums added in order), as
    pallas_norm's RMS norm makes a row's: the head read as row 0 of a [NORM_ROWS, Q] block
    (the rows after it masked off, zeros), pallas_norm.sum_squares and rms_scale, the
    block's shape the norm kernel's (its blocks' shape sets a row's bits); then row 0's
    sum taken out exactly (the rest are zeros)."""
    from kinetic.kernels import pallas_norm
    R = pallas_norm.NORM_ROWS

    def load(c0, width):
        live = lax.broadcasted_iota(jnp.int32, (1, R, width), 1) == 0
        block = pallas_backend.load_sum(whole_ref, (row, pl.ds(h, R), pl.ds(c0, width)),
                                        live)
        return block.reshape(R, width)
    total = jnp.sum(pallas_norm.sum_squares(load, Q), axis=0, keepdims=True)
    return pallas_norm.rms_scale(total, Q, eps)


@functools.partial(jax.jit, static_argnums=(9, 10, 11, 12))
def _rope_write(q_parts, k_parts, v_parts, biases, angles, index, k_cache, v_cache,
                norms: tuple, T: int, neox: bool, eps: float | None, interpret: bool):
    H, G, n = q_parts.shape[2:5]
    K = k_parts.shape[2]
    P0, P1 = q_parts.shape[5:]
    rot = P0 * P1
    Q = n * rot
    half = (1, rot // 2) if neox else (rot // 2, 1)   # the [*pairs] block of a or of b
    first = (pl.ds(0, 1),) * 2                         # (q of the head, its first chunk)
    a_at = (*first, pl.ds(0, half[0]), pl.ds(0, half[1]))
    b_at = (*first, *((pl.ds(1, 1), pl.ds(0, half[1])) if neox
                      else (pl.ds(0, half[0]), pl.ds(1, 1))))
    rest_at = (pl.ds(0, 1), pl.ds(0, n), pl.ds(0, P0), pl.ds(0, P1))   # the head whole
    has_bias = tuple(b is not None for b in biases)
    # q's and k's as their views' [g, n, *pairs] (g 1), v's by head
    bias_views = [b.reshape(-1, 1, n, P0, P1) if i < 2 else b.reshape(-1, Q)
                  for i, b in enumerate(biases) if b is not None]

    def whole(a):
        return pl.BlockSpec(a.shape, lambda t, h: (0,) * a.ndim)

    # norms: q's and k's heads whole ([C, rows, n, Q]), q's and k's norm weights [n, *pairs]
    arrays = [q_parts, k_parts, v_parts, *bias_views, angles, index, *norms, k_cache,
              v_cache]
    n_in = len(arrays)

    def kernel(*refs):
        q_ref, k_ref, v_ref = refs[:3]
        bias_refs = iter(refs[3:3 + len(bias_views)])
        qb, kb, vb = (next(bias_refs) if h else None for h in has_bias)
        angles_ref, index_ref = refs[3 + len(bias_views):5 + len(bias_views)]
        q_whole, k_whole, q_norm, k_norm = refs[5 + len(bias_views):n_in - 2] or (None,) * 4
        q_out, k_out, v_out = refs[n_in:]
        t, h = pl.program_id(0), pl.program_id(1)
        row, head = pl.ds(t, 1), pl.ds(h, 1)
        dest = pl.ds(index_ref[t], 1)

        def summed(ref, bias_ref, at):
            """[1, 1, *at's sizes]: row t's values at `at` of head h, the partial sums in
            order, then the bias."""
            total = pallas_backend.load_sum(ref, (row, head, *at))
            if bias_ref is not None:
                total = total + bias_ref[(head, *at)][None]
            return total

        c = angles_ref[row, pl.ds(0, 1), :].reshape(1, 1, 1, 1, *half)
        s = angles_ref[row, pl.ds(1, 1), :].reshape(1, 1, 1, 1, *half)

        def rotated(ref, bias_ref, whole_ref, norm_ref, g: int):
            """(a, b) rotated, and the head whole (normed) where it has features past the
            rotary's (n > 1; else None)."""
            a, b = summed(ref, bias_ref, a_at), summed(ref, bias_ref, b_at)
            rest = summed(ref, bias_ref, rest_at) if n > 1 else None
            if norm_ref is not None:   # the head normalized first (Qwen3's)
                scale = head_scale(whole_ref, row, g * h, Q, eps).reshape(1, 1, 1, 1, 1, 1)
                a = a * scale * norm_ref[a_at[1:]][None, None, None]
                b = b * scale * norm_ref[b_at[1:]][None, None, None]
                if rest is not None:
                    rest = rest * scale * norm_ref[rest_at[1:]][None, None, None]
            return a * c - b * s, a * s + b * c, rest

        def write(out, at_row, head_values, dtype):
            """A head's values [1, 1, 1, n, *pairs] past its first chunk stored (that one
            is the rotary's)."""
            if head_values is None:
                return
            later = lax.broadcasted_iota(jnp.int32, (1, 1, n, P0, P1), 2) >= 1
            pltriton.store(out.at[at_row, head, pl.ds(0, n), pl.ds(0, P0), pl.ds(0, P1)],
                           head_values.reshape(1, 1, n, P0, P1).astype(dtype), mask=later)

        @pl.when(h < H)
        def _():
            qa, qb_, rest = rotated(q_ref, qb, q_whole, q_norm, G)
            q_out[(row, head, *a_at[1:])] = qa.reshape(1, 1, 1, *half).astype(q_out.dtype)
            q_out[(row, head, *b_at[1:])] = qb_.reshape(1, 1, 1, *half).astype(q_out.dtype)
            write(q_out, row, rest, q_out.dtype)

        @pl.when(h < K)
        def _():
            ka, kb_, rest = rotated(k_ref, kb, k_whole, k_norm, 1)
            k_out[(dest, head, *a_at[1:])] = ka.reshape(1, 1, 1, *half).astype(k_out.dtype)
            k_out[(dest, head, *b_at[1:])] = kb_.reshape(1, 1, 1, *half).astype(k_out.dtype)
            write(k_out, dest, rest, k_out.dtype)
            v = summed(v_ref, vb, (pl.ds(0, Q),))
            v_out[(dest, head, pl.ds(0, Q))] = v.astype(v_out.dtype)

    out_shape = [jax.ShapeDtypeStruct((T, H, n, P0, P1), k_cache.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(T, max(H, K)),
        in_specs=[whole(a) for a in arrays],
        out_specs=[whole(o) for o in out_shape],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        **pallas_backend.options(interpret, num_warps=1),
    )(*arrays)
