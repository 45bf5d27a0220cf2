"""GGUF tensors -> the weight pytree an architecture's forward function takes.

Names follow the GGUF tensors with ".weight" dropped (`token_embd`, `blk[i]["attn_q"]`,
`blk[i]["attn_q.bias"]`). Two kernels (`kernel_choice`):

- "ffi" (CPU, the default where the C++ kernel is built): every 2-D weight stays in its
  GGUF blocks, read in place from the memory-mapped file: one zero-copy device buffer of the
  whole file, each Proj an offset into it (layers.Proj). The token embedding is a Proj too
  (a step dequantizes only its rows), and a tied output is the embedding's own Proj.
- "xla" (anywhere else, or KINETIC_KERNEL=xla): weights dequantized at load. Every 2-D
  projection is stored transposed, [K, N], in the compute dtype (XLA's CPU dot converts a
  weight stored [N, K], or any M = 1 operand, to a full f32 copy on every call); the
  embedding table is float32 [V, D]; a tied output is that table transposed, [D, V].

Norms and biases are float32 in both. Every expected tensor must be present with the shape
the config implies, and every tensor in the file must be used: a mismatch, or a type the
kernel cannot multiply, fails at load, naming the tensor.
"""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from kinetic import kernels
from kinetic.kernels import ffi as native
from kinetic.memory import huge_pages
from kinetic.model import quants
from kinetic.model.config import Config, ModelConfigError
from kinetic.model.gguf_file import GGUFFile, RawTensor
from kinetic.model.layers import PLANES, Proj

KERNELS = ("auto", "ffi", "xla", "pallas")


def kernel_choice(requested: str = "auto") -> str:
    """"ffi", "xla" or "pallas" for `requested` ("auto" reads KINETIC_KERNEL, else picks
    "pallas" where JAX's backend is a GPU, "ffi" where the C++ kernel is built and JAX runs
    on CPU). Asking for "ffi" or "pallas" where it cannot run is a ModelConfigError saying
    why."""
    want = requested if requested != "auto" else (os.environ.get("KINETIC_KERNEL") or "auto")
    if want not in KERNELS:
        raise ModelConfigError(f"unknown kernel {want!r} (choose one of {', '.join(KERNELS)})")
    if want == "xla":
        return "xla"
    if want == "pallas" or (want == "auto" and jax.default_backend() == "gpu"):
        return _pallas_usable()
    if native.usable():
        return "ffi"
    if want == "ffi":
        why = ("the C++ kernel is not built (pip install -e . builds it)"
               if not kernels.available() else "JAX does not run on the CPU here")
        raise ModelConfigError(f"the ffi kernel cannot run: {why}")
    return "xla"

def _pallas_usable() -> str:
    """"pallas" where Pallas runs its kernels: compiled on a GPU, interpreted elsewhere (CPU:
    exact, slow; for tests). A ModelConfigError saying why where it cannot."""
    try:
        from kinetic.kernels import pallas_matmul  # noqa: F401
    except ImportError as e:
        raise ModelConfigError(f"the pallas kernel cannot run: this JAX has no Pallas ({e})")
    return "pallas"


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
        # a short convolution (LFM2): its taps, and the projections around it
        "shortconv.conv": (cfg.d_model, cfg.conv_width),
        "shortconv.in_proj": (3 * cfg.d_model, cfg.d_model),
        "shortconv.out_proj": (cfg.d_model, cfg.d_model),
        # mixture of experts: the router (and its choice bias), the experts' stacked matrices
        "ffn_gate_inp": (cfg.n_expert, cfg.d_model), "exp_probs_b": (cfg.n_expert,),
        "ffn_gate_exps": (cfg.n_expert, cfg.d_ffn_expert, cfg.d_model),
        "ffn_up_exps": (cfg.n_expert, cfg.d_ffn_expert, cfg.d_model),
        "ffn_down_exps": (cfg.n_expert, cfg.d_model, cfg.d_ffn_expert),
        # encoders (bert) and ranking heads
        "position_embd": (cfg.context_length, cfg.d_model),
        "token_types": (cfg.n_token_types, cfg.d_model),
        "token_embd_norm": (cfg.d_model,), "token_embd_norm.bias": (cfg.d_model,),
        "attn_output_norm": (cfg.d_model,), "attn_output_norm.bias": (cfg.d_model,),
        "layer_output_norm": (cfg.d_model,), "layer_output_norm.bias": (cfg.d_model,),
        "ffn_up.bias": (cfg.d_ffn,), "ffn_down.bias": (cfg.d_model,),
        "cls": (cfg.d_model, cfg.d_model), "cls.bias": (cfg.d_model,),
        "cls.output": (cfg.n_cls, cfg.d_model), "cls.output.bias": (cfg.n_cls,),
    }


# a ranking model's classifier (pooling "rank"): cls and its bias (BERT cross-encoders), then
# cls.output and its bias (the scores); either part may be absent, as llama.cpp allows
HEAD_TENSORS = ("cls", "cls.bias", "cls.output", "cls.output.bias")


# 2-D tensors that are not projections: kept as float32 arrays (a short convolution's taps)
ARRAYS = ("shortconv.conv", "ssm_conv1d")
# 1-D tensors that are a projection to one output (Qwen3.5-MoE's shared-expert gate): read as
# a [1, K] matrix, so that the kernel gives a row the same bits at any row count
ROW_PROJS = ("ffn_gate_inp_shexp",)
# tensors whose file name has no .weight suffix
BARE_NAMES = ("ssm_a",)


def _layer_tensors(arch: ModuleType, cfg: Config, i: int) -> tuple[tuple[str, ...], ...]:
    """(required, optional) tensor names of layer i: the architecture's `layer_tensors(cfg,
    i)` where its layers differ (a hybrid's convolution and attention layers), else its
    LAYER_TENSORS and OPTIONAL_LAYER."""
    if hasattr(arch, "layer_tensors"):
        return arch.layer_tensors(cfg, i)
    return arch.LAYER_TENSORS, arch.OPTIONAL_LAYER


def _file_name(name: str) -> str:
    return name if name.endswith(".bias") or name in BARE_NAMES else name + ".weight"


def load_weights(f: GGUFFile, cfg: Config, arch: ModuleType, dtype: jnp.dtype,
                 act_quant: bool = True, progress: ProgressFn | None = None,
                 kernel: str = "xla", pending: list | None = None) -> dict:
    """Read, check and convert every tensor; returns {"blk": [per-layer dicts], ...}.
    kernel: "ffi" or "xla" (kernel_choice). For "xla" only: dtype is the projections' compute
    type, and act_quant rounds activations as llama.cpp's CPU backend does before each
    projection (closer agreement with llama.cpp; see docs/parity.md); the ffi kernel always
    rounds them so. pending: a list that takes the 16-column rearrangements instead of doing
    them now (_Packer; run_repacks does them)."""
    packed = (_Packer(f, repack_wanted(), pending) if kernel == "ffi" else
              _Planer() if kernel == "pallas" else None)
    # host-read tensors keep their GGUF rows: the ranking head (engine.encoder.Head), and the
    # token embedding unless it is also the output projection (a step gathers its rows)
    tied = cfg.tied_output and not cfg.pooling
    host_read = set(HEAD_TENSORS) | (set() if tied else {"token_embd"})
    shapes = expected_shapes(cfg)
    if hasattr(arch, "tensor_shapes"):   # shapes that are the architecture's own
        shapes.update(arch.tensor_shapes(cfg))
    wanted: list[tuple[int | None, str, bool]] = (
        [(None, n, True) for n in arch.GLOBAL_TENSORS]
        + [(None, n, False) for n in arch.OPTIONAL_GLOBAL]
        + [(i, n, True) for i in range(cfg.n_layer) for n in _layer_tensors(arch, cfg, i)[0]]
        + [(i, n, False) for i in range(cfg.n_layer) for n in _layer_tensors(arch, cfg, i)[1]]
        + [(None, n, False) for n in (HEAD_TENSORS if cfg.pooling == "rank" else ())])
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
        target = weights if layer is None else weights["blk"][layer]
        if len(raw.shape) == 3:   # a mixture's experts: one projection each
            target[name] = (packed.experts(raw) if packed is not None else
                            [_convert(name, m, dtype, raw.qtype if act_quant else None)
                             for m in dequantize(raw)])
        elif name in ARRAYS:
            target[name] = jnp.asarray(dequantize(raw), jnp.float32)
        elif name in ROW_PROJS:
            row = dataclasses.replace(raw, shape=(1, *raw.shape))
            target[name] = (packed.proj(row) if packed is not None else
                            _convert(name, dequantize(row), dtype,
                                     raw.qtype if act_quant else None))
        elif packed is not None and len(raw.shape) == 2:
            target[name] = packed.proj(raw, repack=name not in host_read)
        else:
            target[name] = _convert(name, dequantize(raw), dtype, raw.qtype if act_quant else None)
        if progress:
            progress(done + 1, len(wanted))
    skipped = tuple(f"blk.{i}." for i in range(cfg.n_layer, cfg.n_layer + cfg.n_layer_unused))
    unused = sorted(t for t in set(f.tensors) - used if not t.startswith(skipped))
    if unused:
        raise ModelConfigError(f"{f.path}: tensors this {cfg.arch} model does not use: "
                               f"{', '.join(unused[:5])}{' ...' if len(unused) > 5 else ''}")
    if cfg.pooling:   # embeddings and ranking read the hidden states: no output projection
        weights["output"] = None
    elif "output" not in weights and packed is not None:
        weights["output"] = weights["token_embd"]  # the same blocks, read as a projection
    elif "output" not in weights:
        embd = f.tensors["token_embd.weight"]
        weights["output"] = Proj(jnp.asarray(np.asarray(weights["token_embd"]).T, dtype=dtype),
                                 act_quant=_act_quant(embd.qtype) if act_quant else "")
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
        return Proj(w, act_quant=_act_quant(qtype) if qtype is not None else "")
    return jnp.asarray(value, dtype=jnp.float32)


class _Planer:
    """The pallas kernel's weights (kernels/pallas_matmul.py): each projection, expert and
    the token embedding split into its planes on the device, as _Packer's Projs for the ffi
    kernel. A type the kernel lacks fails here, naming the tensor."""

    def proj(self, raw: RawTensor, repack: bool = True) -> Proj:
        from kinetic.kernels import pallas_matmul   # (JAX's Pallas: imported on use)
        N, K = raw.shape
        try:
            planes = pallas_matmul.repack(raw.data, raw.qtype, (N, K))
        except ValueError as e:
            raise ModelConfigError(f"tensor {raw.name!r}: {e}") from None
        return Proj(planes, PLANES, n=N, k=K)

    def experts(self, raw: RawTensor) -> Proj:
        """A mixture's stacked [E, N, K] tensor as one Proj of stacked Planes (experts.py
        multiplies every chosen pair in one launch: pallas_matmul.matmul_experts)."""
        from kinetic.kernels import pallas_matmul
        E, N, K = raw.shape
        try:
            planes = pallas_matmul.repack_experts(raw.data, raw.qtype, (E, N, K))
        except ValueError as e:
            raise ModelConfigError(f"tensor {raw.name!r}: {e}") from None
        return Proj(planes, PLANES, n=N, k=K)


def repack_wanted() -> bool:
    """Whether the loader rearranges 32-value block weights into the 16-column layout
    (csrc/repack.h): where the kernel runs its AVX-512 path, which reads that layout without
    unpacking it on every call, unless KINETIC_REPACK=0. The results are the same bits."""
    return kernels.isa() == "avx512" and os.environ.get("KINETIC_REPACK", "1") != "0"


class _Packer:
    """Packed Projs over one zero-copy device buffer of the whole file.

    With repack (repack_wanted), each Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 projection of 16 rows
    or more is rearranged in place, in the file's private map, into the 16-column layout
    (its Proj's fmt then carries kernels.REPACK16): the written pages become the process's
    own copy and the file's pages are no longer mapped, so memory holds the weights once.
    Before it is written, each 2 MB piece it lies in moves to memory that may use huge
    pages (memory.huge_pages: the steps stream these weights).
    Tensors read on the host from the file (a ranking head) are passed with repack=False.
    With a `pending` list, the Projs get the repacked id at once but the bytes are left for
    run_repacks (LoadedModel.finish_repack), which must run before a step reads them."""

    def __init__(self, f: GGUFFile, repack: bool = False, pending: list | None = None):
        self.file, self.pending = f, pending
        self.data = jax.device_put(f.bytes)  # in place: the map is page-aligned
        # The blocks are rearranged through the device buffer's own memory, before any step
        # reads it; a buffer XLA copied would not see them, so then nothing is repacked.
        in_place = self.data.unsafe_buffer_pointer() == f.bytes.ctypes.data
        self.writable = f.writable_bytes() if repack and in_place else None
        self.huge: set[int] = set()   # the 2 MB pieces huge_pages moved

    def experts(self, raw: RawTensor) -> list[Proj]:
        """A mixture's stacked [E, N, K] matrices as E projections: expert e's rows follow
        expert e - 1's in the file, so each is an offset into the same blocks."""
        e, n, k = raw.shape
        whole = self.proj(dataclasses.replace(raw, shape=(e * n, k)), repack=False)
        step = n * kernels.row_bytes(int(raw.qtype), k)
        return [self._repack(dataclasses.replace(whole, offset=whole.offset + i * step, n=n))
                for i in range(e)]

    def _repack(self, p: Proj) -> Proj:
        if self.writable is None or p.fmt not in kernels.REPACKABLE or p.n < 16:
            return p
        size = p.n * kernels.row_bytes(p.fmt, p.k)
        if self.pending is not None:
            self.pending.append((p.fmt, p.offset, size, p.n, p.k))
            return dataclasses.replace(p, fmt=p.fmt | kernels.REPACK16)
        huge_pages(self.writable, p.offset, size, self.huge)
        fmt = kernels.repack16_host(p.fmt, self.writable[p.offset:p.offset + size], p.n, p.k)
        return dataclasses.replace(p, fmt=fmt)

    def proj(self, raw: RawTensor, repack: bool = True) -> Proj:
        quants.check_supported(raw.qtype, raw.name)
        n, k = raw.shape
        block = quants.block_size(raw.qtype)
        if k % block:
            raise ModelConfigError(f"{self.file.path}: tensor {raw.name!r} has rows of {k} "
                                   f"values, not a multiple of {raw.qtype.name}'s block of {block}")
        if raw.data.nbytes != n * kernels.row_bytes(int(raw.qtype), k):
            raise ModelConfigError(f"{self.file.path}: tensor {raw.name!r} holds "
                                   f"{raw.data.nbytes} bytes, not {n} rows of {raw.qtype.name}")
        p = Proj(self.data, int(raw.qtype), raw.file_offset(self.file.bytes), n, k)
        return self._repack(p) if repack else p


def run_repacks(f: GGUFFile, pending: list) -> None:
    """The rearrangements a _Packer with a pending list left (fmt, offset, size, n, k each)."""
    whole, huge = f.writable_bytes(), set()
    for fmt, offset, size, n, k in pending:
        huge_pages(whole, offset, size, huge)
        kernels.repack16_host(fmt, whole[offset:offset + size], n, k)


def split_buffer(weights: dict) -> tuple[jax.Array | None, dict]:
    """(the file buffer every packed Proj reads, the weights with that buffer taken out of
    them). A jitted step takes the two apart: passed whole, each Proj's `data` would be an
    argument of its own (hundreds of the same buffer to parse per call), and projections
    that read one input could not share one kernel call (layers.linear_many needs one
    buffer). join_buffer puts it back inside the step."""
    buffers = {id(p.data): p.data for p in _projs(weights) if p.fmt >= 0}
    if len(buffers) > 1:
        raise ValueError("packed weights over more than one buffer")
    if not buffers:
        return None, weights
    skeleton = jax.tree.map(lambda p: dataclasses.replace(p, data=None)
                            if isinstance(p, Proj) and p.fmt >= 0 else p,
                            weights, is_leaf=lambda x: isinstance(x, Proj))
    return next(iter(buffers.values())), skeleton


def join_buffer(buffer: jax.Array | None, skeleton: dict) -> dict:
    """split_buffer undone: every packed Proj reads `buffer` again."""
    if buffer is None:
        return skeleton
    return jax.tree.map(lambda p: dataclasses.replace(p, data=buffer)
                        if isinstance(p, Proj) and p.fmt >= 0 else p,
                        skeleton, is_leaf=lambda x: isinstance(x, Proj))


def _projs(weights) -> list[Proj]:
    return [p for p in jax.tree.leaves(weights, is_leaf=lambda x: isinstance(x, Proj))
            if isinstance(p, Proj)]
