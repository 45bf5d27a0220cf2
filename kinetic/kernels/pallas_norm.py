"""The norms as a Pallas kernel: a step's norms on a GPU (model/layers.py `rms_norm`,
model/bert.py `layer_norm`).

    y = rms_norm(x, w, eps)          x [..., D] -> float32 [..., D], x / sqrt(mean(x^2) + eps) * w
    y = layer_norm(x, w, b, eps)     (x - mean) / sqrt(var + eps) * w + b
    h, y = add_rms_norm(x, parts, bias, w, eps)      h = x + (parts' sum + bias), y = its norm

XLA computes a norm's mean as a reduction whose order it picks from the whole array's shape:
on a CPU it gave a row other bits at 16 rows than at 1 (bench/gpu.py's row pieces measure
the same on a GPU), which is why a CPU runs it in C++. Here, one program normalizes a block
of rows (`block_rows`: 16, fewer for rows wider than 512): the sum of squares over D is one
reduction of a block whose shape depends on D alone, whatever the number of rows, so a
row's arithmetic never depends on how many rows share the call or which; the number of rows
only sets the grid. A block's rows past the last and columns past D (it is D padded to a
power of 2: Triton's arrays have power-of-2 sizes) are zeros, which add nothing to a sum
of squares, and their output is dropped: on a GPU by masks on loads and stores (x and y
stay where they are, no padded copies), interpreted by padding. Interpreted wherever JAX's
backend is not a GPU (kernels/pallas_backend.py); tests/test_pallas_norm.py checks it
there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend

BLOCK_ELEMENTS = 8192   # a program's block: 16 rows of up to 512 values, fewer rows if wider


def block_rows(Dp: int) -> int:
    """Rows per program for rows of Dp (a power of 2) values: up to 16, fewer for wide rows
    so that a block stays in registers (64 values a thread at 4 warps). Fixed by the width
    alone, never by the number of rows."""
    return max(1, min(16, BLOCK_ELEMENTS // Dp))


def rms_norm(x: jax.Array, w: jax.Array, eps: float, interpret: bool | None = None) -> jax.Array:
    """x [..., D] (any float type, computed in float32), w [D] -> float32 [..., D]."""
    return _rows(x, w, None, eps, interpret)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float,
               interpret: bool | None = None) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis of x [..., D] -> float32
    (BERT's norm: model/bert.py). The mean is one reduction of the block, as the variance."""
    return _rows(x, w, b, eps, interpret)


def add_rms_norm(x: jax.Array, parts: jax.Array, bias: jax.Array | None, w: jax.Array,
                 eps: float, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(h, rms_norm(h, w, eps)), h = x + (parts[0] + parts[1] + ... + bias): a residual add
    and the norm after it in one launch (model/layers.py `add_norm`), where XLA would add in
    a kernel of its own. x [M, D]; parts [C, >= M, >= D]: a projection's partial sums over
    the chunks of its K (pallas_matmul's partials) or one array [1, M, D]; bias [D] or
    None. The sum is XLA's order (the chunks in order, then the bias, then x), so h is the
    bits of `x + linear(...)`, and y the bits of rms_norm(h)."""
    interpret = pallas_backend.interpreted(interpret)
    return _norm(x, w, None, float(eps), interpret, not interpret, parts, bias)


def _rows(x, w, b, eps: float, interpret: bool | None) -> jax.Array:
    lead, D = x.shape[:-1], x.shape[-1]
    interpret = pallas_backend.interpreted(interpret)
    y = _norm(x.reshape(-1, D), w, b, float(eps), interpret, not interpret)
    return y.reshape(*lead, D)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _norm(x, w, b, eps: float, interpret: bool, in_place: bool, parts=None, add_bias=None):
    """b None: the RMS norm; else the layer norm, b its bias. parts (add_rms_norm): x is a
    residual, the rows normed are h = x + (parts' sum + add_bias), and (h, y) are returned.
    in_place: x, w, b and y are
    read and written where they are, unpadded, each program its rows at their place and
    the padding masked off (a GPU's way: no padded copies, kernels of their own, around
    each norm); else they are padded to whole blocks (interpreted: a masked load there pads
    the array it reads). The same values reach the same arithmetic either way
    (tests/test_pallas_norm.py)."""
    M, D = x.shape
    Dp = pl.next_power_of_2(D)
    BM = block_rows(Dp)
    Mp = -(-M // BM) * BM
    centre = b is not None
    adds = parts is not None
    vectors = [w, b] if centre else [w]
    vectors += [add_bias] if add_bias is not None else []
    if in_place:
        args = [x.astype(jnp.float32), *(jnp.asarray(v, jnp.float32) for v in vectors)]
        rows_spec = pl.BlockSpec((M, D), lambda i: (0, 0))        # the whole of x, of y
        vector_spec = pl.BlockSpec((D,), lambda i: (0,))
        parts_spec = None if not adds else pl.BlockSpec(parts.shape, lambda i: (0, 0, 0))
        out_shape = (M, D)
    else:
        def row(v):   # a [D] vector as [1, Dp], zeros past D
            return jnp.zeros((1, Dp), jnp.float32).at[0, :D].set(jnp.asarray(v, jnp.float32))
        args = [jnp.zeros((Mp, Dp), jnp.float32).at[:M, :D].set(x.astype(jnp.float32)),
                *map(row, vectors)]
        rows_spec = pl.BlockSpec((BM, Dp), lambda i: (i, 0))      # a program's block
        vector_spec = pl.BlockSpec((1, Dp), lambda i: (0, 0))
        if adds:
            parts = jnp.zeros((parts.shape[0], Mp, Dp), jnp.float32).at[:, :M, :D].set(
                parts[:, :M, :D].astype(jnp.float32))
            parts_spec = pl.BlockSpec((parts.shape[0], BM, Dp), lambda i: (0, i, 0))
        out_shape = (Mp, Dp)
    if adds:
        args.append(parts)

    def kernel(x_ref, w_ref, *refs):
        if adds:      # the residual's: h's output before y's, the parts after the vectors
            *refs, p_ref, h_ref, o_ref = refs
            *b_ref, add_ref = refs if add_bias is not None else (*refs, None)
        else:
            *b_ref, o_ref = refs              # b_ref: [the bias] for the layer norm, else []
        first = pl.program_id(0) * BM
        cols = lax.broadcasted_iota(jnp.int32, (BM, Dp), 1)
        live = (first + lax.broadcasted_iota(jnp.int32, (BM, Dp), 0) < M) & (cols < D)

        def vector(ref):   # [1, Dp], zeros past D
            if not in_place:
                return ref[...]
            inside = lax.broadcasted_iota(jnp.int32, (Dp,), 0) < D
            return pltriton.load(ref.at[pl.ds(0, Dp)], mask=inside, other=0.0)[None, :]
        if in_place:
            at = (pl.ds(first, BM), pl.ds(0, Dp))
            v = pltriton.load(x_ref.at[at], mask=live, other=0.0)
        else:
            at = (pl.ds(0, BM), pl.ds(0, Dp))
            v = x_ref[...]
        if adds:
            # the partial sums in order, then the bias, then the residual: XLA's order
            total = pallas_backend.load_sum(p_ref, at, live)
            if add_ref is not None:
                total = total + vector(add_ref)
            v = v + total
            if in_place:
                pltriton.store(h_ref.at[at], v, mask=live)
            else:
                h_ref[...] = v
        if centre:
            # (the padding's x - mean would be -mean: times 0 it adds nothing to the variance)
            v = (v - jnp.sum(v, axis=1, keepdims=True) / D) * (cols < D).astype(jnp.float32)
        var = jnp.sum(v * v, axis=1, keepdims=True) / D
        y = v * (1.0 / jnp.sqrt(var + eps)) * vector(w_ref)
        if centre:
            y = y + vector(b_ref[0])
        if in_place:
            pltriton.store(o_ref.at[pl.ds(first, BM), pl.ds(0, Dp)], y, mask=live)
        else:
            o_ref[...] = y

    shape = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    out = pl.pallas_call(
        kernel,
        out_shape=[shape, shape] if adds else shape,
        grid=(Mp // BM,),
        in_specs=[rows_spec] + [vector_spec] * len(vectors) + ([parts_spec] if adds else []),
        out_specs=[rows_spec, rows_spec] if adds else rows_spec,
        **pallas_backend.options(interpret),
    )(*args)
    if adds:
        return out[0][:M, :D], out[1][:M, :D]
    return out[:M, :D]
