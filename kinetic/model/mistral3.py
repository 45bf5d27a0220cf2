"""Mistral 3 (Ministral 3, Mistral Small 3.x as converted with architecture "mistral3"):
Llama's layers, with YaRN rope scaling whose magnitude correction is cancelled (cos and sin
keep their length, as llama.cpp's mistral3 graph sets its attention factor) and, where the
file gives `mistral3.attention.temperature_scale`, an attention temperature that grows with
the position in steps of the original context (llama.py applies it)."""

from __future__ import annotations

import math

from kinetic.model import llama
from kinetic.model.config import Config, ModelConfigError

GLOBAL_TENSORS = llama.GLOBAL_TENSORS
OPTIONAL_GLOBAL = llama.OPTIONAL_GLOBAL
LAYER_TENSORS = llama.LAYER_TENSORS
OPTIONAL_LAYER = llama.OPTIONAL_LAYER
forward = llama.forward


def configure(cfg: Config, meta: dict) -> Config:
    cfg = llama.configure(cfg, meta)
    cfg = cfg.replace(rope_attn_factor=1.0 / (1.0 + 0.1 * math.log(1.0 / cfg.rope_freq_scale)))
    scale = float(meta.get("mistral3.attention.temperature_scale", 0.0) or 0.0)
    if scale:
        if cfg.rope_orig_ctx <= 0:
            raise ModelConfigError("mistral3.attention.temperature_scale needs a positive "
                                   "rope.scaling.original_context_length")
        cfg = cfg.replace(attn_temp_scale=scale, attn_temp_floor=cfg.rope_orig_ctx)
    return cfg
