"""A mixture's routing as one Pallas kernel (model/experts.py `moe_ffn` on the pallas kernel's
experts: a GPU's).

    chosen, weights = route(parts, T, n_expert, n_used, gating, normalize, bias)

From the router's partial sums over the chunks of its K (pallas_matmul's partials, [C, >= T,
>= E]), each row's logits (the partial sums added in order, as pallas_matmul.summed adds
them), its probabilities (a softmax over the E experts, or each one's sigmoid), the n_used
most probable experts (`bias` [E], LFM2-MoE's, shifting the choice, not the weights; ties to
the lower index), their probabilities as weights, rescaled to sum to 1 where `normalize`
says (the sum clamped from below at 2^-14, as llama.cpp's). experts.route's meaning; XLA
ran it as three kernels a layer at one row (the softmax's division, top_k and a slice of
it: bench/gpu_compile.py), besides the router's sum; here it is one.

One program a row, its experts one block of the next power of 2 (those past E masked off):
a row's arithmetic is its own alone, the same code whatever the rows beside it, so its
choice and its weights do not depend on the step's rows. The choice is n_used passes of a
maximum and the first expert holding it (exact in any order), each taken out before the
next; a weight is its expert's probability, picked out exactly. The softmax's sum is a
reduction over the block (its order Triton's, or XLA's interpreted), so the weights are not
experts.route's bits, only the same meaning (tests/test_pallas_route.py: the same
experts, the weights within float32 rounding; a row's bits alone and beside others the
same). Interpreted wherever JAX's backend is not a GPU (kernels/pallas_backend.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend

GATINGS = ("softmax", "sigmoid")
NORM_FLOOR = 6.103515625e-5    # 2^-14: the least sum of the chosen weights divided by


def route(parts: jax.Array, T: int, n_expert: int, n_used: int, gating: str = "softmax",
          normalize: bool = False, bias: jax.Array | None = None,
          interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(the chosen experts [T, n_used] int32, most probable first; their weights [T, n_used]
    float32) of the first T rows of the router's partial sums parts [C, >= T, >= n_expert]
    (module docstring)."""
    if gating not in GATINGS:
        raise ValueError(f"route: gating {gating!r} is not one of {GATINGS}")
    if not 0 < n_used <= n_expert:
        raise ValueError(f"route: {n_used} experts a row of {n_expert}")
    bias = None if bias is None else jnp.asarray(bias, jnp.float32).reshape(1, n_expert)
    return _route(parts.astype(jnp.float32), bias, T, n_expert, n_used, gating,
                  bool(normalize), pallas_backend.interpreted(interpret))


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5, 6, 7))
def _route(parts, bias, T: int, E: int, K: int, gating: str, normalize: bool,
           interpret: bool):
    Ep = 1 << max(E - 1, 0).bit_length()   # the block: E's next power of 2

    def kernel(*refs):
        parts_ref, bias_ref = refs[0], (refs[1] if bias is not None else None)
        chosen_ref, weights_ref = refs[-2:]
        t = pl.program_id(0)
        cols = lax.broadcasted_iota(jnp.int32, (1, Ep), 1)
        live = cols < E
        logits = pallas_backend.load_sum(parts_ref, (pl.ds(t, 1), pl.ds(0, Ep)), live)
        if gating == "sigmoid":
            probs = jax.nn.sigmoid(logits)
        else:
            x = jnp.where(live, logits, -jnp.inf)
            exps = jnp.exp(x - jnp.max(x, axis=1, keepdims=True))
            probs = exps / jnp.sum(exps, axis=1, keepdims=True)
        choose = probs
        if bias_ref is not None:
            choose = choose + pltriton.load(bias_ref.at[pl.ds(0, 1), pl.ds(0, Ep)],
                                            mask=live, other=0.0)
        choose = jnp.where(live, choose, -jnp.inf)
        weights = []
        for k in range(K):
            best = jnp.max(choose, axis=1, keepdims=True)
            # the first expert holding it (none, where a NaN hides it: the last, in range)
            first = jnp.minimum(jnp.min(jnp.where(choose == best, cols, Ep), axis=1,
                                        keepdims=True), E - 1)
            weights.append(jnp.sum(jnp.where(cols == first, probs, 0.0), axis=1,
                                   keepdims=True))
            choose = jnp.where(cols == first, -jnp.inf, choose)
            chosen_ref[pl.ds(t, 1), pl.ds(k, 1)] = first
        if normalize:   # their sum in choice order, as experts.route adds it
            total = weights[0]
            for w in weights[1:]:
                total = total + w
            weights = [w / jnp.maximum(total, NORM_FLOOR) for w in weights]
        for k, w in enumerate(weights):
            weights_ref[pl.ds(t, 1), pl.ds(k, 1)] = w

    def whole(a):
        return pl.BlockSpec(a.shape, lambda t, n=a.ndim: (0,) * n)
    arrays = [parts] + ([bias] if bias is not None else [])
    out_shape = [jax.ShapeDtypeStruct((T, K), jnp.int32),
                 jax.ShapeDtypeStruct((T, K), jnp.float32)]
    return tuple(pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(T,),
        in_specs=[whole(a) for a in arrays],
        out_specs=[whole(o) for o in out_shape],
        **pallas_backend.options(interpret, num_warps=1),
    )(*arrays))
