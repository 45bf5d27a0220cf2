"""A model split over several devices (llama.cpp's `--split-mode`, `--tensor-split`,
`--main-gpu`; vLLM's `--tensor-parallel-size`): the devices of one `jax.sharding.Mesh`, each
holding its part of the weights in a buffer of its own (shard_weights;
model/device_split.py computes with them).

`row`: every packed projection's rows (output columns) are divided over the devices in
proportion to --tensor-split (evenly without it; row_counts), each device holding its share
of every projection at the same offsets, padded with zero rows to the largest share; a step
multiplies each share with the same C++ kernel, all-gathers the pieces and takes the
weight's rows from them.

`layer`: consecutive layers on consecutive devices, in proportion to --tensor-split (evenly
without it); the token embedding on the first device, the output projection on the last.
Each projection is multiplied by the device holding it, and its result broadcast.

Either way a row's logits are the same bits at any number of devices: no device adds
another's partial sums. The KV cache is split by heads where they divide evenly over the
devices (heads_split: each device its heads' pages, attending with their queries), else
whole on every device; norms and rotary run whole on every device.
A mixture's experts split as any projection: by layer on their layer's device, by row
each device its rows of every expert. Kernels other than the C++ one under a split (but the
pallas kernel by row) are one clear error at start.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kinetic import kernels
from kinetic.engine.engine_config import Split
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.layers import PLANES, Proj
from kinetic.model import device_split
from kinetic.model.device_split import AXIS

ALIGN = 64   # each share's offset in a device's buffer


def mesh(split: Split) -> Mesh:
    """The mesh of the devices `split` uses (checked against those visible)."""
    visible = jax.devices()
    if split.tensor_split and len(split.tensor_split) > len(visible):
        raise ValueError(f"--tensor-split names {len(split.tensor_split)} devices; "
                         f"{len(visible)} are visible")
    if split.tensor_split:
        used = [i for i, t in enumerate(split.tensor_split) if t > 0]
        devices = [visible[i] for i in used]
    else:
        n = split.devices or len(visible)
        if n > len(visible):
            raise ValueError(f"a split over {n} devices: {len(visible)} are visible "
                             f"({jax.default_backend()})")
        devices = visible[:n]
    if not 0 <= split.main_device < len(visible):
        raise ValueError(f"--main-gpu {split.main_device}: devices 0 to {len(visible) - 1} "
                         f"are visible")
    if visible[split.main_device].process_index != 0:
        raise ValueError(f"--main-gpu {split.main_device}: a device of process "
                         f"{visible[split.main_device].process_index}; the sampler runs on "
                         f"one of the leader's ({len(jax.local_devices())} first)")
    return Mesh(np.array(devices), (AXIS,))


def check(split: Split, cfg: Config) -> None:
    """A model this split cannot run: one clear error."""
    if not split.active:
        return
    kernels_here = ("ffi", "pallas") if split.mode == "row" else ("ffi",)
    if cfg.kernel not in kernels_here:
        raise ModelConfigError(f"--split-mode {split.mode} runs on --kernel "
                               f"{' or '.join(kernels_here)}, not {cfg.kernel!r}")


def heads_split(cfg: Config, mesh: Mesh | None) -> bool:
    """Whether the KV cache is split over the mesh by heads (each device its n_kv_head / D
    heads' pages: model/device_split.by_heads): where the heads divide evenly. Otherwise
    every device holds the whole cache."""
    return (mesh is not None and cfg.n_kv_head % mesh.devices.size == 0
            and not cfg.conv_layers and not cfg.recurrent)


def place_cache(cache: list, mesh: Mesh, by_heads: bool) -> list:
    """The KV cache (per layer a (k, v) pair of page arrays [pages, page_size, heads,
    width]) on the mesh: each device its heads' share, or the whole on every device."""
    if not by_heads:
        return replicate(cache, mesh)
    shard = NamedSharding(mesh, device_split.CACHE_HEADS)

    return jax.tree.map(lambda a: _put(a, shard), cache)


@functools.cache
def gathered(mesh: Mesh):
    """A program that gives any array of the mesh whole on every device (an all-gather of
    a cache's heads)."""
    return jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, P()))


def row_counts(n: int, group: int, split: Split, devices: int) -> tuple[int, ...]:
    """Under a row split, each device's rows of a weight of n rows: whole groups of `group`
    rows (16 in the 16-column layout) in proportion to --tensor-split (evenly without one),
    rounded at the cumulative boundaries; a device may hold none (then zero rows only)."""
    shares = [t for t in split.tensor_split if t > 0] or [1.0] * devices
    bounds = np.round(np.cumsum(shares) / sum(shares) * (n // group)).astype(int)
    return tuple(int(c) * group for c in np.diff([0, *bounds]))


def owners(n_layer: int, split: Split, devices: int) -> list[int]:
    """Under a layer split, each layer's device (its index in the mesh): consecutive layers
    on consecutive devices, as many on each as row_counts gives n_layer rows of one."""
    counts = row_counts(n_layer, 1, split, devices)
    return [d for d, c in enumerate(counts) for _ in range(c)]


def shard_weights(buffer: jax.Array, skeleton: dict, mesh: Mesh,
                  split: Split) -> tuple[jax.Array, dict]:
    """(the buffer split over the mesh, the skeleton with its Projs pointing into it;
    model/device_split.py): by row, per device its rows of every packed projection at the
    same offsets; by layer, per device the projections of its layers (owners). Every other
    weight is replicated on every device. Under a row split each device's rows of a
    projection are row_counts' (whole 16-row groups where the weight is in the 16-column
    layout), the shares padded with zero rows to the largest."""
    D = mesh.devices.size
    host = np.asarray(buffer)
    by_row = split.mode == "row"
    layer_owner = owners(len(skeleton.get("blk", ())), split, D)
    placed: dict[tuple, tuple[int, int]] = {}   # (fmt, offset, n, k) -> (owner, offset)
    # per device: (offset in the whole buffer, bytes, offset in the device's buffer)
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(D)]
    sizes = [0] * D
    ends = [(-1, 0)] * D   # per device: where its last weight ends, in the file and in it
    counts: dict[tuple, tuple[int, ...]] = {}   # by row: each device's rows of a weight

    def local(path, p: Proj) -> Proj:
        key = (p.fmt, p.offset, p.n, p.k)
        row = kernels.row_bytes(p.fmt & ~kernels.REPACK16, p.k)
        if key not in placed and by_row:
            counts[key] = row_counts(p.n, 16 if p.fmt & kernels.REPACK16 else 1, split, D)
            first = 0
            for d, c in enumerate(counts[key]):   # (the rest of each share: zero rows)
                pieces[d].append((p.offset + first * row, c * row, sizes[0]))
                first += c
            placed[key] = (-1, sizes[0])
            sizes[:] = [sizes[0] + -(-(max(counts[key]) * row) // ALIGN) * ALIGN] * D
        elif key not in placed:
            # a layer's weights on its device; the embedding on the first, the rest last
            d = (layer_owner[path[1].idx] if path[0].key == "blk" else
                 0 if path[0].key == "token_embd" else D - 1)
            # right after the weight before it where the file has it so (a mixture's
            # experts: model/experts.py reads them at a fixed stride)
            whole, at = ends[d]
            if p.offset != whole:
                at = -(-sizes[d] // ALIGN) * ALIGN
            pieces[d].append((p.offset, p.n * row, at))
            placed[key] = (d, at)
            sizes[d] = at + p.n * row
            ends[d] = (p.offset + p.n * row, sizes[d])
        owner, offset = placed[key]
        return dataclasses.replace(p, offset=offset, mesh=mesh, owner=owner,
                                   rows=counts.get(key, ()))

    is_proj = lambda x: isinstance(x, Proj)   # noqa: E731
    skeleton = jax.tree_util.tree_map_with_path(
        lambda path, p: local(path, p) if is_proj(p) and p.fmt >= 0 else p, skeleton,
        is_leaf=is_proj)
    size = max(ALIGN, *sizes)   # every device's buffer one size: one global array
    shards = []   # this process's devices' (engine/hosts.py: each process holds its own)
    for d, device in enumerate(mesh.devices.flat):
        if device.process_index != jax.process_index():
            continue
        mine = np.zeros(size, np.uint8)
        for whole, n, at in pieces[d]:
            mine[at:at + n] = host[whole:whole + n]
        shards.append(jax.device_put(mine, device))
    sharded = jax.make_array_from_single_device_arrays(
        (D * size,), NamedSharding(mesh, P(AXIS)), shards)
    return sharded, replicate(skeleton, mesh)


def shard_planes(skeleton: dict, mesh: Mesh, split: Split) -> dict:
    """The weights of the pallas kernel (Projs of pallas_matmul.Planes) split by row over
    the mesh: each device whole tiles of the unsplit weight's tile over N, as many as
    row_counts gives it (in --tensor-split's proportion), padded with zero rows to the
    largest share (device_split.planes_tile), and sharded; every other array replicated.
    A mixture's stacked experts become a list of them, each split so (experts.py then runs
    them one at a time)."""
    D = mesh.devices.size
    rows = NamedSharding(mesh, P(AXIS))

    # a weight the tree holds twice (a tied output) split once
    done: dict[int, Proj | list] = {}

    def share(p: Proj, key: bool = True) -> Proj:
        """p's shares; key: remembered by p's id (a Proj of the tree: the tree keeps it,
        so its id is its own; not an expert's Proj made here, whose id may be reused)."""
        if key and id(p) in done:
            return done[id(p)]
        w = p.data
        padded, tiles = device_split.planes_tile(*w.shape)
        counts = row_counts(padded, tiles.bn, split, D)
        where = device_split.held_rows(counts)

        def rearranged(a):
            a = np.asarray(a)
            out = np.zeros((D * max(counts), *a.shape[1:]), a.dtype)
            out[where[:len(a)]] = a
            return _put(out, rows)

        shared = dataclasses.replace(p, data=jax.tree.map(rearranged, w), mesh=mesh,
                                     rows=counts)
        if key:
            done[id(p)] = shared
        return shared

    is_proj = lambda x: isinstance(x, Proj)   # noqa: E731

    def shares(p: Proj):   # a mixture's stacked experts: each expert split as any weight
        if not p.data.experts:
            return share(p)
        if id(p) not in done:   # (the stacked Proj's entry: its experts' shares, once)
            done[id(p)] = [share(dataclasses.replace(p, data=p.data.expert(e)), key=False)
                           for e in range(p.data.experts)]
        return done[id(p)]
    planes = jax.tree.map(lambda p: shares(p) if is_proj(p) and p.fmt == PLANES else p,
                          skeleton, is_leaf=is_proj)
    return replicate(planes, mesh)


def _put(a, sharding: NamedSharding) -> jax.Array:
    """a (a device or host array) placed as `sharding` says; with several processes each
    puts the pieces of its own devices."""
    if jax.process_count() == 1:
        return jax.device_put(a, sharding)
    a = np.asarray(a)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])


def replicate(tree, mesh: Mesh):
    """Every array of `tree` (device or host arrays) on every device of the mesh. An array
    on one device goes through the host: with several processes, each puts its own copy on
    the devices it has (jax.device_put of a one-device array onto devices of another
    process is not a copy JAX makes)."""
    whole = NamedSharding(mesh, P())
    # (with several processes, device_put of a host array would first check that every
    # process has the same one: a collective per array; every process has, by construction)
    return jax.tree.map(
        lambda a: a if _placed(a, mesh) else _put(a, whole)
        if isinstance(a, (jax.Array, np.ndarray)) else a, tree)


def _placed(a, mesh: Mesh) -> bool:
    """Whether `a` is already an array over the mesh (a split weight's planes)."""
    return isinstance(a, jax.Array) and isinstance(a.sharding, NamedSharding) and \
        a.sharding.mesh == mesh


def on(array: jax.Array, device) -> jax.Array:
    """A replicated array's copy on `device` (one of this process's): no transfer."""
    return next(s.data for s in array.addressable_shards if s.device == device)
