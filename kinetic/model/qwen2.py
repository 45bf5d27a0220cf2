"""Qwen2 / Qwen2.5: the llama block with biases on Q, K and V and half-split (NEOX) rotary."""

from __future__ import annotations

from kinetic.model.config import Config
from kinetic.model.llama import (GLOBAL_TENSORS, OPTIONAL_GLOBAL, OPTIONAL_LAYER, forward)

LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q.bias", "attn_k.bias",
                 "attn_v.bias", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")

__all__ = ["GLOBAL_TENSORS", "OPTIONAL_GLOBAL", "LAYER_TENSORS", "OPTIONAL_LAYER", "configure",
           "forward"]


def configure(cfg: Config, meta: dict) -> Config:
    return cfg.replace(rope_neox=True)
