"""The greedy draw of a GPU's decode loop as a Pallas kernel (engine/sample_device.py
`greedy_tokens` where the step is traced for a GPU and every token is allowed).

    tokens = greedy(logits, ids, values)      logits [B, V], the bias pairs [B, W] -> [B]

sampler.greedy's token, exactly: the first index of each row's maximum after the logit bias,
NaN read as -inf, -1 where the maximum is not finite. XLA ran it as about eight kernels a
step (the bias scattered into a [B, V] array of zeros and added, the NaNs replaced, the
maximum and its first index each in two passes: bench/gpu_compile.py); here it is three:
the bias added in place at its ids (one scatter: x + 0 elsewhere changes no comparison),
one Pallas kernel whose programs each take a row's block of VOCAB_BLOCK columns to its
maximum and the first column holding it, and one reduction over the blocks. A maximum is
exact in any order and a first index is the least of the blocks' first indices where their
maximum is the row's, so the token is sampler.greedy's whatever the blocks
(tests/test_pallas_greedy.py, interpreted on a CPU), and a row's token depends on its own
logits alone. Interpreted wherever JAX's backend is not a GPU
(kernels/pallas_backend.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend

VOCAB_BLOCK = 8192   # a program's columns (Qwen2.5's 151,936: 19 blocks a row)


def greedy(logits: jax.Array, ids: jax.Array, values: jax.Array,
           interpret: bool | None = None) -> jax.Array:
    """int32 [B]: each row's token (module docstring). ids [B, W] int32 (-1: an unused
    pair), values [B, W]: the bias, values[b, j] added at ids[b, j] (unique in a row)."""
    B, V = logits.shape
    at = jnp.broadcast_to(jnp.arange(B)[:, None], ids.shape)
    x = logits.astype(jnp.float32).at[at, jnp.where(ids >= 0, ids, V)].add(
        values.astype(jnp.float32), mode="drop")
    maxes, firsts = _blocks(x, pallas_backend.interpreted(interpret))
    top = jnp.max(maxes, axis=1, keepdims=True)
    first = jnp.min(jnp.where(maxes == top, firsts, V), axis=1)
    return jnp.where(jnp.isfinite(top[:, 0]), first, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1,))
def _blocks(x, interpret: bool):
    """([B, n] maxima, [B, n] first columns holding them) of x [B, V]'s blocks of
    VOCAB_BLOCK columns, NaN read as -inf (columns past V are -inf)."""
    B, V = x.shape
    n = -(-V // VOCAB_BLOCK)

    def kernel(x_ref, max_ref, first_ref):
        b, j = pl.program_id(0), pl.program_id(1)
        cols = j * VOCAB_BLOCK + lax.broadcasted_iota(jnp.int32, (1, VOCAB_BLOCK), 1)
        v = pltriton.load(x_ref.at[pl.ds(b, 1), pl.ds(j * VOCAB_BLOCK, VOCAB_BLOCK)],
                          mask=cols < V, other=-jnp.inf)
        v = jnp.where(jnp.isnan(v), -jnp.inf, v)
        top = jnp.max(v, axis=1, keepdims=True)
        first = jnp.min(jnp.where(v == top, cols, V), axis=1, keepdims=True)
        max_ref[pl.ds(b, 1), pl.ds(j, 1)] = top
        first_ref[pl.ds(b, 1), pl.ds(j, 1)] = first

    def whole(shape):
        return pl.BlockSpec(shape, lambda b, j: (0, 0))
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((B, n), jnp.float32),
                   jax.ShapeDtypeStruct((B, n), jnp.int32)],
        grid=(B, n),
        in_specs=[whole((B, V))],
        out_specs=[whole((B, n)), whole((B, n))],
        **pallas_backend.options(interpret, num_warps=8),
    )(x)
