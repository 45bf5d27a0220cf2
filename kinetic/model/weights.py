"""GGUF tensors -> the weight pytree an architecture's forward function takes.

Names follow the GGUF tensors with ".weight" dropped (`token_embd`, `blk[i]["attn_q"]`,
`blk[i]["attn_q.bias"]`). The transforms are few and explicit:
- every 2-D projection is stored transposed, [K, N], in the compute dtype: XLA's CPU dot
  converts a weight stored [N, K] (or any M = 1 operand) to a full f32 copy on every call;
- the embedding table stays float32 [V, D] for the row gather (exact dequantized values);
- a tied output (no `output.weight`) is the embedding table transposed, [D, V].
Every expected tensor must be present with the shape the config implies, and every tensor in
the file must be used: a mismatch fails at load, naming the tensor.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable

import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from kinetic.model import quants
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.gguf_file import GGUFFile, RawTensor
from kinetic.model.layers import Proj

Q = GGMLQuantizationType

ProgressFn = Callable[[int, int], None]


def dequantize(raw: RawTensor) -> np.ndarray:
    """float32 values of a stored tensor (every GGML type real text models use)."""
    return quants.dequantize(raw)


def expected_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of the tensors, as stored in the file ([out, in] for projections)."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    v = cfg.n_kv_head * cfg.v_head_dim
    return {
        "token_embd": (cfg.vocab_size, cfg.d_model), "output": (cfg.vocab_size, cfg.d_model),
        "output_norm": (cfg.d_model,), "rope_freqs": (cfg.rope_dim // 2,),
        "attn_norm": (cfg.d_model,), "ffn_norm": (cfg.d_model,),
        "post_attention_norm": (cfg.d_model,), "post_ffw_norm": (cfg.d_model,),
        "attn_q": (q, cfg.d_model), "attn_k": (kv, cfg.d_model), "attn_v": (v, cfg.d_model),
        "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (v,),
        "attn_output": (cfg.d_model, cfg.n_head * cfg.v_head_dim),
        "attn_output.bias": (cfg.d_model,),
        "attn_q_norm": (cfg.head_dim,), "attn_k_norm": (cfg.head_dim,),
        "ffn_gate": (cfg.d_ffn, cfg.d_model), "ffn_up": (cfg.d_ffn, cfg.d_model),
        "ffn_down": (cfg.d_model, cfg.d_ffn),
    }


def _file_name(name: str) -> str:
    return name if name.endswith(".bias") else name + ".weight"


def load_weights(f: GGUFFile, cfg: Config, arch: ModuleType, dtype: jnp.dtype,
                 act_quant: bool = True, progress: ProgressFn | None = None) -> dict:
    """Read, check and convert every tensor; returns {"blk": [per-layer dicts], ...}.
    act_quant: round activations as llama.cpp's CPU backend does before each projection
    (closer agreement with llama.cpp; see docs/parity.md)."""
    shapes = expected_shapes(cfg)
    wanted: list[tuple[int | None, str, bool]] = (
        [(None, n, True) for n in arch.GLOBAL_TENSORS]
        + [(None, n, False) for n in arch.OPTIONAL_GLOBAL]
        + [(i, n, True) for i in range(cfg.n_layer) for n in arch.LAYER_TENSORS]
        + [(i, n, False) for i in range(cfg.n_layer) for n in arch.OPTIONAL_LAYER])
    used: set[str] = set()
    weights: dict = {"blk": [{} for _ in range(cfg.n_layer)]}
    for done, (layer, name, required) in enumerate(wanted):
        full = _file_name(name) if layer is None else f"blk.{layer}.{_file_name(name)}"
        raw = f.tensors.get(full)
        if raw is None:
            if required:
                raise ModelConfigError(f"{f.path}: missing tensor {full!r} ({cfg.arch} needs it)")
            continue
        used.add(full)
        base = name.split(".")[0] if name.endswith(".bias") else name
        want = shapes[name] if name in shapes else shapes[base]
        if raw.shape != want:
            raise ModelConfigError(f"{f.path}: tensor {full!r} has shape {raw.shape}, "
                                   f"expected {want} from the metadata")
        value = dequantize(raw)
        target = weights if layer is None else weights["blk"][layer]
        target[name] = _convert(name, value, dtype, raw.qtype if act_quant else None)
        if progress:
            progress(done + 1, len(wanted))
    unused = sorted(set(f.tensors) - used)
    if unused:
        raise ModelConfigError(f"{f.path}: tensors this {cfg.arch} model does not use: "
                               f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    if "output" not in weights:
        embd = f.tensors["token_embd.weight"]
        weights["output"] = Proj(jnp.asarray(np.asarray(weights["token_embd"]).T, dtype=dtype),
                                 _act_quant(embd.qtype) if act_quant else "")
    return weights


def _act_quant(qtype: GGMLQuantizationType) -> str:
    """How llama.cpp's CPU backend rounds activations before a dot with this weight type."""
    if qtype in (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return "q8_K"
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return "q8_0"
    return "f16" if qtype == Q.F16 else ""


def _convert(name: str, value: np.ndarray, dtype: jnp.dtype,
             qtype: GGMLQuantizationType | None):
    if name == "token_embd":
        return jnp.asarray(value, dtype=jnp.float32)  # [V, D], gathered by row
    if value.ndim == 2:
        w = jnp.asarray(np.ascontiguousarray(value.T), dtype=dtype)  # [K, N]
        return Proj(w, _act_quant(qtype) if qtype is not None else "")
    return jnp.asarray(value, dtype=jnp.float32)
