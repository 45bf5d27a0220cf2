"""The weights split over devices (kinetic/engine/split.py): the step's pieces that read a
split weight. Each device holds its part of the weights in a buffer of its own (a global
buffer sharded along the mesh's one axis), and no device ever adds another's partial sums,
so every output element is the one device's bits at any number of devices.

- `--split-mode row`: every packed projection's rows (output columns) divided among the
  devices (split.row_counts), at the same offsets on each; each multiplies its share with
  the same C++ kernel as one device would and the pieces are all-gathered (linear_many,
  rows); the pallas kernel's planes likewise, in whole tiles (planes_tile).
- `--split-mode layer`: each projection whole on one device, its `owner` (consecutive
  layers on consecutive devices); the owner multiplies it and its result is broadcast to
  the others (owned), the others skipping the work. A mixture's experts are one layer's:
  their pairs run on its owner too (model/experts.py); under a row split each device
  holds its rows of every expert (experts_rows).

The KV cache may be split too: by its heads (by_heads), each device holding its KV heads'
pages and attending with their queries, under either split.

A Proj split either way keeps its whole `n` and has `mesh` set (and `owner` >= 0 under a
layer split, `rows` under a row split); its `offset` is into its device's own buffer.
Everything else in a step (norms, rotary; attention where the cache is not split by heads)
runs whole on every device: the same program, the same bits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kinetic.kernels import ffi as native

AXIS = "model"   # the mesh's one axis


def linear_many(x: jax.Array, data: jax.Array, weights: list[tuple[int, int, int]], k: int,
                mesh, live: jax.Array | None = None, owner: int = -1,
                rows: list[tuple[int, ...]] | None = None) -> list[jax.Array]:
    """ffi.qmatmul_many over split weights (fmt, offset, n: the whole n), [..., n] each: by
    row (owner -1; rows: each weight's count of rows on each device), each device its rows
    of each (padded with zero rows to the most any device holds), gathered and the
    weight's rows taken; by layer, the owner's whole product, broadcast."""
    extra = () if live is None else (live,)
    if owner >= 0:
        return owned(lambda buffer, x, *live: native.qmatmul_many(x, buffer, weights, k, *live),
                     mesh, owner, data, x, *extra)
    held = [max(r) for r in rows]
    local = [(fmt, offset, h) for (fmt, offset, _), h in zip(weights, held)]

    def run(buffer, x, *live):
        return shares_to_rows(native.qmatmul_many(x, buffer, local, k, *live), rows)

    return jax.shard_map(run, mesh=mesh, in_specs=(P(AXIS), P()) + (P(),) * len(extra),
                         out_specs=[P()] * len(weights), check_vma=False)(data, x, *extra)


def experts_rows(x: jax.Array, ids: jax.Array, data: jax.Array,
                 weights: list[tuple[int, int, int, int]], k: int, n_expert: int, mesh,
                 rows: list[tuple[int, ...]]) -> list[jax.Array]:
    """ffi.qmatmul_id over a mixture's experts split by row (weights: fmt, offset of expert
    0 and stride in each device's buffer, the whole n; rows: each weight's count of rows on
    each device, the same for every expert): each device its rows of the chosen experts,
    gathered and the weights' rows taken, [R, S, n] each."""
    held = [max(r) for r in rows]
    local = [(fmt, offset, stride, h) for (fmt, offset, stride, _), h in zip(weights, held)]

    def run(buffer, x, ids):
        return shares_to_rows(native.qmatmul_id(x, ids, buffer, local, k, n_expert), rows)

    return jax.shard_map(run, mesh=mesh, in_specs=(P(AXIS), P(), P()),
                         out_specs=[P()] * len(weights), check_vma=False)(data, x, ids)


def shares_to_rows(ys: list[jax.Array], rows: list[tuple[int, ...]]) -> list[jax.Array]:
    """Inside shard_map: this device's shares ys ([..., max(r)] each, rows r of a weight on
    each device) gathered from every device, each weight's rows taken from its shares in
    device order (a selection), [..., sum(r)] each."""
    every = gathered(ys)   # [D, ..., the shares side by side]
    out, at = [], 0
    for r in rows:
        h = max(r)
        piece = jnp.moveaxis(every[..., at:at + h], 0, -2)
        piece = piece.reshape(*piece.shape[:-2], len(r) * h)
        if len(set(r)) > 1:   # uneven shares: the weight's rows, not the padding's
            piece = jnp.take(piece, jnp.asarray(held_rows(r)), axis=-1)
        out.append(piece)
        at += h
    return out


def planes_tile(n: int, K: int):
    """(rows of a pallas weight of n rows and K columns, padded to the kernel's multiple;
    the unsplit weight's pallas_matmul.Tiling, whose tile over N is bn). Split by row
    (engine/split.py, shard_planes), each device holds whole bn tiles (split.row_counts'
    share, in --tensor-split's proportion) followed by zero rows up to the most any device
    holds, so that every element is computed at the unsplit tiling (the same arithmetic)."""
    from kinetic.kernels import pallas_matmul
    padded = -(-n // pallas_matmul.ROWS) * pallas_matmul.ROWS
    return padded, pallas_matmul.tiling(padded, K)


def planes_linear(x: jax.Array, w, mesh, counts: tuple[int, ...]) -> jax.Array:
    """The pallas kernel's matmul (kernels/pallas_matmul.py) of a weight split by row
    (planes_tile; `counts` rows on each device): each device its tiles at the whole
    weight's tiling, the pieces gathered and the weight's rows taken from them (a
    selection), [..., n]."""
    from kinetic.kernels import pallas_matmul
    n, K = w.shape
    _, tiles = planes_tile(n, K)

    def run(x, w):
        return shares_to_rows([pallas_matmul.matmul(x, w, tiles=tiles)], [counts])[0]

    y = jax.shard_map(run, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                      check_vma=False)(x, dataclasses.replace(w, n=0))
    return y[..., :n]   # (the padded weight's rows: the kernel's multiple of 16)


def planes_rows(tokens: jax.Array, w, counts: tuple[int, ...]) -> jax.Array:
    """pallas_matmul.rows of a table split by row (planes_linear's `counts`): each token's
    row where the split put it."""
    from kinetic.kernels import pallas_matmul
    return pallas_matmul.rows(w, jnp.take(jnp.asarray(held_rows(counts), jnp.int32), tokens))


def gathered(ys: list[jax.Array]) -> jax.Array:
    """Every device's arrays ys ([..., n_i] each, the same shapes on every device) side by
    side on every device, [D, ..., sum of n_i], in one all-gather (inside shard_map): a
    message per call rather than per array (between processes a message costs more than
    its bytes: docs/performance.md, "A split's cost on this machine")."""
    return jax.lax.all_gather(jnp.concatenate(ys, axis=-1), AXIS, axis=0, tiled=False)


def held_rows(counts: tuple[int, ...]) -> np.ndarray:
    """Where each of a weight's rows is among the gathered shares of a row split whose
    devices hold `counts` rows each, padded to the most."""
    held = max(counts)
    return np.concatenate([d * held + np.arange(c) for d, c in enumerate(counts)])


def owned(run, mesh, owner: int, data: jax.Array, *args):
    """run(this device's buffer, *args) (arrays out, of 4-byte types) computed by the owner
    device alone under a layer split, the others skipping it (lax.cond), and broadcast: its
    bits gathered to every device in one all-gather and the owner's taken, a selection."""
    def body(buffer, *args):
        shapes = jax.eval_shape(run, buffer, *args)
        out = jax.lax.cond(
            jax.lax.axis_index(AXIS) == owner, lambda: run(buffer, *args),
            lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
        leaves, tree = jax.tree.flatten(out)
        bits = [(y if y.dtype == jnp.int32 else jax.lax.bitcast_convert_type(y, jnp.int32))
                .reshape(-1) for y in leaves]
        mine, at, back = gathered(bits)[owner], 0, []
        for y in leaves:
            b = mine[at:at + y.size].reshape(y.shape)
            back.append(b if y.dtype == jnp.int32 else jax.lax.bitcast_convert_type(b, y.dtype))
            at += y.size
        return jax.tree.unflatten(tree, back)

    return jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS),) + (P(),) * len(args),
                         out_specs=P(), check_vma=False)(data, *args)


def rows(tokens: jax.Array, data: jax.Array, fmt: int, offset: int, n: int, k: int,
         mesh, owner: int = -1, counts: tuple[int, ...] = ()) -> jax.Array:
    """ffi.dequant_rows of a split table. By layer (owner >= 0): the owner dequantizes the
    tokens' rows, broadcast. By row (`counts` rows on each device, consecutive): each
    device dequantizes the tokens it holds (the others read its row 0, then dropped), the
    pieces are gathered, and each token takes its own device's row: a selection, no
    arithmetic."""
    if owner >= 0:
        return owned(lambda buffer, tokens: native.dequant_rows(tokens, buffer, fmt, offset, n, k),
                     mesh, owner, data, tokens)
    ends = np.cumsum(counts)
    starts = jnp.asarray(ends - np.asarray(counts), jnp.int32)
    sizes = jnp.asarray(counts, jnp.int32)

    def run(tokens, buffer):
        d = jax.lax.axis_index(AXIS)
        mine = tokens - starts[d]
        held = (mine >= 0) & (mine < sizes[d])
        got = native.dequant_rows(jnp.where(held, mine, 0), buffer, fmt, offset,
                                  max(counts), k)
        return jax.lax.all_gather(got, AXIS, axis=0, tiled=False)   # [D, T, k]

    every = jax.shard_map(run, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(),
                          check_vma=False)(tokens, data)
    owner_of = jnp.searchsorted(jnp.asarray(ends, jnp.int32), tokens.astype(jnp.int32),
                                side="right").astype(jnp.int32)
    return jnp.take_along_axis(every, owner_of[None, :, None], axis=0)[0]


HEADS = P(None, AXIS, None)            # q, k, v [T, heads, width]
CACHE_HEADS = P(None, None, AXIS, None)   # a cache's pages [pages, page_size, heads, width]


def by_heads(attend, mesh):
    """attend(q, k, v, (k_cache, v_cache), step, ends) -> (out, (k_cache, v_cache)) run on
    each device over its share of the heads: its KV heads' pages and their queries (a query
    head's KV head is in the same share when the KV heads divide evenly, as split.heads_split
    requires), the step's other inputs whole on every device. A head's attention is its own
    rows' arithmetic, whatever the other heads: the same bits as one device."""
    return jax.shard_map(attend, mesh=mesh,
                         in_specs=(HEADS, HEADS, HEADS, (CACHE_HEADS, CACHE_HEADS), P(), P()),
                         out_specs=(HEADS, (CACHE_HEADS, CACHE_HEADS)), check_vma=False)
