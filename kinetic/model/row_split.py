"""The weights' row split over devices (`--split-mode row`, kinetic/engine/split.py): each
device holds every packed projection's share of rows (output columns) in a buffer of its own,
at the same offsets on every device, and multiplies them with the same C++ kernel as one
device would; the pieces are all-gathered, never summed, so every output element is the
one device's bits (each is one row's dot product, whatever the other rows).

A Proj split this way keeps its whole `n` and has `mesh` set; its `offset` is into each
device's own buffer, and `data` (inside a step) is the global buffer, sharded along the
mesh's one axis. Everything else in a step (norms, rotary, attention) runs whole on every
device: the same program, the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kinetic.kernels import ffi as native

AXIS = "model"   # the mesh's one axis


def linear_many(x: jax.Array, data: jax.Array, weights: list[tuple[int, int, int]], k: int,
                mesh, live: jax.Array | None = None) -> list[jax.Array]:
    """ffi.qmatmul_many over split weights (fmt, offset, n: the whole n): each device its
    n / D columns of each, gathered into [..., n] per weight."""
    D = mesh.shape[AXIS]
    local = [(fmt, offset, n // D) for fmt, offset, n in weights]

    def run(x, buffer, *live):
        ys = native.qmatmul_many(x, buffer, local, k, *live)
        return [jax.lax.all_gather(y, AXIS, axis=y.ndim - 1, tiled=True) for y in ys]

    args = (x, data) if live is None else (x, data, live)
    specs = (P(), P(AXIS), P())[:len(args)]
    return jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=[P()] * len(weights),
                         check_vma=False)(*args)


def rows(tokens: jax.Array, data: jax.Array, fmt: int, offset: int, n: int, k: int,
         mesh) -> jax.Array:
    """ffi.dequant_rows of a split table (n rows, n / D on each device): each device
    dequantizes the tokens it holds (the others read its row 0, then dropped), the pieces
    are gathered, and each token takes its own device's row: a selection, no arithmetic."""
    D = mesh.shape[AXIS]
    per = n // D

    def run(tokens, buffer):
        first = jax.lax.axis_index(AXIS) * per
        mine = tokens - first
        held = (mine >= 0) & (mine < per)
        got = native.dequant_rows(jnp.where(held, mine, 0), buffer, fmt, offset, per, k)
        return jax.lax.all_gather(got, AXIS, axis=0, tiled=False)   # [D, T, k]

    every = jax.shard_map(run, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                          check_vma=False)(tokens, data)
    owner = (tokens // per).astype(jnp.int32)
    return jnp.take_along_axis(every, owner[None, :, None], axis=0)[0]
