"""The RMS norm as a Pallas kernel: a step's norms on a GPU (model/layers.py `rms_norm`).

    y = rms_norm(x, w, eps)      x [..., D] -> float32 [..., D], x / sqrt(mean(x^2) + eps) * w

XLA computes a norm's mean as a reduction whose order it picks from the whole array's shape:
on a CPU it gave a row other bits at 16 rows than at 1 (bench/gpu.py's row pieces measure
the same on a GPU), which is why a CPU runs it in C++. Here, one program normalizes a block
of BLOCK_M rows: the sum of squares over D is one reduction of a [BLOCK_M, D] block, the
same shape whatever the number of rows, so a row's arithmetic never depends on how many rows
share the call or which; the number of rows only sets the grid. Rows are padded with zeros
to whole blocks and D to a power of 2 (Triton's arrays have power-of-2 sizes; a zero adds
nothing to a sum of squares), and the padding's output is dropped. Interpreted wherever JAX's backend is not a GPU
(kernels/pallas_backend.py); tests/test_pallas_norm.py checks it there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kinetic.kernels import pallas_backend

BLOCK_M = 16          # rows per program, whatever the number of rows is


def rms_norm(x: jax.Array, w: jax.Array, eps: float, interpret: bool | None = None) -> jax.Array:
    """x [..., D] (any float type, computed in float32), w [D] -> float32 [..., D]."""
    interpret = pallas_backend.interpreted(interpret)
    lead, D = x.shape[:-1], x.shape[-1]
    y = _rms_norm(x.reshape(-1, D), w.reshape(1, D), float(eps), interpret)
    return y.reshape(*lead, D)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rms_norm(x, w, eps: float, interpret: bool):
    M, D = x.shape
    Mp, Dp = -(-M // BLOCK_M) * BLOCK_M, pl.next_power_of_2(D)
    xp = jnp.zeros((Mp, Dp), jnp.float32).at[:M, :D].set(x.astype(jnp.float32))
    wp = jnp.zeros((1, Dp), jnp.float32).at[:, :D].set(w.astype(jnp.float32))

    def kernel(x_ref, w_ref, o_ref):
        v = x_ref[...]
        mean = jnp.sum(v * v, axis=1, keepdims=True) / D
        o_ref[...] = v * (1.0 / jnp.sqrt(mean + eps)) * w_ref[...]

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, Dp), jnp.float32),
        grid=(Mp // BLOCK_M,),
        in_specs=[pl.BlockSpec((BLOCK_M, Dp), lambda i: (i, 0)),
                  pl.BlockSpec((1, Dp), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((BLOCK_M, Dp), lambda i: (i, 0)),
        **pallas_backend.options(interpret),
    )(xp, wp)
    return out[:M, :D]
