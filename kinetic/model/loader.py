"""`load_model(path)`: a GGUF file -> (Config, weights, architecture module).

The architecture modules are the registry: each has `configure`, the tensor lists and
`forward`. An unknown architecture, a missing key or a missing tensor fails here with a
message naming it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType

import jax.numpy as jnp

from kinetic.model import (bert, gemma3, lfm2, lfm2moe, llama, mistral3, qwen2, qwen3,
                           qwen3moe, qwen35, qwen35moe)
from kinetic.model.config import Config, ModelConfigError, base_config
from kinetic.model.gguf_file import GGUFFile
from kinetic.model.quants import UnsupportedTensorType
from kinetic.model.weights import ProgressFn, kernel_choice, load_weights, run_repacks

ARCHITECTURES: dict[str, ModuleType] = {
    "bert": bert, "llama": llama, "mistral": llama, "mistral3": mistral3, "qwen2": qwen2,
    "qwen3": qwen3,
    "qwen3moe": qwen3moe, "gemma3": gemma3, "lfm2": lfm2, "lfm2moe": lfm2moe,
    "qwen35": qwen35, "qwen35moe": qwen35moe,
}


@dataclass
class LoadedModel:
    file: GGUFFile
    config: Config
    weights: dict
    arch: ModuleType
    # 16-column rearrangements load_model(defer_repack=True) left for finish_repack
    pending_repack: list = field(default_factory=list)
    _repack_lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                         compare=False)

    def finish_repack(self) -> None:
        """Do the weight rearrangements left for later (weights.run_repacks); a step reads
        the weights only after this (Runner calls it, once its warm-up steps are done; on a
        warm start Engine.compile does it in a thread meanwhile: a second caller waits)."""
        with self._repack_lock:
            if self.pending_repack:
                run_repacks(self.file, self.pending_repack)
                self.pending_repack.clear()


def read_config(f: GGUFFile) -> tuple[Config, ModuleType]:
    arch_name = f.architecture
    arch = ARCHITECTURES.get(arch_name)
    if arch is None:
        raise ModelConfigError(f"{f.path}: architecture {arch_name!r} is not supported "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    tokens = f.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else f.get(f"{arch_name}.vocab_size")
    if "token_embd.weight" in f.tensors:
        vocab = f.tensors["token_embd.weight"].shape[0]
    if not vocab:
        raise ModelConfigError(f"{f.path}: no vocabulary size (no tokenizer and no token_embd)")
    cfg = arch.configure(base_config(arch_name, f.metadata, int(vocab)), f.metadata)
    head = f.tensors.get("cls.output.weight")
    types = f.tensors.get("token_types.weight")
    cfg = cfg.replace(tied_output="output.weight" not in f.tensors,
                      n_cls=head.shape[0] if head is not None else 0,
                      n_token_types=types.shape[0] if types is not None else 0)
    if cfg.pooling == "rank" and not ({"cls.weight", "cls.output.weight"} & set(f.tensors)):
        raise ModelConfigError(f"{f.path}: the file ranks ({arch_name}.pooling_type 4) but "
                               f"has no classifier (cls or cls.output tensors)")
    return cfg, arch


def load_model(path: str, dtype: str = "bfloat16", act_quant: bool = True,
               progress: ProgressFn | None = None, kernel: str = "auto",
               defer_repack: bool = False) -> LoadedModel:
    """Open, check and convert a GGUF model. kernel: "ffi" (weights stay in their GGUF
    blocks, multiplied by kinetic's C++ kernel), "xla" (dequantized, multiplied by XLA) or
    "auto" (weights.kernel_choice). For "xla", dtype is the projections' compute type and
    act_quant rounds activations as llama.cpp does (see weights.load_weights).
    defer_repack: leave the weights' 16-column rearrangement (weights._Packer) to
    LoadedModel.finish_repack, which a Runner calls after its warm-up steps: the compiler's
    peak memory then does not meet the rearranged weights'."""
    f = GGUFFile(path)
    try:
        cfg, arch = read_config(f)
        kernel = kernel_choice(kernel)
        cfg = cfg.replace(kernel=kernel)
        pending: list = []
        weights = load_weights(f, cfg, arch, jnp.dtype(dtype), act_quant, progress, kernel,
                               pending)
    except (ModelConfigError, UnsupportedTensorType) as e:
        if f.path in str(e):
            raise
        raise type(e)(f"{f.path}: {e}") from None
    loaded = LoadedModel(f, cfg, weights, arch, pending)
    if not defer_repack:
        loaded.finish_repack()
    return loaded
