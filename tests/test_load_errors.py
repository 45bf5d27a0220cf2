"""Broken model files through `load_model`: each fails with a ValueError subclass whose
message names what is wrong (the file is not GGUF, is truncated, has an unknown
architecture, lacks a key or a tensor, or holds a tensor type kinetic cannot decode).

Every case starts from one tiny valid llama file (2 layers, d_model 64, 4 heads, 2 KV
heads, FFN 128, 32 tokens) written with GGUFWriter, and removes or alters one thing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as T

from kinetic.model.config import ModelConfigError
from kinetic.model.gguf_file import GGUFError
from kinetic.model.loader import ARCHITECTURES, load_model
from kinetic.model.quants import UnsupportedTensorType

N_LAYER, D_MODEL, N_HEAD, N_KV_HEAD, VOCAB = 2, 64, 4, 2, 32
HEAD_DIM = D_MODEL // N_HEAD


def tensor_shapes(d_ffn: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tiny llama model, numpy order."""
    shapes = {"token_embd.weight": (VOCAB, D_MODEL), "output_norm.weight": (D_MODEL,)}
    for i in range(N_LAYER):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (D_MODEL,),
            f"blk.{i}.attn_q.weight": (N_HEAD * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_k.weight": (N_KV_HEAD * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_v.weight": (N_KV_HEAD * HEAD_DIM, D_MODEL),
            f"blk.{i}.attn_output.weight": (D_MODEL, N_HEAD * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": (D_MODEL,),
            f"blk.{i}.ffn_gate.weight": (d_ffn, D_MODEL),
            f"blk.{i}.ffn_up.weight": (d_ffn, D_MODEL),
            f"blk.{i}.ffn_down.weight": (D_MODEL, d_ffn),
        })
    return shapes


def write_llama(path: Path, *, arch: str = "llama", d_ffn: int = 128,
                skip_keys: tuple[str, ...] = (), skip_tensors: tuple[str, ...] = (),
                shapes: dict[str, tuple[int, ...]] | None = None,
                types: dict[str, T] | None = None) -> Path:
    """The tiny llama model, less `skip_keys` (names after "{arch}.") and `skip_tensors`,
    with `shapes` and `types` overriding tensors' shapes and GGML types."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": N_LAYER, "context_length": 128, "embedding_length": D_MODEL,
            "feed_forward_length": d_ffn, "attention.head_count": N_HEAD,
            "attention.head_count_kv": N_KV_HEAD}
    for name, value in keys.items():
        if name not in skip_keys:
            w.add_uint32(f"{arch}.{name}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{arch}.rope.freq_base", 10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"▁t{i}" for i in range(VOCAB - 3)])
    w.add_token_scores([0.0] * 3 + [-float(i) for i in range(VOCAB - 3)])
    w.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))
    for name, shape in {**tensor_shapes(d_ffn), **(shapes or {})}.items():
        if name in skip_tensors:
            continue
        qtype = (types or {}).get(name, T.F32)
        if qtype == T.F32:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
        else:  # raw blocks of zeros: enough to reach the type check
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((*shape[:-1], shape[-1] // block * type_size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _load_fails(path: Path, error: type[ValueError], *phrases: str) -> str:
    with pytest.raises(error) as e:
        load_model(str(path), dtype="float32")
    message = str(e.value)
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_the_valid_tiny_model_loads(tmp_path):
    """The control: every failure below comes from the one thing changed."""
    model = load_model(str(write_llama(tmp_path / "ok.gguf")), dtype="float32")
    cfg = model.config
    assert (cfg.arch, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.d_ffn,
            cfg.vocab_size) == ("llama", N_LAYER, D_MODEL, N_HEAD, N_KV_HEAD, 128, VOCAB)
    assert cfg.tied_output and len(model.weights["blk"]) == N_LAYER


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("<html>404 Not Found</html>")
    message = _load_fails(path, GGUFError, "not a GGUF file", "b'<htm'")
    assert str(path) in message


def test_missing_file(tmp_path):
    _load_fails(tmp_path / "absent.gguf", GGUFError, "absent.gguf", "no such file")


@pytest.mark.parametrize("where, phrases", [
    (lambda d: d.index("▁t5".encode()), ["metadata key 'tokenizer.ggml.tokens'"]),
    (lambda d: len(d) // 2, ["tensor 'blk.", "the file has"]),
    (lambda d: len(d) - 1, ["tensor 'blk.1.ffn_down.weight'", "the file has"]),
], ids=["token-list", "middle", "last-byte"])
def test_truncated(tmp_path, where, phrases):
    data = write_llama(tmp_path / "ok.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:where(data)])
    _load_fails(path, GGUFError, str(path), "truncated", *phrases)


def test_unknown_architecture(tmp_path):
    path = write_llama(tmp_path / "m.gguf", arch="mamba9")
    message = _load_fails(path, ModelConfigError, str(path), "'mamba9'", "not supported")
    for name in ARCHITECTURES:
        assert name in message


def test_missing_metadata_key(tmp_path):
    path = write_llama(tmp_path / "m.gguf", skip_keys=("block_count",))
    _load_fails(path, ModelConfigError, "llama.block_count")


def test_missing_tensor(tmp_path):
    path = write_llama(tmp_path / "m.gguf", skip_tensors=("blk.1.attn_q.weight",))
    _load_fails(path, ModelConfigError, str(path), "missing tensor 'blk.1.attn_q.weight'")


def test_wrong_tensor_shape(tmp_path):
    path = write_llama(tmp_path / "m.gguf", shapes={"blk.0.attn_k.weight": (48, D_MODEL)})
    _load_fails(path, ModelConfigError, str(path), "'blk.0.attn_k.weight'", "(48, 64)",
                "expected (32, 64)")


def test_unexpected_tensor(tmp_path):
    path = write_llama(tmp_path / "m.gguf", shapes={"blk.0.mystery.weight": (D_MODEL,)})
    _load_fails(path, ModelConfigError, str(path), "blk.0.mystery.weight", "does not use")


def test_unsupported_tensor_type(tmp_path):
    # IQ2_XXS blocks hold 256 values: an FFN of 256 makes ffn_down's rows whole blocks.
    path = write_llama(tmp_path / "m.gguf", d_ffn=256,
                       types={"blk.1.ffn_down.weight": T.IQ2_XXS})
    _load_fails(path, UnsupportedTensorType, "'blk.1.ffn_down.weight'", "IQ2_XXS",
                "cannot dequantize", "Q4_K")


def test_unknown_tensor_type_id(tmp_path):
    data = bytearray(write_llama(tmp_path / "ok.gguf").read_bytes())
    # In the tensor info the type id follows the name, n_dims (u32) and two u64 dims.
    name = b"blk.0.attn_v.weight"
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name) + 4 + 16
    assert int.from_bytes(data[at:at + 4], "little") == T.F32
    data[at:at + 4] = (250).to_bytes(4, "little")
    path = tmp_path / "m.gguf"
    path.write_bytes(bytes(data))
    _load_fails(path, GGUFError, str(path), "tensor 'blk.0.attn_v.weight'",
                "unknown GGML type id 250")
