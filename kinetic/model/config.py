"""The frozen model configuration, read from GGUF metadata.

One `Config` serves every architecture; each architecture module fills in what is its own
(`configure(cfg, metadata)`), so that this file holds only the keys all of them share.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from dataclasses import dataclass
from typing import Any


class ModelConfigError(ValueError):
    """The GGUF metadata does not describe a model we can run; the message says what is missing."""


@dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int            # per-head width of q and k (GGUF key_length)
    v_head_dim: int          # per-head width of v (GGUF value_length)
    d_ffn: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int            # rotated width per head (partial rotary when < head_dim)
    rope_neox: bool          # rotate halves (NEOX) rather than adjacent pairs (GPT-J / llama)
    rope_base_local: float = 0.0          # sliding-window layers' rope base (gemma3), 0 = same
    rope_freq_scale: float = 1.0          # positions are multiplied by this (linear scaling,
                                          # and YaRN's interpolated part)
    rope_yarn: bool = False               # YaRN: low frequencies interpolated, high ones kept
    rope_orig_ctx: int = 0                # the context the model was trained at (YaRN's,
                                          # and Mistral 3's temperature period)
    yarn_beta_fast: float = 32.0          # YaRN: the ramp between kept and interpolated
    yarn_beta_slow: float = 1.0           #   frequencies, in rotations over rope_orig_ctx
    rope_attn_factor: float = 1.0         # YaRN: cos and sin are scaled by this times
                                          # 1 + 0.1 ln(1 / rope_freq_scale)
    attn_temp_scale: float = 0.0          # Llama 4 / Mistral 3 attention temperature: q is
    attn_temp_floor: int = 0              # scaled by 1 + s ln(1 + floor(pos / floor)); 0 none
    attn_scale: float = 0.0               # multiplier on q.k; 0 means 1/sqrt(head_dim)
    sliding_window: int = 0               # 0 = none
    sliding_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    embed_scale: float = 1.0              # token embeddings multiplied by this (gemma: sqrt(d))
    tied_output: bool = False             # output projection is token_embd
    final_softcap: float = 0.0            # 0 = none
    kernel: str = "xla"                   # "ffi": weights in GGUF blocks through kinetic's
                                          # C++ kernels; "xla": dense weights (weights.py)
    pooling: str = ""                     # "" (a text model) or how an embedding or ranking
                                          # model pools a text: POOLING's names
    causal: bool = True                   # False: each token attends to its whole text
    n_cls: int = 0                        # outputs of the ranking head (cls.output), 0: none
    n_token_types: int = 0                # rows of token_types (BERT), 0: none
    conv_layers: tuple[bool, ...] = ()    # per layer: a short convolution instead of
                                          # attention (LFM2); empty: none
    conv_width: int = 0                   # the convolution's taps (tokens it reads)
    n_expert: int = 0                     # mixture of experts: experts per layer, 0: dense
    n_expert_used: int = 0                # experts each token is routed to
    d_ffn_expert: int = 0                 # one expert's feed-forward width
    expert_weights_norm: bool = False     # the chosen experts' weights rescaled to sum to 1
    expert_gating: str = "softmax"        # the router's probabilities: "softmax" or "sigmoid"
    n_dense_lead: int = 0                 # leading layers with a dense feed-forward
    d_ffn_shared: int = 0                 # the shared expert's width (Qwen3.5-MoE), 0: none
    n_layer_unused: int = 0               # trailing blocks the file holds that kinetic does
                                          # not run (Qwen3.5's multi-token prediction)
    recurrent_layers: tuple[bool, ...] = ()  # per layer: a gated delta-rule layer whose
                                          # state is a recurrence (Qwen3.5); empty: none
    ssm_conv: int = 0                     # delta-rule layers: the convolution's taps,
    ssm_state: int = 0                    #   each head's key (= value) width,
    ssm_k_heads: int = 0                  #   key heads and
    ssm_v_heads: int = 0                  #   value heads (a multiple of the key heads)

    @property
    def recurrent(self) -> bool:
        """Whether some layer keeps a per-sequence recurrent state (runner.py)."""
        return any(self.recurrent_layers)

    @property
    def task(self) -> str:
        """What the model serves: "text" (generation), "embedding" or "rerank"."""
        return "text" if not self.pooling else "rerank" if self.pooling == "rank" else "embedding"

    def __post_init__(self) -> None:
        if self.n_head % max(self.n_kv_head, 1):
            raise ModelConfigError(
                f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_kv_head}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ModelConfigError(f"rope dimension {self.rope_dim} does not fit head size "
                                   f"{self.head_dim}")

    @property
    def q_scale(self) -> float:
        return self.attn_scale or 1.0 / math.sqrt(self.head_dim)

    def with_experts(self, meta: dict[str, Any], norm: bool) -> "Config":
        """This config with `{arch}.expert_count`, `.expert_used_count` and
        `.expert_feed_forward_length` read (a mixture-of-experts model); `norm`: the
        architecture renormalizes the chosen experts' weights."""
        def key(name: str) -> int:
            value = meta.get(f"{self.arch}.{name}")
            if not isinstance(value, (int, np.integer)) or value <= 0:
                raise ModelConfigError(f"the file has no positive {self.arch}.{name} key "
                                       f"(got {value!r})")
            return int(value)
        n_expert, used = key("expert_count"), key("expert_used_count")
        if used > n_expert:
            raise ModelConfigError(f"{self.arch}.expert_used_count {used} is more than "
                                   f"expert_count {n_expert}")
        gating = {None: "softmax", 1: "softmax", 2: "sigmoid"}.get(
            meta.get(f"{self.arch}.expert_gating_func"))
        if gating is None:
            raise ModelConfigError(f"{self.arch}.expert_gating_func is "
                                   f"{meta.get(f'{self.arch}.expert_gating_func')!r}; kinetic "
                                   f"knows 1 (softmax) and 2 (sigmoid)")
        return self.replace(n_expert=n_expert, n_expert_used=used,
                            d_ffn_expert=key("expert_feed_forward_length"),
                            expert_weights_norm=norm, expert_gating=gating,
                            n_dense_lead=int(meta.get(f"{self.arch}.leading_dense_block_count",
                                                      0)))

    def replace(self, **changes: Any) -> "Config":
        return dataclasses.replace(self, **changes)


# GGUF's {arch}.pooling_type values (llama.cpp's enum), by name
POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


def pooling_type(arch: str, meta: dict[str, Any]) -> str:
    """The pooling the file asks for ("" when it has no {arch}.pooling_type: a text model)."""
    value = meta.get(f"{arch}.pooling_type")
    if value is None:
        return ""
    try:
        return POOLING[int(value)]
    except (KeyError, TypeError, ValueError):
        raise ModelConfigError(f"{arch}.pooling_type is {value!r}; kinetic knows "
                               f"{', '.join(f'{k} ({v})' for k, v in POOLING.items())}") from None


def base_config(arch: str, meta: dict[str, Any], vocab_size: int) -> Config:
    """The shared part of the config: `{arch}.block_count`, `.embedding_length` and so on."""

    def key(name: str, default: Any = None, kind: type = int) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelConfigError(f"the file has no {arch}.{name} key")
        if isinstance(value, (list, np.ndarray)) and len(value):
            # a per-layer array: its first non-zero value (a hybrid's layers without
            # attention have 0 heads; the architecture reads the array itself)
            value = next((v for v in value if v), value[0])
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise ModelConfigError(f"{arch}.{name} is {value!r}, not a number") from None
        if kind is int and value <= 0:
            raise ModelConfigError(f"{arch}.{name} is {value}; it must be positive")
        return value

    n_head = key("attention.head_count")
    d_model = key("embedding_length")
    head_dim = key("attention.key_length", d_model // n_head)
    n_layer = key("block_count")
    return Config(
        arch=arch,
        n_layer=n_layer,
        d_model=d_model,
        n_head=n_head,
        n_kv_head=key("attention.head_count_kv", n_head),
        head_dim=head_dim,
        v_head_dim=key("attention.value_length", head_dim),
        d_ffn=key("feed_forward_length"),
        vocab_size=vocab_size,
        context_length=key("context_length", 2048),
        norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5, float),
        rope_base=key("rope.freq_base", 10000.0, float),
        rope_dim=key("rope.dimension_count", head_dim),
        rope_neox=True,
        sliding_layers=(False,) * n_layer,
        pooling=pooling_type(arch, meta),
        **_rope_scaling(arch, meta, key("context_length", 2048)),
    )


def _rope_scaling(arch: str, meta: dict[str, Any], n_ctx_train: int) -> dict[str, Any]:
    """The Config fields of `{arch}.rope.scaling.*`: linear (positions scaled) or YaRN (as
    llama.cpp reads it: factor, yarn_beta_fast/slow, yarn_attn_factor), and always the
    context the model was trained at (original_context_length, else the file's context),
    which YaRN and Mistral 3's attention temperature read."""
    def number(name: str, default: float) -> float:
        value = meta.get(f"{arch}.rope.scaling.{name}", default)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ModelConfigError(f"{arch}.rope.scaling.{name} is {value!r}, not a "
                                   f"number") from None
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 0.0) or 0.0)
    fields: dict[str, Any] = {"rope_orig_ctx": int(number("original_context_length",
                                                          n_ctx_train))}
    if kind == "linear" and factor > 0:
        fields["rope_freq_scale"] = 1.0 / factor
    elif kind == "yarn" and factor > 1:
        fields.update(rope_freq_scale=1.0 / factor, rope_yarn=True,
                      yarn_beta_fast=number("yarn_beta_fast", 32.0),
                      yarn_beta_slow=number("yarn_beta_slow", 1.0),
                      rope_attn_factor=number("yarn_attn_factor", 1.0))
    elif kind not in ("none", "linear", "yarn"):
        raise ModelConfigError(f"rope scaling {kind!r} (factor {factor}) is not supported yet")
    return fields
