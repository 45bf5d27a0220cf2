"""LFM2: a hybrid of short-convolution blocks and grouped-query attention blocks (with
RMS-normalized q and k), each followed by a SwiGLU feed-forward. A layer whose
`lfm2.attention.head_count_kv` entry is 0 is a convolution.

A convolution block: in_proj splits into b, c and x; the gated input b * x runs through a
depthwise causal convolution over the last `conv_width` tokens (lfm2.shortconv.l_cache: the
token and the ones before it; zeros before the sequence's start), the result is gated by c and
projected by out_proj. Its state is no recurrence: a token's output reads only the gated
inputs of the few tokens before it. So they are kept per position in the layer's pages of the
paged cache, like keys and values (runner.py), and read back by position: prefix reuse, page
eviction, batching and drafting need nothing more than they do for attention, and a row's
arithmetic (taps added oldest first, as llama.cpp's convolution adds them) never depends on
the other rows of its step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kinetic.model import qwen3
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.experts import moe_ffn
from kinetic.model.layers import (StepInput, input_rows, linear, linear_many, output_logits,
                                  residual_layers, rope_angles, swiglu_ffn, write_kv_pair)

GLOBAL_TENSORS = ("token_embd", "token_embd_norm")   # llama.cpp's name of LFM2's final norm
OPTIONAL_GLOBAL = ("output",)
NORMS = ("attn_norm", "ffn_norm")
DENSE = ("ffn_gate", "ffn_up", "ffn_down")
MOE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "exp_probs_b.bias")
CONV = ("shortconv.conv", "shortconv.in_proj", "shortconv.out_proj")
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output")


def moe_layer(cfg: Config, i: int) -> bool:
    """LFM2-MoE: every layer after the leading dense ones has a mixture of experts."""
    return cfg.n_expert > 0 and i >= cfg.n_dense_lead


def layer_tensors(cfg: Config, i: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (NORMS + (MOE if moe_layer(cfg, i) else DENSE)
            + (CONV if cfg.conv_layers[i] else ATTENTION)), ()


def configure(cfg: Config, meta: dict) -> Config:
    arch = cfg.arch   # lfm2, or lfm2moe (lfm2moe.py) with the same keys
    kv = meta.get(f"{arch}.attention.head_count_kv")
    per_layer = list(np.asarray(kv).reshape(-1)) if kv is not None else []
    if len(per_layer) == 1:
        per_layer *= cfg.n_layer
    if len(per_layer) != cfg.n_layer:
        raise ModelConfigError(f"{arch}.attention.head_count_kv has {len(per_layer)} entries for "
                               f"{cfg.n_layer} layers")
    width = meta.get(f"{arch}.shortconv.l_cache")
    if not isinstance(width, (int, np.integer)) or width < 1:
        raise ModelConfigError(f"the file has no positive {arch}.shortconv.l_cache (got "
                               f"{width!r})")
    return cfg.replace(rope_neox=True, conv_layers=tuple(int(v) == 0 for v in per_layer),
                       conv_width=int(width))


def short_conv(x: jax.Array, w: dict, cache: tuple[jax.Array, jax.Array], step: StepInput,
               cfg: Config):
    """The convolution block's output [T, D] for the normed x [T, D] (may be Pending:
    layers.linear's pending), and the layer's cache with the rows' gated inputs written at
    their positions."""
    D = cfg.d_model
    (bcx,) = linear_many(x, [w["shortconv.in_proj"]])   # (x may be a layers.Normed)
    b, c, xs = bcx[:, :D], bcx[:, D:2 * D], bcx[:, 2 * D:]
    bx = b * xs
    # written in place with the attention layers' pair writer (XLA's scatter copied the
    # whole array every step); the pair's second array is empty
    inputs, empty = write_kv_pair(cache, bx[:, None, :], jnp.zeros((x.shape[0], 1, 0)),
                                  step.write_index)
    flat = inputs.reshape(-1, D)
    page_size = inputs.shape[1]
    taps = w["shortconv.conv"]   # [D, width], the oldest token's tap first
    out = None
    for j in range(cfg.conv_width):
        back = cfg.conv_width - 1 - j
        if back == 0:
            v = bx
        else:   # the gated input `back` tokens before, read from the row's own pages
            pos = step.positions - back
            at = jnp.maximum(pos, 0)
            row = step.page_table[step.slots, at // page_size] * page_size + at % page_size
            v = jnp.where((pos >= 0)[:, None], jnp.take(flat, row, axis=0), 0.0)
        term = v * taps[:, j]
        out = term if out is None else out + term
    return linear(c * out, w["shortconv.out_proj"], pending=True), (inputs, empty)


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their rows written."""
    eps = cfg.norm_eps
    cos, sin = rope_angles(step.positions, cfg, cfg.rope_base)

    def mixer(i, h, w, layer_cache):
        if cfg.conv_layers[i]:
            with jax.named_scope("short_conv"):
                return short_conv(h, w, layer_cache, step, cfg)
        with jax.named_scope("attention"):
            return qwen3.attention(h, w, layer_cache, step, cfg, cos, sin)

    def ffn(i, h, w):
        return moe_ffn(h, w, cfg) if moe_layer(cfg, i) else swiglu_ffn(h, w, pending=True)
    # every mixer and feed-forward takes a layers.Normed (a GPU's decode step makes each
    # add and norm inside the projections after it)
    x, new_cache = residual_layers(input_rows(step, weights["token_embd"]), weights, cache,
                                   eps, mixer, ffn, take_normed=(True, True))
    return (output_logits(x, step, weights["token_embd_norm"], weights["output"], eps),
            new_cache)
