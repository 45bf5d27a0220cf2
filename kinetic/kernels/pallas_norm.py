"""The norms as a Pallas kernel: a step's norms on a GPU (model/layers.py `rms_norm`,
model/bert.py `layer_norm`).

    y = rms_norm(x, w, eps)          x [..., D] -> float32 [..., D], x / sqrt(mean(x^2) + eps) * w
    y = layer_norm(x, w, b, eps)     (x - mean) / sqrt(var + eps) * w + b

XLA computes a norm's mean as a reduction whose order it picks from the whole array's shape:
on a CPU it gave a row other bits at 16 rows than at 1 (bench/gpu.py's row pieces measure
the same on a GPU), which is why a CPU runs it in C++. Here, one program normalizes a block
of rows (`block_rows`: 16, fewer for rows wider than 512): the sum of squares over D is one
reduction of a block whose shape depends on D alone, whatever the number of rows, so a
row's arithmetic never depends on how many rows share the call or which; the number of rows
only sets the grid. Rows are padded with zeros to whole blocks and D to a power of 2
(Triton's arrays have power-of-2 sizes; a zero adds nothing to a sum of squares), and the
padding's output is dropped. Interpreted wherever JAX's backend is not a GPU
(kernels/pallas_backend.py); tests/test_pallas_norm.py checks it there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

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


def _rows(x, w, b, eps: float, interpret: bool | None) -> jax.Array:
    lead, D = x.shape[:-1], x.shape[-1]
    y = _norm(x.reshape(-1, D), w, b, float(eps), pallas_backend.interpreted(interpret))
    return y.reshape(*lead, D)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _norm(x, w, b, eps: float, interpret: bool):
    """b None: the RMS norm; else the layer norm, b its bias."""
    M, D = x.shape
    Dp = pl.next_power_of_2(D)
    BM = block_rows(Dp)
    Mp = -(-M // BM) * BM
    xp = jnp.zeros((Mp, Dp), jnp.float32).at[:M, :D].set(x.astype(jnp.float32))

    def row(v):   # a [D] vector as [1, Dp], zeros past D
        return jnp.zeros((1, Dp), jnp.float32).at[0, :D].set(jnp.asarray(v, jnp.float32))
    centre = b is not None
    # the layer norm's inputs: its bias, and 1 in the D real columns (the padding's
    # x - mean would be -mean: multiplied by 0 it adds nothing to the variance)
    extra = [row(b), row(jnp.ones(D))] if centre else []

    def kernel(x_ref, w_ref, *refs):
        *extra_refs, o_ref = refs
        v = x_ref[...]
        if centre:
            b_ref, inside_ref = extra_refs
            v = (v - jnp.sum(v, axis=1, keepdims=True) / D) * inside_ref[...]
        var = jnp.sum(v * v, axis=1, keepdims=True) / D
        y = v * (1.0 / jnp.sqrt(var + eps)) * w_ref[...]
        o_ref[...] = y + b_ref[...] if centre else y

    whole = pl.BlockSpec((1, Dp), lambda i: (0, 0))
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, Dp), jnp.float32),
        grid=(Mp // BM,),
        in_specs=[pl.BlockSpec((BM, Dp), lambda i: (i, 0)), whole] + [whole] * len(extra),
        out_specs=pl.BlockSpec((BM, Dp), lambda i: (i, 0)),
        **pallas_backend.options(interpret),
    )(xp, row(w), *extra)
    return out[:M, :D]
