"""A model split over several devices (llama.cpp's `--split-mode`, `--tensor-split`,
`--main-gpu`; vLLM's `--tensor-parallel-size`): the devices of one `jax.sharding.Mesh`.

`row`: every packed projection's rows (output columns) are divided evenly over the devices,
each device holding its share of every projection in a buffer of its own at the same
offsets (shard_weights); a step multiplies each share with the same C++ kernel and
all-gathers the pieces (model/row_split.py), so a row's logits are the same bits at any
number of devices. Everything else in the step (norms, rotary, attention, the KV cache) is
computed whole on every device for now: the weights are split, the cache is not.

`layer` (consecutive layers on consecutive devices) is not built yet, nor are uneven
--tensor-split proportions, mixtures of experts, recurrent layers or kernels other than
the C++ one under a split: each is one clear error at start.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kinetic import kernels
from kinetic.engine.engine_config import Split
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.layers import Proj
from kinetic.model.row_split import AXIS

ALIGN = 64   # each share's offset in a device's buffer


def mesh(split: Split) -> Mesh:
    """The mesh of the devices `split` uses (checked against those visible)."""
    visible = jax.devices()
    if split.tensor_split and len(split.tensor_split) > len(visible):
        raise ValueError(f"--tensor-split names {len(split.tensor_split)} devices; "
                         f"{len(visible)} are visible")
    if split.tensor_split:
        used = [i for i, t in enumerate(split.tensor_split) if t > 0]
        if len({split.tensor_split[i] for i in used}) > 1:
            raise ValueError(f"--tensor-split {','.join(map(str, split.tensor_split))}: "
                             f"uneven proportions are not supported yet (give equal ones, "
                             f"or 0 to leave a device out)")
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
    return Mesh(np.array(devices), (AXIS,))


def check(split: Split, cfg: Config) -> None:
    """A model this split cannot run: one clear error."""
    if not split.active:
        return
    if split.mode == "layer":
        raise ModelConfigError("--split-mode layer is not supported yet; --split-mode row "
                               "splits every projection over the devices")
    if cfg.kernel != "ffi":
        raise ModelConfigError(f"--split-mode row runs kinetic's C++ kernel (--kernel ffi), "
                               f"not {cfg.kernel!r}")
    if cfg.n_expert or cfg.recurrent:
        raise ModelConfigError("--split-mode row does not split mixtures of experts or "
                               "recurrent layers yet")


def shard_weights(buffer: jax.Array, skeleton: dict, mesh: Mesh) -> tuple[jax.Array, dict]:
    """(the buffer split over the mesh: per device its rows of every packed projection, the
    skeleton with those Projs pointing into it; model/row_split.py). Every other weight is
    replicated on every device. A projection whose rows cannot be divided evenly (into whole
    16-row groups where the weight is in the 16-column layout) is a ModelConfigError."""
    D = mesh.devices.size
    host = np.asarray(buffer)
    placed: dict[tuple, int] = {}   # (fmt, offset, n, k) -> offset in each device's buffer
    pieces: list[tuple[int, int, int]] = []   # (whole offset, bytes per device share, at)
    size = 0

    def local(path, p: Proj) -> Proj:
        nonlocal size
        key = (p.fmt, p.offset, p.n, p.k)
        if key not in placed:
            group = 16 * D if p.fmt & kernels.REPACK16 else D
            if p.n % group:
                name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
                raise ModelConfigError(
                    f"--split-mode row over {D} devices: weight {name} has {p.n} rows, which "
                    f"do not split evenly (a multiple of {group} would); use fewer devices")
            share = (p.n // D) * kernels.row_bytes(p.fmt & ~kernels.REPACK16, p.k)
            placed[key] = size
            pieces.append((p.offset, share, size))
            size += -(-share // ALIGN) * ALIGN
        return dataclasses.replace(p, offset=placed[key], mesh=mesh)

    is_proj = lambda x: isinstance(x, Proj)   # noqa: E731
    skeleton = jax.tree_util.tree_map_with_path(
        lambda path, p: local(path, p) if is_proj(p) and p.fmt >= 0 else p, skeleton,
        is_leaf=is_proj)
    shards = []
    for d, device in enumerate(mesh.devices.flat):
        mine = np.zeros(max(size, ALIGN), np.uint8)
        for whole, share, at in pieces:
            mine[at:at + share] = host[whole + d * share:whole + (d + 1) * share]
        shards.append(jax.device_put(mine, device))
    sharded = jax.make_array_from_single_device_arrays(
        (D * len(shards[0]),), NamedSharding(mesh, P(AXIS)), shards)
    return sharded, replicate(skeleton, mesh)


def replicate(tree, mesh: Mesh):
    """Every array of `tree` on every device of the mesh."""
    whole = NamedSharding(mesh, P())
    return jax.tree.map(lambda a: jax.device_put(a, whole) if isinstance(a, jax.Array) else a,
                        tree)
