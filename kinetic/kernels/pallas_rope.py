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

One program a row: its arithmetic is its own row's alone, whatever the rows beside it. A
head's pairs are read as a [pairs, 2] view of it (adjacent pairs, llama.cpp's normal rope)
or a [2, pairs] one (neox's halves), never by strides (which interpret mode lacks), and
heads padded to a power of 2 are masked off. Interpreted wherever JAX's backend is not a
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
    """Whether rope_write takes a layer: rotary over the whole head, a head of a power of 2
    (Triton's blocks), a float cache (a q8_0 cache is quantized and rotated by XLA)."""
    return (rot == head_dim and head_dim >= 4 and head_dim & (head_dim - 1) == 0
            and jnp.dtype(cache_dtype) in (jnp.float16, jnp.bfloat16, jnp.float32))


def rope_write(q_parts, k_parts, v_parts, biases, cos, sin, write_index, k_cache, v_cache,
               heads: tuple[int, int], neox: bool, interpret: bool | None = None):
    """q [T, H, Q] rotated, in the cache's type (as the attention rounds it:
    kernels/pallas_attention.py), and the caches [pages, page_size, K, Q] with the T rows'
    rotated k and their v written at write_index [T]. q_parts [Cq, >= T, >= H * Q], k_parts
    and v_parts likewise for K heads; biases (q's, k's, v's: [N] or None each); cos and sin
    [T, Q / 2]; heads (H, K)."""
    interpret = pallas_backend.interpreted(interpret)
    T = write_index.shape[0]
    H, K = heads
    Q = k_cache.shape[-1]
    pages, page_size = k_cache.shape[:2]
    pairs = (2, Q // 2) if neox else (Q // 2, 2)

    def view(a, n):   # a [C, rows, >= n * Q] as [C, rows, n, *pairs] (a bitcast)
        return a[:, :, :n * Q].reshape(a.shape[0], a.shape[1], n, *pairs)

    q_out, k_flat, v_flat = _rope_write(
        view(q_parts, H), view(k_parts, K), v_parts[:, :, :K * Q].reshape(
            v_parts.shape[0], v_parts.shape[1], K, Q),
        tuple(None if b is None else jnp.asarray(b, jnp.float32) for b in biases),
        jnp.asarray(cos, jnp.float32), jnp.asarray(sin, jnp.float32),
        jnp.asarray(write_index, jnp.int32),
        k_cache.reshape(pages * page_size, K, *pairs),
        v_cache.reshape(pages * page_size, K, Q), T, neox, interpret)
    return (q_out.reshape(T, H, Q), k_flat.reshape(k_cache.shape),
            v_flat.reshape(v_cache.shape))


@functools.partial(jax.jit, static_argnums=(9, 10, 11))
def _rope_write(q_parts, k_parts, v_parts, biases, cos, sin, index, k_cache, v_cache,
                T: int, neox: bool, interpret: bool):
    H, K = q_parts.shape[2], k_parts.shape[2]
    P0, P1 = q_parts.shape[3:]
    Q = P0 * P1
    half = (1, Q // 2) if neox else (Q // 2, 1)       # the [*pairs] block of a or of b
    a_at = (pl.ds(0, half[0]), pl.ds(0, half[1]))
    b_at = ((pl.ds(1, 1), pl.ds(0, half[1])) if neox else (pl.ds(0, half[0]), pl.ds(1, 1)))
    has_bias = tuple(b is not None for b in biases)
    # q's and k's by pairs as their rows, v's by head
    bias_views = [b.reshape(-1, P0, P1) if i < 2 else b.reshape(-1, Q)
                  for i, b in enumerate(biases) if b is not None]

    def whole(a):
        return pl.BlockSpec(a.shape, lambda t: (0,) * a.ndim)

    arrays = [q_parts, k_parts, v_parts, *bias_views, cos, sin, index, k_cache, v_cache]
    n_in = len(arrays)

    def kernel(*refs):
        q_ref, k_ref, v_ref = refs[:3]
        bias_refs = iter(refs[3:3 + len(bias_views)])
        qb, kb, vb = (next(bias_refs) if h else None for h in has_bias)
        cos_ref, sin_ref, index_ref = refs[3 + len(bias_views):6 + len(bias_views)]
        q_out, k_out, v_out = refs[n_in:]
        t = pl.program_id(0)
        row = pl.ds(t, 1)
        at_row = index_ref[t]

        def mask(n, shape):   # heads < n, over a block [1, heads, *shape]
            return lax.broadcasted_iota(jnp.int32, (1, pl.next_power_of_2(n), *shape), 1) < n

        def summed(ref, bias_ref, n, at):
            """Row t's values at `at` of each head (< n): the partial sums in order, then
            the bias."""
            heads = pl.ds(0, pl.next_power_of_2(n))
            shape = tuple(s.size for s in at)
            live = mask(n, shape)
            total = pallas_backend.load_sum(ref, (row, heads, *at), live)
            if bias_ref is not None:
                total = total + pltriton.load(bias_ref.at[(heads, *at)], mask=live[0],
                                              other=0.0)[None]
            return total, heads, live

        c = cos_ref[row, :].reshape(1, 1, *half)      # [1, 1, *half]
        s = sin_ref[row, :].reshape(1, 1, *half)

        def rotated(ref, bias_ref, n):
            a, heads, live = summed(ref, bias_ref, n, a_at)
            b, _, _ = summed(ref, bias_ref, n, b_at)
            return a * c - b * s, a * s + b * c, heads, live

        qa, qb_, heads, live = rotated(q_ref, qb, H)
        pltriton.store(q_out.at[(row, heads, *a_at)], qa.astype(q_out.dtype), mask=live)
        pltriton.store(q_out.at[(row, heads, *b_at)], qb_.astype(q_out.dtype), mask=live)
        ka, kb_, heads, live = rotated(k_ref, kb, K)
        dest = pl.ds(at_row, 1)
        pltriton.store(k_out.at[(dest, heads, *a_at)], ka.astype(k_out.dtype), mask=live)
        pltriton.store(k_out.at[(dest, heads, *b_at)], kb_.astype(k_out.dtype), mask=live)
        v, heads, live = summed(v_ref, vb, K, (pl.ds(0, Q),))
        pltriton.store(v_out.at[(dest, heads, pl.ds(0, Q))], v.astype(v_out.dtype), mask=live)

    out_shape = [jax.ShapeDtypeStruct((T, H, P0, P1), k_cache.dtype),
                 jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
                 jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(T,),
        in_specs=[whole(a) for a in arrays],
        out_specs=[whole(o) for o in out_shape],
        input_output_aliases={n_in - 2: 1, n_in - 1: 2},
        **pallas_backend.options(interpret, num_warps=1),
    )(*arrays)
