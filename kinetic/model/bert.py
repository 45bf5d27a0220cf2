"""BERT encoders (all-MiniLM, bge, cross-encoders): learned absolute positions, token types,
post-norm blocks (layer norm after each residual), a GELU feed-forward with biases (GELU
rounded through half floats as llama.cpp's table gives it), and
attention over the whole text, both ways.

A text runs as one sequence of the paged step like a decoder's prompt: each row's K/V is
written to the text's pages, then each row attends to every key of its text (not only the
keys before it). The forward returns the last block's output [T, D], which the encoder
pools (kinetic/engine/encoder.py). As llama.cpp does, every token takes token type 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kinetic.kernels import ffi as native
from kinetic.model import layers
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.layers import (StepInput, cached_attention, embed, gelu_tanh, linear, qkv)

GLOBAL_TENSORS = ("token_embd", "position_embd", "token_embd_norm", "token_embd_norm.bias")
OPTIONAL_GLOBAL = ("token_types",)
LAYER_TENSORS = ("attn_q", "attn_q.bias", "attn_k", "attn_k.bias", "attn_v", "attn_v.bias",
                 "attn_output", "attn_output.bias", "attn_output_norm", "attn_output_norm.bias",
                 "ffn_up", "ffn_up.bias", "ffn_down", "ffn_down.bias",
                 "layer_output_norm", "layer_output_norm.bias")
OPTIONAL_LAYER = ()


def configure(cfg: Config, meta: dict) -> Config:
    eps = meta.get("bert.attention.layer_norm_epsilon")
    if eps is None:
        raise ModelConfigError("the file has no bert.attention.layer_norm_epsilon key")
    if meta.get("bert.attention.causal", False):
        raise ModelConfigError("a causal BERT is not supported")
    # no rotary: rope_dim only has to satisfy Config's check
    return cfg.replace(norm_eps=float(eps), rope_dim=0, causal=False,
                       pooling=cfg.pooling or "none")


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * w + b per row: in C++ where the kernels run and as a
    Pallas kernel on a GPU (a row's bits the same at any row count: layers.rms_norm says
    why), else XLA's."""
    if native.usable():
        return native.layer_norm(x, w, b, eps)
    if layers.pallas_norms():
        from kinetic.kernels import pallas_norm
        return pallas_norm.layer_norm(x, w, b, eps)
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    c = x - mean
    return c * jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps) * w + b


def gelu(x: jax.Array) -> jax.Array:
    """GELU as llama.cpp's CPU backend computes it (a table of half floats): the tanh form
    at x rounded to half, the result rounded to half; x itself from 10 up, 0 from -10 down."""
    half = x.astype(jnp.float16).astype(jnp.float32)
    y = gelu_tanh(half).astype(jnp.float16).astype(jnp.float32)
    return jnp.where(x >= 10.0, x, jnp.where(x <= -10.0, 0.0, y))


def text_ends(step: StepInput) -> jax.Array:
    """Each row's last key: the last position of its text (the largest position among its
    slot's rows: a text runs whole in one step). Padding rows sit at position 0."""
    S = step.page_table.shape[0]
    last = jax.ops.segment_max(step.positions, step.slots, num_segments=S)
    return last[step.slots]


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """The last block's output [T, D] for the step's rows (every row), and the cache with
    their K/V written."""
    T, eps = step.tokens.shape[0], cfg.norm_eps
    x = embed(step.tokens, weights["token_embd"])
    x = x + embed(step.positions, weights["position_embd"])
    if "token_types" in weights:
        x = x + embed(jnp.zeros_like(step.tokens), weights["token_types"])
    x = layer_norm(x, weights["token_embd_norm"], weights["token_embd_norm.bias"], eps)
    # every row sees its whole text: its own position, the text's last as its end (so a
    # text's rows stay consecutive and share their key work in the kernel)
    ends = text_ends(step)
    new_cache = []
    for w, kv in zip(weights["blk"], cache):
        with jax.named_scope("attention"):
            q, k, v = qkv(x, w, cfg)
            a, (k_cache, v_cache) = cached_attention(q, k, v, kv, step, cfg.q_scale, cfg.kernel,
                                                     ends=ends)
            a = linear(a.reshape(T, -1), w["attn_output"], w["attn_output.bias"])
            x = layer_norm(x + a, w["attn_output_norm"], w["attn_output_norm.bias"], eps)
        with jax.named_scope("ffn"):
            h = gelu(linear(x, w["ffn_up"], w["ffn_up.bias"]))
            h = linear(h, w["ffn_down"], w["ffn_down.bias"])
            x = layer_norm(x + h, w["layer_output_norm"], w["layer_output_norm.bias"], eps)
        new_cache.append((k_cache, v_cache))
    return x, new_cache
