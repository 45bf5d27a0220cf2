"""Qwen3.5-MoE: Qwen3.5's hybrid layers (qwen35.py), with a mixture of SwiGLU experts (the
chosen experts' weights renormalized, kinetic/model/experts.py) plus a gated shared expert in
place of the dense feed-forward."""

from __future__ import annotations

from kinetic.model import qwen35
from kinetic.model.config import Config
from kinetic.model.experts import moe_ffn
from kinetic.model.layers import StepInput

GLOBAL_TENSORS = qwen35.GLOBAL_TENSORS
OPTIONAL_GLOBAL = qwen35.OPTIONAL_GLOBAL
MOE = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
       "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
tensor_shapes = qwen35.tensor_shapes


def layer_tensors(cfg: Config, i: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    mixer = qwen35.DELTA if cfg.recurrent_layers[i] else qwen35.ATTENTION
    return qwen35.NORMS + MOE + mixer, ()


def configure(cfg: Config, meta: dict) -> Config:
    cfg = qwen35.configure(cfg, meta).with_experts(meta, norm=True)
    shared = meta.get(f"{cfg.arch}.expert_shared_feed_forward_length")
    return cfg.replace(d_ffn_shared=int(shared) if shared else cfg.d_ffn_expert)


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their rows written."""
    # (the feed-forward takes a layers.Normed: the mixture's router makes its add and norm
    # and writes the normed rows, which the shared expert then reads)
    return qwen35.decoder(weights, cfg, cache, step,
                          lambda x, w: moe_ffn(x, w, cfg) + qwen35.shared_expert(x, w), True)
