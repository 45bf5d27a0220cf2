"""Gemma 3: sliding-window layers (5 of every 6) with their own rotary base, RMS-normalized
q and k, norms before and after both attention and feed-forward, a GELU-gated feed-forward,
embeddings scaled by sqrt(d_model) and the output tied to the embeddings.

GGUF gemma files already hold the norm weights as (1 + w), so rms_norm applies them as is.
"""

from __future__ import annotations

import math

import jax

from kinetic.model.config import Config
from kinetic.model.layers import (StepInput, add_and_norm, cached_attention, geglu_ffn,
                                  input_rows, linear, norms_in_matmul, output_logits,
                                  residual, rms_norm, rope_angles, rotated_qkv, value)

GLOBAL_TENSORS = ("token_embd", "output_norm")
OPTIONAL_GLOBAL = ("output",)
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                 "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down", "post_ffw_norm")
OPTIONAL_LAYER = ()


def configure(cfg: Config, meta: dict) -> Config:
    pattern = int(meta.get("gemma3.attention.sliding_window_pattern", 6) or 6)
    window = int(meta.get("gemma3.attention.sliding_window", 0) or 0)
    # Every pattern-th layer is global; the others see only the last `window` positions.
    sliding = tuple(window > 0 and (i + 1) % pattern != 0 for i in range(cfg.n_layer))
    return cfg.replace(
        rope_neox=True,
        sliding_window=window,
        sliding_layers=sliding,
        rope_base_local=float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        embed_scale=math.sqrt(cfg.d_model),
        attn_scale=1.0 / math.sqrt(cfg.head_dim),
    )


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their K/V written."""
    T, eps = step.tokens.shape[0], cfg.norm_eps
    x = input_rows(step, weights["token_embd"], cfg.embed_scale)  # [T, D]
    rope_global = rope_angles(step.positions, cfg, cfg.rope_base)
    rope_local = rope_angles(step.positions, cfg.replace(rope_freq_scale=1.0),
                             cfg.rope_base_local or cfg.rope_base)
    new_cache, blocks = [], weights["blk"]
    # a decode step's norms inside the projections after them (layers.Normed; its post: the
    # norm after the projection before the add), else one launch each (post_add_norm)
    fused = norms_in_matmul(T)

    def normed(x, y, w_post, w):
        """(x + rms_norm(y, w_post) or None, its norm or a Normed of it)."""
        return add_and_norm(x, y, w, eps, fused, w_post)
    if blocks:
        x, h = normed(x, None, None, blocks[0]["attn_norm"])
    for i, (w, (k_cache, v_cache), sliding) in enumerate(zip(blocks, cache,
                                                             cfg.sliding_layers)):
        cos, sin = rope_local if sliding else rope_global
        with jax.named_scope("attention"):
            q, k, v, kv = rotated_qkv(h, w, cfg, (k_cache, v_cache), step, cos, sin, True,
                                      head_norms=True)
            x = residual(x, h)
            a, (k_cache, v_cache) = cached_attention(
                q, k, v, kv, step, cfg.q_scale, cfg.kernel,
                window=cfg.sliding_window if sliding else 0,
                ends=step.attend_end)   # an image's rows see each other
            a = linear(a.reshape(T, -1), w["attn_output"], pending=True)
            # x + post_attention_norm(a), and the ffn's norm of it: one launch on a GPU
            # (in gate's and up's in a decode step)
            x, h = normed(x, a, w["post_attention_norm"], w["ffn_norm"])
        with jax.named_scope("ffn"):
            f = geglu_ffn(h, w, pending=True)
            x = residual(x, h)
            if i + 1 < len(blocks):
                x, h = normed(x, f, w["post_ffw_norm"], blocks[i + 1]["attn_norm"])
            else:
                x = x + rms_norm(value(f), w["post_ffw_norm"], eps)
        new_cache.append((k_cache, v_cache))
    return output_logits(x, step, weights["output_norm"], weights["output"], eps), new_cache
