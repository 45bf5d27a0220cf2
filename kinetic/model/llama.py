"""Llama 2/3, SmolLM2, Mistral (and Mistral 3, mistral3.py): pre-norm blocks, GQA attention,
SwiGLU feed-forward. Llama 3's rope scaling comes as the rope_freqs tensor (frequency factors).

GGUF llama files store Q and K permuted for adjacent-pair rotary (llama.cpp's "normal" rope
mode), so rope rotates pairs (2i, 2i+1) here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kinetic.model.config import Config
from kinetic.model.layers import (StepInput, cached_attention, input_rows, linear, output_logits,
                                  residual_layers, rope_angles, rotated_qkv, swiglu_ffn)

GLOBAL_TENSORS = ("token_embd", "output_norm")
OPTIONAL_GLOBAL = ("output", "rope_freqs")
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
OPTIONAL_LAYER = ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias")


def configure(cfg: Config, meta: dict) -> Config:
    return cfg.replace(rope_neox=False)


def attention_block(x: jax.Array, w: dict, kv: tuple[jax.Array, jax.Array], step: StepInput,
                    cfg: Config, cos: jax.Array, sin: jax.Array, neox: bool):
    """Self-attention of one layer: returns (output [T, D], updated (k_cache, v_cache)); the
    output may be Pending (layers.linear's pending: it goes into the residual's add_norm)."""
    T = x.shape[0]
    # (on a GPU one launch, the cache written: k and v None; not under Mistral 3's
    # temperature, which scales q after its rotary)
    q, k, v, kv = rotated_qkv(x, w, cfg, kv, step, cos, sin, neox,
                              fuse=not cfg.attn_temp_scale)
    if cfg.attn_temp_scale:   # Mistral 3's attention temperature, growing with the position
        periods = jnp.floor(step.positions.astype(jnp.float32) / cfg.attn_temp_floor)
        q = q * (jnp.log(periods + 1.0) * cfg.attn_temp_scale + 1.0)[:, None, None]
    a, kv = cached_attention(q, k, v, kv, step, cfg.q_scale, cfg.kernel)  # [T, H, Qv]
    return linear(a.reshape(T, -1), w["attn_output"], w.get("attn_output.bias"),
                  pending=True), kv


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their K/V written."""
    x = input_rows(step, weights["token_embd"])  # [T, D]
    cos, sin = rope_angles(step.positions, cfg, cfg.rope_base, weights.get("rope_freqs"))

    def mixer(i, h, w, kv):
        with jax.named_scope("attention"):
            return attention_block(h, w, kv, step, cfg, cos, sin, cfg.rope_neox)
    x, new_cache = residual_layers(x, weights, cache, cfg.norm_eps, mixer,
                                   lambda i, h, w: swiglu_ffn(h, w, pending=True),
                                   take_normed=(True, True))
    return output_logits(x, step, weights["output_norm"], weights["output"], cfg.norm_eps), new_cache
