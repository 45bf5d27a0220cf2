"""Qwen3: no QKV biases; each head's q and k are RMS-normalized before the rotary."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax

from kinetic.model.config import Config
from kinetic.model.layers import (StepInput, cached_attention, input_rows, linear, output_logits,
                                  residual_layers, rope_angles, rotated_qkv, swiglu_ffn)

GLOBAL_TENSORS = ("token_embd", "output_norm")
OPTIONAL_GLOBAL = ("output",)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                 "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL_LAYER = ()


def configure(cfg: Config, meta: dict) -> Config:
    return cfg.replace(rope_neox=True)


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their K/V written."""
    return decoder(weights, cfg, cache, step, partial(swiglu_ffn, pending=True), True)


def decoder(weights: dict, cfg: Config, cache: list, step: StepInput,
            ffn: Callable[[jax.Array, dict], jax.Array], ffn_takes_normed: bool = False):
    """Qwen3's layers with `ffn(normed x, layer weights)` as the feed-forward block (a dense
    SwiGLU, or Qwen3-MoE's mixture of experts; ffn_takes_normed: whether it takes a
    layers.Normed, as swiglu_ffn does)."""
    eps = cfg.norm_eps
    cos, sin = rope_angles(step.positions, cfg, cfg.rope_base)

    def mixer(i, h, w, kv):
        with jax.named_scope("attention"):
            return attention(h, w, kv, step, cfg, cos, sin)
    x, new_cache = residual_layers(input_rows(step, weights["token_embd"]), weights, cache,
                                   eps, mixer, lambda i, h, w: ffn(h, w),
                                   take_normed=(True, ffn_takes_normed))
    return output_logits(x, step, weights["output_norm"], weights["output"], eps), new_cache


def attention(x: jax.Array, w: dict, kv: tuple[jax.Array, jax.Array], step: StepInput,
              cfg: Config, cos: jax.Array, sin: jax.Array):
    """Self-attention of one layer with each head's q and k RMS-normalized before the
    half-split rotary (Qwen3's, and LFM2's attention layers): (output [T, D], updated
    (k_cache, v_cache)); the output may be Pending (layers.linear's pending)."""
    T = x.shape[0]
    q, k, v, kv = rotated_qkv(x, w, cfg, kv, step, cos, sin, True, head_norms=True)
    a, kv = cached_attention(q, k, v, kv, step, cfg.q_scale, cfg.kernel)
    return linear(a.reshape(T, -1), w["attn_output"], pending=True), kv
