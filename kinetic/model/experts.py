"""A mixture of experts in place of the feed-forward block (Qwen3-MoE and the like).

Each row is routed on its own: the router's logits, a softmax over the experts (or each
one's sigmoid), the `n_expert_used` most probable ones (ties to the lower index; a bias may
shift the choice, not the weights) with their probabilities as weights, rescaled to sum to 1
where the model says so. The output is the chosen experts' SwiGLU outputs times their
weights, added in the order of the choice (most probable first), as llama.cpp adds them.

Determinism: nothing a row gets depends on the other rows of its step. The softmax's sum and
the weights' sum are chains of elementwise operations over the expert axis (XLA's reductions
may group a row's values differently at another row count; a max is exact in any order, so
the softmax's is XLA's); an expert runs only on the rows that chose it, gathered into a
small bucket of rows (none: it is skipped, so a decode step reads only the chosen experts'
weights), and each row takes its result only where it chose it, by selection. The kernel
gives a row the same bits at any row count (docs/architecture.md), so the same expert gives
a row the same bits whatever else chose it. With the C++ kernel the
experts run as one call per projection over every (row, chosen expert) pair
(`_pairs_swiglu`, as llama.cpp's mul_mat_id): nothing per expert is compiled, and each
chosen expert's blocks are read once per step. The pallas kernel (a GPU's) does the same
with its experts stacked (kernels/pallas_matmul.py swiglu_experts): one launch for gate and
up, one for down, no branch or launch per expert, and in a decode step (a few pairs) no
sort or gather either.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kinetic.kernels import ffi as native
from kinetic.model import device_split
from kinetic.model.config import Config
from kinetic.model.layers import (PLANES, Normed, Proj, linear, norm_inside, silu_times,
                                  swiglu, value)


def _chain(columns: list[jax.Array], op) -> jax.Array:
    out = columns[0]
    for c in columns[1:]:
        out = op(out, c)
    return out


def route(logits: jax.Array, cfg: Config,
          bias: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(the chosen experts [T, K] int32, most probable first; their weights [T, K] f32) from
    the router's logits [T, E]: a softmax over the experts, or each one's sigmoid
    (cfg.expert_gating). `bias` [E] (LFM2-MoE's exp_probs_b) shifts the choice only: the
    weights are the probabilities themselves."""
    if cfg.expert_gating == "sigmoid":
        probs = jax.nn.sigmoid(logits)
    else:
        # a max is exact in any order, so XLA's reduction may take it; written as a chain of
        # column maxima, XLA's fusion copied the whole chain into each of the 32
        # exponentials (27,600 instructions in a Qwen3-MoE step of 8 layers, about 40 MB
        # of memory per compiled step shape)
        exps = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        total = _chain([exps[:, e] for e in range(cfg.n_expert)], jnp.add)
        probs = exps / total[:, None]
    if bias is None:
        weights, chosen = jax.lax.top_k(probs, cfg.n_expert_used)
    else:
        _, chosen = jax.lax.top_k(probs + bias, cfg.n_expert_used)
        weights = jnp.take_along_axis(probs, chosen, axis=1)
    if cfg.expert_weights_norm:
        total = _chain([weights[:, k] for k in range(cfg.n_expert_used)], jnp.add)
        # llama.cpp clamps the sum from below, at 2^-14, so that tiny weights stay finite
        weights = weights / jnp.maximum(total, 6.103515625e-5)[:, None]
    return chosen, weights


def moe_ffn(x: jax.Array | Normed, w: dict, cfg: Config) -> jax.Array:
    """The mixture's output [T, D] for the normed hidden states x [T, D] (or a layers.Normed:
    its add and norm made by the router's kernel, which writes the normed rows for the
    experts, where the pallas kernel routes; else its value)."""
    T, D = x.shape
    router, bias = w["ffn_gate_inp"], w.get("exp_probs_b.bias")
    experts = (w["ffn_gate_exps"], w["ffn_up_exps"], w["ffn_down_exps"])
    planes = all(isinstance(p, Proj) and p.fmt == PLANES for p in experts)
    if planes:   # the pallas kernel's stacked experts
        from kinetic.kernels import pallas_matmul, pallas_route
    if planes and router.fmt == PLANES and router.mesh is None:
        # the routing, one launch (its router's sum in it); a Normed's add and norm in the
        # router's launch, which writes the normed rows (what else takes it reads them:
        # the experts, a shared expert)
        (parts,) = norm_inside(x, lambda x, norm: pallas_matmul.matmul_many(
            x, [router.data], partials=True, norm=norm, normed=norm is not None))
        x = value(x)
        chosen, weights = pallas_route.route(
            parts, T, cfg.n_expert, cfg.n_expert_used, cfg.expert_gating,
            cfg.expert_weights_norm, bias)
    else:
        x = value(x)
        chosen, weights = route(linear(x, router), cfg, bias)
    if planes:   # every pair's gate and up in one launch, down in one (silu(gate) * up in it)
        ys = pallas_matmul.swiglu_experts(x, chosen, *(p.data for p in experts))
        return _weighted(ys, weights, cfg)
    stacked = [_stacked(projs) for projs in experts]
    first = experts[0][0]
    if all(stacked) and all(p[0].data is first.data for p in experts):
        rows = [p[0].rows for p in experts]   # under a row split: each device's rows

        def on(data):   # ffi.qmatmul_id over `data`, a buffer holding the experts whole
            return lambda x, ids, weights, _, k: native.qmatmul_id(x, ids, data, weights, k,
                                                                   cfg.n_expert)
        if first.mesh is not None and first.owner >= 0:
            # a layer split: on the layer's device (device_split.owned)
            ys = device_split.owned(lambda data, x, chosen: _pairs_swiglu(
                x, chosen, stacked, rows, on(data)), first.mesh, first.owner, first.data, x,
                chosen)
        elif first.mesh is not None:
            # a row split: each device its rows of every expert (device_split.experts_rows)
            ys = _pairs_swiglu(x, chosen, stacked, rows, lambda x, ids, weights, rows, k: (
                device_split.experts_rows(x, ids, first.data, weights, k, cfg.n_expert,
                                          first.mesh, rows)))
        else:
            ys = _pairs_swiglu(x, chosen, stacked, rows, on(first.data))
        return _weighted(ys, weights, cfg)
    # one expert at a time (dense weights; the pallas kernel's split over devices)
    slots = [jnp.zeros((T, D), jnp.float32) for _ in range(cfg.n_expert_used)]
    for e, projs in enumerate(zip(*experts)):
        hit = chosen == e  # [T, K]
        y = _on_chosen_rows(x, jnp.any(hit, axis=1), lambda x, p=projs: swiglu(x, *p))
        slots = [jnp.where(hit[:, k:k + 1], y, s) for k, s in enumerate(slots)]
    return _chain([s * weights[:, k:k + 1] for k, s in enumerate(slots)], jnp.add)


def _weighted(ys: jax.Array, weights: jax.Array, cfg: Config) -> jax.Array:
    """The pairs' outputs ys [T, K, D] times their weights [T, K], added in choice order."""
    return _chain([ys[:, k] * weights[:, k:k + 1] for k in range(cfg.n_expert_used)], jnp.add)


def _stacked(projs: list[Proj]) -> tuple[int, int, int, int] | None:
    """(fmt, offset of expert 0, stride, n) when a mixture's projections are packed blocks of
    one buffer, one format and shape, expert e's `stride` bytes after expert e - 1's (as the
    loader lays a stacked [E, N, K] tensor out: weights.py _Packer.experts); else None."""
    first = projs[0]
    if len(projs) < 2 or first.fmt < 0 or any(
            p.fmt != first.fmt or p.data is not first.data or p.n != first.n or p.k != first.k
            for p in projs):
        return None
    stride = projs[1].offset - first.offset
    if stride <= 0 or any(p.offset != first.offset + e * stride for e, p in enumerate(projs)):
        return None
    return first.fmt, first.offset, stride, first.n


def _pairs_swiglu(x: jax.Array, chosen: jax.Array, stacked: list, rows: list,
                  matmul_id) -> jax.Array:
    """[T, K, D]: each (row, chosen expert) pair's SwiGLU output, the packed experts
    multiplied over all pairs at once (matmul_id(x, ids, weights, their rows, k):
    ffi.qmatmul_id over the experts' buffer, one call for gate and up, one for down, each
    chosen expert's blocks read once per call; rows: under a row split, each device's rows
    of each weight). A pair gets the bits its row gets from its expert alone (the kernel's
    contract), as on the per-expert path."""
    T, D = x.shape
    K = chosen.shape[1]
    gate, up = matmul_id(x, chosen, stacked[:2], rows[:2], D)
    h = silu_times(gate, up).reshape(T * K, -1)
    (y,) = matmul_id(h, chosen.reshape(T * K, 1), stacked[2:], rows[2:], h.shape[1])
    return y.reshape(T, K, D)


def row_buckets(T: int) -> list[int]:
    """The row counts an expert runs at in a T-row step: a few, so that each expert compiles
    a few bodies (a prompt step's rows choose each expert a few at a time)."""
    return [b for b in (2, 8) if b < T] + [T]


def _on_chosen_rows(x: jax.Array, rows: jax.Array, run) -> jax.Array:
    """run(x') [n, D] on only the rows of x [T, D] where `rows` [T] is true, scattered back to
    their places ([T, D]; the other rows' values are not meant to be read): the chosen rows
    are gathered in row order into the smallest bucket (row_buckets) that holds them, the
    bucket's other places filled with unchosen rows; none chosen runs nothing. The kernel
    gives a row the same bits at any row count (ffi), so a row's result does not depend on
    how many others chose the expert."""
    T, D = x.shape
    sizes = row_buckets(T)
    n = jnp.sum(rows.astype(jnp.int32))
    order = jnp.argsort(jnp.logical_not(rows), stable=True)   # the chosen rows first

    def bucket(size: int):
        def go(x):
            at = order[:size]
            return jnp.zeros((T, D), jnp.float32).at[at].set(run(jnp.take(x, at, axis=0)))
        return go

    which = jnp.where(n == 0, 0, 1 + jnp.sum(n > jnp.asarray(sizes)))
    return jax.lax.switch(which, [lambda x: jnp.zeros((T, D), jnp.float32)]
                          + [bucket(b) for b in sizes], x)
