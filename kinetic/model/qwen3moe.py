"""Qwen3-MoE: Qwen3's attention, and a mixture of SwiGLU experts in place of its FFN, the
chosen experts' weights renormalized (kinetic/model/experts.py)."""

from __future__ import annotations

from kinetic.model import qwen3
from kinetic.model.config import Config
from kinetic.model.experts import moe_ffn
from kinetic.model.layers import StepInput

GLOBAL_TENSORS = qwen3.GLOBAL_TENSORS
OPTIONAL_GLOBAL = qwen3.OPTIONAL_GLOBAL
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                 "attn_output", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                 "ffn_down_exps")
OPTIONAL_LAYER = ()


def configure(cfg: Config, meta: dict) -> Config:
    return qwen3.configure(cfg, meta).with_experts(meta, norm=True)


def forward(weights: dict, cfg: Config, cache: list, step: StepInput):
    """Logits [T, V] for the step's rows, and the cache with their K/V written."""
    # (the mixture takes its input as a layers.Normed: on a GPU's decode step the router's
    # launch makes the add and the norm before it)
    return qwen3.decoder(weights, cfg, cache, step, lambda x, w: moe_ffn(x, w, cfg), True)
