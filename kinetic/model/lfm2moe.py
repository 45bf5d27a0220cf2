"""LFM2-MoE (LFM2-8B-A1B): LFM2's convolution and attention layers, with a mixture of SwiGLU
experts after the leading dense layers: sigmoid router probabilities, the choice shifted by a
per-expert bias (exp_probs_b), the chosen weights renormalized (kinetic/model/experts.py)."""

from __future__ import annotations

from kinetic.model import lfm2
from kinetic.model.config import Config

GLOBAL_TENSORS = lfm2.GLOBAL_TENSORS
OPTIONAL_GLOBAL = lfm2.OPTIONAL_GLOBAL
layer_tensors = lfm2.layer_tensors
forward = lfm2.forward


def configure(cfg: Config, meta: dict) -> Config:
    return lfm2.configure(cfg, meta).with_experts(meta, norm=True)
