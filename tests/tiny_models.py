"""Tiny random-weight GGUF models of every architecture, with real tokenizers.

The tokenizer metadata comes from llama.cpp's vocab-only files in tests/data/vocab/; the
weights are random (seeded), so the models talk nonsense but exercise loading, shapes, the
paged forward and the engine exactly as a real file would.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from kinetic.model.gguf_file import GGUFFile

DATA = Path(__file__).parent / "data"


def vocab_file(name: str) -> Path:
    """llama.cpp's vocab-only file ggml-vocab-{name}.gguf. tests/data/vocab/ keeps it
    xz-compressed (a fifth of its 43 MB: the repository travels to the device machine under
    a 64 MiB limit); it is unpacked once into ~/.cache/kinetic/vocab/ under its compressed
    bytes' hash, written under a temporary name and renamed, so that processes share it.
    Looked for at each call (a test may have moved the cache: XDG_CACHE_HOME)."""
    packed = DATA / "vocab" / f"ggml-vocab-{name}.gguf.xz"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kinetic" / "vocab"
    path = cache / f"ggml-vocab-{name}-{_digest(packed)}.gguf"
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache, delete=False) as f:
            f.write(lzma.decompress(packed.read_bytes()))
        os.replace(f.name, path)
    return path


@functools.cache
def _digest(packed: Path) -> str:
    return hashlib.sha256(packed.read_bytes()).hexdigest()[:16]


VOCAB_FOR_ARCH = {"llama": "llama-bpe", "mistral3": "llama-bpe", "lfm2": "llama-bpe",
                  "lfm2moe": "llama-bpe",
                  "qwen2": "qwen2",
                  "qwen3": "qwen2", "qwen3moe": "qwen2", "gemma3": "llama-spm",
                  "qwen35": "qwen2", "qwen35moe": "qwen2"}

LAYER_TENSORS = {
    "llama": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
              "ffn_up", "ffn_down"],
    "mistral3": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down"],
    # LFM2: every layer's norms and feed-forward, then a convolution's or attention's tensors
    "lfm2": ["attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
    "lfm2moe": ["attn_norm", "ffn_norm"],   # then a dense or a mixture's feed-forward
    "qwen2": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q.bias", "attn_k.bias",
              "attn_v.bias", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
    "qwen3": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
              "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"],
    "qwen3moe": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                 "attn_output", "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                 "ffn_down_exps"],
    "gemma3": ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
               "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
               "ffn_down", "post_ffw_norm"],
    # Qwen3.5: every layer's norms, then a gated full attention's or a gated delta-net's
    # tensors, then a dense or a mixture's (with a shared expert) feed-forward
    "qwen35": ["attn_norm", "post_attention_norm"],
    "qwen35moe": ["attn_norm", "post_attention_norm"],
}
QWEN35_FULL = ["attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output"]
QWEN35_LINEAR = ["attn_qkv", "attn_gate", "ssm_conv1d", "ssm_dt.bias", "ssm_a", "ssm_beta",
                 "ssm_alpha", "ssm_norm", "ssm_out"]
QWEN35_MOE = ["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
              "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"]


def copy_tokenizer(writer: gguf.GGUFWriter, vocab: str, skip: tuple[str, ...] = ()) -> int:
    """Copy tokenizer.* keys (but `skip`) of tests/data/vocab/ggml-vocab-{vocab}.gguf; returns
    the vocabulary size."""
    meta = GGUFFile(vocab_file(vocab)).metadata
    for key, value in meta.items():
        if not key.startswith("tokenizer.") or key in skip:
            continue
        if isinstance(value, np.ndarray):
            kind = (gguf.GGUFValueType.FLOAT32 if value.dtype.kind == "f"
                    else gguf.GGUFValueType.INT32)
            writer.add_key_value(key, value.tolist(), gguf.GGUFValueType.ARRAY, kind)
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_string(key, value)
    return len(meta["tokenizer.ggml.tokens"])


def add_decoder_shape(w: gguf.GGUFWriter, *, n_layer: int, context_length: int, d_model: int,
                      d_ffn: int, n_head: int, n_kv_head: int | list[int], head_dim: int,
                      rope_base: float) -> None:
    """The hyperparameter keys of a decoder (GQA attention, rotary, RMS norm), in one order."""
    w.add_block_count(n_layer)
    w.add_context_length(context_length)
    w.add_embedding_length(d_model)
    w.add_feed_forward_length(d_ffn)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv_head)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-6)


# where each format's half-float scales (and minimums) sit in its block
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype, N: int, K: int, seed: int | np.random.Generator = 0,
                  magnitude: float | None = None) -> np.ndarray:
    """Random GGUF bytes (uint8, flat) of a [N, K] weight of any block format: random quants
    and half-float scales and minimums, of mixed magnitudes (10^-4 to 10^-1) or, with
    `magnitude`, within a factor 2 of it; random floats for the float types. Fast at any
    size: nothing is quantized (write_tiny_model's random_blocks)."""
    qtype = gguf.GGMLQuantizationType(qtype)
    rng = np.random.default_rng(seed)
    if qtype.name in ("F32", "F16", "BF16"):
        x = rng.standard_normal(N * K, np.float32) * (magnitude or 1.0)
        if qtype.name == "F16":
            return x.astype("<f2").view(np.uint8)
        return x.view(np.uint8) if qtype.name == "F32" else (x.view(np.uint32) >> 16).astype(
            "<u2").view(np.uint8)
    per, size = gguf.GGML_QUANT_SIZES[qtype][1], gguf.GGML_QUANT_SIZES[qtype][0]
    blocks = rng.integers(0, 256, (N * K // size, per), dtype=np.uint8)
    for at in HALVES[qtype.name]:
        if magnitude is None:
            halves = rng.standard_normal(len(blocks)) * 10.0 ** rng.integers(-4, 0, len(blocks))
        else:
            halves = magnitude * rng.uniform(0.5, 1.0, len(blocks))
        blocks[:, at:at + 2] = halves.astype("<f2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def write_tiny_model(path: Path, arch: str, *, n_layer: int | None = None, d_model: int = 64,
                     n_head: int = 4, n_kv_head: int = 2, head_dim: int | None = None,
                     d_ffn: int = 128,
                     context_length: int = 512, sliding_window: int = 8, seed: int = 0,
                     tied: bool | None = None, chat_template: str | None = None,
                     n_expert: int = 8, n_expert_used: int = 2, d_ffn_expert: int = 32,
                     qtype: str = "F32", output_scale: float = 1.0,
                     rope_scaling: dict | None = None, rope_freqs: bool = False,
                     attn_temp_scale: float = 0.0,
                     attention_layers: tuple[int, ...] = (1,),
                     full_attention_interval: int = 2, rope_dim: int | None = None,
                     rope_sections: tuple[int, ...] | None = None, ssm_state: int = 16,
                     ssm_k_heads: int = 2, ssm_v_heads: int = 4, ssm_conv_kernel: int = 4,
                     d_ffn_shexp: int = 64, mtp_layers: int = 0, vocab: str | None = None,
                     random_weights: bool = False) -> Path:
    """Write a random-weight model of `arch` to path and return it; `chat_template` (Jinja
    source) replaces the vocabulary file's own, if any. A mixture-of-experts `arch` has
    `n_expert` experts of width `d_ffn_expert`, `n_expert_used` per token. `qtype` ("F32",
    "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1": what the gguf package can write) stores
    the projection matrices (the router stays F32, as converted files keep it);
    `output_scale` multiplies the final norm, sharpening the random model's flat
    distributions for parity checks. `rope_scaling`: `{arch}.rope.scaling.*` keys (type,
    factor, original_context_length, ...); `rope_freqs`: a rope_freqs tensor of Llama 3.1's
    frequency factors (its rope scaling as converted); `attn_temp_scale`: Mistral 3's
    attention temperature. An LFM2 model's `attention_layers` are attention layers, the
    others short convolutions of 3 taps.

    Qwen3.5 (`qwen35`, `qwen35moe`; n_layer 4 and head_dim 32 by default, other archs 2 and
    16): layer i is a gated full attention (q with an interleaved output gate, q/k norms)
    where (i + 1) % `full_attention_interval` == 0, else a gated delta-net with
    `ssm_k_heads` k heads and `ssm_v_heads` v heads (a multiple) of width `ssm_state`, a
    causal convolution of `ssm_conv_kernel` taps; rotary over `rope_dim` (default head_dim /
    4) of each head, in multimodal `rope_sections` (4, summing to rope_dim / 2; default
    about thirds, as [11, 11, 10, 0] of 64). `qwen35moe` adds a shared expert of width
    `d_ffn_shexp` with a sigmoid gate. `mtp_layers`: Qwen3.5's
    multi-token-prediction blocks after the decoder's (block_count counts them, as converted
    files do; written last, so the other tensors are those of the file without them).
    `vocab` names another vocabulary file of tests/data/vocab than the arch's. With
    `random_weights`, matrices are random block bytes of `qtype` (random_blocks: any block
    format, K-quants too, and fast at real sizes, bench/gpu.py's models), not quantized
    random floats.
    """
    qwen35 = arch in ("qwen35", "qwen35moe")
    n_layer = n_layer if n_layer is not None else 4 if qwen35 else 2
    head_dim = head_dim if head_dim is not None else 32 if qwen35 else 16
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    vocab = copy_tokenizer(w, vocab or VOCAB_FOR_ARCH[arch], skip=("tokenizer.chat_template",)
                           if chat_template is not None else ())
    if chat_template is not None:
        w.add_chat_template(chat_template)
    lfm = arch in ("lfm2", "lfm2moe")
    conv = [lfm and i not in attention_layers for i in range(n_layer)]
    add_decoder_shape(w, n_layer=n_layer + mtp_layers, context_length=context_length,
                      d_model=d_model,
                      d_ffn=d_ffn, n_head=n_head, head_dim=head_dim, rope_base=10000.0,
                      n_kv_head=[0 if c else n_kv_head for c in conv] if lfm else n_kv_head)
    if lfm:
        w.add_shortconv_l_cache(3)
    for key, value in (rope_scaling or {}).items():
        if isinstance(value, str):
            w.add_string(f"{arch}.rope.scaling.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.rope.scaling.{key}", value)
        else:
            w.add_float32(f"{arch}.rope.scaling.{key}", value)
    if attn_temp_scale:
        w.add_float32(f"{arch}.attention.temperature_scale", attn_temp_scale)
    if arch == "lfm2moe":   # sigmoid gating; the first layer dense
        w.add_uint32("lfm2moe.leading_dense_block_count", 1)
        w.add_uint32("lfm2moe.expert_gating_func", 2)
    if arch in ("qwen3moe", "lfm2moe"):
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(d_ffn_expert)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    full = [not qwen35 or (i + 1) % full_attention_interval == 0 for i in range(n_layer)]
    if qwen35:
        rope_dim = head_dim // 4 if rope_dim is None else rope_dim
        if rope_sections is None:
            third, rest = divmod(rope_dim // 2, 3)
            rope_sections = (third + (rest > 0), third + (rest > 1), third, 0)
        w.add_rope_dimension_count(rope_dim)
        w.add_rope_dimension_sections(list(rope_sections))
        w.add_ssm_conv_kernel(ssm_conv_kernel)
        w.add_ssm_state_size(ssm_state)
        w.add_ssm_group_count(ssm_k_heads)
        w.add_ssm_time_step_rank(ssm_v_heads)
        w.add_ssm_inner_size(ssm_v_heads * ssm_state)
        w.add_full_attention_interval(full_attention_interval)
        if mtp_layers:
            w.add_uint32(f"{arch}.nextn_predict_layers", mtp_layers)
    if arch == "qwen35moe":
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_expert_used)
        w.add_expert_feed_forward_length(d_ffn_expert)
        w.add_expert_shared_feed_forward_length(d_ffn_shexp)
    tied = arch in ("gemma3", "lfm2", "lfm2moe") if tied is None else tied

    def tensor(name: str, *shape: int, scale: float = 0.08, store: str = qtype) -> None:
        if random_weights and len(shape) >= 2 and store != "F32":
            kind = gguf.GGMLQuantizationType[store]
            n_rows = int(np.prod(shape[:-1]))
            # a K-quant's block scale multiplies 6-bit sub-block scales (up to 63) too
            data = random_blocks(kind, n_rows, shape[-1], rng,
                                 magnitude=scale / (512 if store.endswith("_K") else 8))
            w.add_tensor(name, data.reshape(*shape[:-1], -1), raw_dtype=kind)
            return
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        if len(shape) < 2 or store == "F32":
            w.add_tensor(name, value)
        elif store == "F16":
            w.add_tensor(name, value.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[store]
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)

    q, kv = n_head * head_dim, n_kv_head * head_dim
    shapes = {"attn_q": (q, d_model), "attn_k": (kv, d_model), "attn_v": (kv, d_model),
              "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
              "attn_output": (d_model, q), "attn_q_norm": (head_dim,),
              "attn_k_norm": (head_dim,), "ffn_gate": (d_ffn, d_model),
              "ffn_up": (d_ffn, d_model), "ffn_down": (d_model, d_ffn),
              "shortconv.conv": (d_model, 3), "shortconv.in_proj": (3 * d_model, d_model),
              "shortconv.out_proj": (d_model, d_model),
              "ffn_gate_inp": (n_expert, d_model), "exp_probs_b.bias": (n_expert,),
              "ffn_gate_exps": (n_expert, d_ffn_expert, d_model),
              "ffn_up_exps": (n_expert, d_ffn_expert, d_model),
              "ffn_down_exps": (n_expert, d_model, d_ffn_expert)}
    if qwen35:   # the attention's q carries an output gate; the delta-net's tensors
        sv = ssm_v_heads * ssm_state
        conv_dim = 2 * ssm_k_heads * ssm_state + sv
        shapes.update({"attn_q": (2 * q, d_model), "attn_qkv": (conv_dim, d_model),
                       "attn_gate": (sv, d_model), "ssm_conv1d": (conv_dim, ssm_conv_kernel),
                       "ssm_dt.bias": (ssm_v_heads,), "ssm_beta": (ssm_v_heads, d_model),
                       "ssm_alpha": (ssm_v_heads, d_model), "ssm_norm": (ssm_state,),
                       "ssm_out": (d_model, sv), "ffn_gate_inp_shexp": (d_model,),
                       "ffn_gate_shexp": (d_ffn_shexp, d_model),
                       "ffn_up_shexp": (d_ffn_shexp, d_model),
                       "ffn_down_shexp": (d_model, d_ffn_shexp)})
    tensor("token_embd.weight", vocab, d_model, scale=0.5)
    for i in range(n_layer):
        extra = []
        if arch == "lfm2moe":
            extra = (["ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                      "exp_probs_b.bias"] if i >= 1 else ["ffn_gate", "ffn_up", "ffn_down"])
        if lfm:
            extra += (["shortconv.conv", "shortconv.in_proj", "shortconv.out_proj"] if conv[i]
                      else ["attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                            "attn_output"])
        if qwen35:
            extra = ((QWEN35_FULL if full[i] else QWEN35_LINEAR)
                     + (QWEN35_MOE if arch == "qwen35moe" else ["ffn_gate", "ffn_up", "ffn_down"]))
        for name in LAYER_TENSORS[arch] + extra:
            full_name = f"blk.{i}.{name}" + ("" if name.endswith(".bias") or name == "ssm_a"
                                             else ".weight")
            if name.endswith("norm"):
                w.add_tensor(full_name, (1.0 + 0.1 * rng.standard_normal(
                    shapes.get(name, (d_model,)))).astype(np.float32))
            elif name == "ssm_a":   # -exp(A_log), as converted
                w.add_tensor(full_name, -np.exp(rng.uniform(-1.0, 1.0, ssm_v_heads))
                             .astype(np.float32))
            elif name in ("ffn_gate_inp", "shortconv.conv", "ssm_conv1d",
                          "ffn_gate_inp_shexp"):   # kept F32, as converted
                tensor(full_name, *shapes[name], scale=0.5, store="F32")
            else:
                tensor(full_name, *shapes[name])
    w.add_tensor("token_embd_norm.weight" if lfm else "output_norm.weight",
                 np.full(d_model, output_scale, np.float32))
    if rope_freqs:
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim))
    if not tied:
        tensor("output.weight", vocab, d_model)
    for i in range(n_layer, n_layer + mtp_layers):   # Qwen3.5's multi-token prediction
        for name in ["attn_norm", "post_attention_norm", "nextn.enorm", "nextn.hnorm",
                     "nextn.shared_head_norm"]:
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(d_model, np.float32))
        for name in QWEN35_FULL + ["ffn_gate", "ffn_up", "ffn_down"]:
            tensor(f"blk.{i}.{name}.weight", *shapes[name])
        tensor(f"blk.{i}.nextn.eh_proj.weight", d_model, 2 * d_model)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama3_rope_factors(head_dim: int, base: float = 10000.0, factor: float = 8.0,
                        low: float = 1.0, high: float = 4.0, orig_ctx: int = 64) -> np.ndarray:
    """Llama 3.1's rope frequency factors as its converter writes them (rope_freqs): 1 for
    wavelengths under orig_ctx / high, `factor` over orig_ctx / low, smoothed between. A
    small orig_ctx makes every kind appear in a tiny head."""
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < orig_ctx / high:
            out.append(1.0)
        elif wavelen > orig_ctx / low:
            out.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)
