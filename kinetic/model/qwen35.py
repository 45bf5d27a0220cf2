"""Qwen3.5: a hybrid of gated delta-rule layers (linear attention, kinetic/model/delta_net.py)
and gated full-attention layers, each followed by a SwiGLU feed-forward (Qwen3.5-MoE:
qwen35moe.py, a mixture of experts and a gated shared expert).

Layer i is full attention where `qwen35.full_attention_interval` divides i + 1 (llama.cpp's
rule; 4 when the key is absent), else a delta-rule layer. A full-attention layer projects
each head's query together with a gate of the same width (interleaved per head), RMS-normalizes
q and k per head, rotates the first rope.dimension_count features of each (Qwen3.5's
multi-axis rotary reduces to that for text, every axis at the token's position), and
multiplies the attention's output by the gate's sigmoid before the output projection.
A file's multi-token-prediction blocks (`nextn_predict_layers`, after the decoder's) are
read past: kinetic drafts by n-gram lookup or a draft model instead.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import numpy as np

from kinetic.model.config import Config, ModelConfigError
from kinetic.model.delta_net import conv_channels, delta_net_layer
from kinetic.model.layers import (StepInput, apply_rope, cached_attention, input_rows, linear,
                                  linear_many, output_logits, residual_layers, rms_norm,
                                  rope_angles, rope_write, swiglu_ffn)

GLOBAL_TENSORS = ("token_embd", "output_norm")
OPTIONAL_GLOBAL = ("output",)
NORMS = ("attn_norm", "post_attention_norm")
DENSE = ("ffn_gate", "ffn_up", "ffn_down")
ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output")
DELTA = ("attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_beta",
         "ssm_alpha", "ssm_norm", "ssm_out")


def layer_tensors(cfg: Config, i: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return NORMS + DENSE + (DELTA if cfg.recurrent_layers[i] else ATTENTION), ()


def tensor_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """The shapes that are Qwen3.5's own: the query projection carries a gate per head, and
    the delta-rule layers' tensors."""
    D, H, d = cfg.d_model, cfg.ssm_v_heads, cfg.ssm_state
    return {"attn_q": (2 * cfg.n_head * cfg.head_dim, D),
            "attn_qkv": (conv_channels(cfg), D), "attn_gate": (H * d, D),
            "ssm_conv1d": (conv_channels(cfg), cfg.ssm_conv), "ssm_dt": (H,), "ssm_a": (H,),
            "ssm_beta": (H, D), "ssm_alpha": (H, D), "ssm_norm": (d,), "ssm_out": (D, H * d),
            "ffn_gate_inp_shexp": (D,), "ffn_gate_shexp": (cfg.d_ffn_shared, D),
            "ffn_up_shexp": (cfg.d_ffn_shared, D), "ffn_down_shexp": (D, cfg.d_ffn_shared)}


def configure(cfg: Config, meta: dict) -> Config:
    arch = cfg.arch   # qwen35, or qwen35moe (qwen35moe.py) with the same keys

    def key(name: str, default=None) -> int:
        value = meta.get(f"{arch}.{name}", default)
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ModelConfigError(f"the file has no positive {arch}.{name} (got {value!r})")
        return int(value)
    interval = key("full_attention_interval", 4)
    # the multi-token-prediction blocks (draft heads) follow the decoder's: not run here
    mtp = int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    if not 0 <= mtp < cfg.n_layer:
        raise ModelConfigError(f"{arch}.nextn_predict_layers is {mtp} of {cfg.n_layer} blocks")
    n_layer = cfg.n_layer - mtp
    recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    cfg = cfg.replace(n_layer=n_layer, n_layer_unused=mtp, sliding_layers=(False,) * n_layer,
                      rope_neox=True, recurrent_layers=recurrent, ssm_conv=key("ssm.conv_kernel"),
                      ssm_state=key("ssm.state_size"), ssm_k_heads=key("ssm.group_count"),
                      ssm_v_heads=key("ssm.time_step_rank"))
    if cfg.ssm_v_heads % cfg.ssm_k_heads:
        raise ModelConfigError(f"{arch}.ssm.time_step_rank {cfg.ssm_v_heads} (value heads) is "
                               f"not a multiple of ssm.group_count {cfg.ssm_k_heads} (key heads)")
    inner = key("ssm.inner_size")
    if inner != cfg.ssm_v_heads * cfg.ssm_state:
        raise ModelConfigError(f"{arch}.ssm.inner_size {inner} is not ssm.time_step_rank x "
                               f"ssm.state_size ({cfg.ssm_v_heads} x {cfg.ssm_state})")
    return cfg


def attention(x: jax.Array, w: dict, kv: tuple[jax.Array, jax.Array], step: StepInput,
              cfg: Config, cos: jax.Array, sin: jax.Array):
    """A gated full-attention layer: (output [T, D], updated (k_cache, v_cache)); the output
    may be Pending (layers.linear's pending)."""
    T, H, Q, eps = x.shape[0], cfg.n_head, cfg.head_dim, cfg.norm_eps
    # on a GPU one launch: q's and k's head norms, the (partial) rotary, the cache writes
    fused = rope_write(x, w, cfg, kv, step, cos, sin, True, head_norms=True, q_gated=True)
    if fused is not None:   # and the output gate inside the attention's launch
        q, kv, gate = fused
        a, kv = cached_attention(q, None, None, kv, step, cfg.q_scale, cfg.kernel, gate=gate)
        return linear(a.reshape(T, -1), w["attn_output"], pending=True), kv
    qg, k, v = linear_many(x, [w["attn_q"], w["attn_k"], w["attn_v"]])
    qg = qg.reshape(T, H, 2, Q)
    q, gate = qg[:, :, 0], qg[:, :, 1].reshape(T, H * Q)
    q = apply_rope(rms_norm(q, w["attn_q_norm"], eps), cos, sin, True)
    k = apply_rope(rms_norm(k.reshape(T, cfg.n_kv_head, Q), w["attn_k_norm"], eps), cos, sin,
                   True)
    a, kv = cached_attention(q, k, v.reshape(T, cfg.n_kv_head, cfg.v_head_dim), kv, step,
                             cfg.q_scale, cfg.kernel)
    return linear(a.reshape(T, -1) * jax.nn.sigmoid(gate), w["attn_output"], pending=True), kv


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their rows written."""
    return decoder(weights, cfg, cache, step, partial(swiglu_ffn, pending=True), True)


def decoder(weights: dict, cfg: Config, cache: list, step: StepInput,
            ffn: Callable[[jax.Array, dict], jax.Array], ffn_takes_normed: bool = False):
    """Qwen3.5's layers with `ffn(normed x, layer weights)` as the feed-forward block
    (ffn_takes_normed: whether it takes a layers.Normed; the mixers, delta rule and gated
    attention, do)."""
    eps = cfg.norm_eps
    cos, sin = rope_angles(step.positions, cfg, cfg.rope_base)

    def mixer(i, h, w, layer_cache):
        if cfg.recurrent_layers[i]:
            with jax.named_scope("delta_net"):
                return delta_net_layer(h, w, layer_cache, step.recur, cfg)
        with jax.named_scope("attention"):
            return attention(h, w, layer_cache, step, cfg, cos, sin)
    x, new_cache = residual_layers(input_rows(step, weights["token_embd"]), weights, cache,
                                   eps, mixer, lambda i, h, w: ffn(h, w),
                                   ffn_norm="post_attention_norm",
                                   take_normed=(True, ffn_takes_normed))
    return output_logits(x, step, weights["output_norm"], weights["output"], eps), new_cache


def shared_expert(x: jax.Array, w: dict) -> jax.Array:
    """Qwen3.5-MoE's shared expert: a SwiGLU scaled by the sigmoid of its own gate [T, 1]."""
    gate, up, scale = linear_many(x, [w["ffn_gate_shexp"], w["ffn_up_shexp"],
                                      w["ffn_gate_inp_shexp"]])
    return linear(jax.nn.silu(gate) * up, w["ffn_down_shexp"]) * jax.nn.sigmoid(scale)

