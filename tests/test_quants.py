"""Tests for kinetic.model.quants: every supported GGML type against gguf-py's reference
dequantizer on random blocks, against hand-packed blocks whose values follow directly from
the format definitions, and on tensors of the real model files when they are present."""

from __future__ import annotations

import random

import numpy as np
import pytest

import gguf
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

import kinetic.model.quants as quants
from kinetic.model.gguf_file import GGUFFile, RawTensor
from kinetic.model.quants import (SUPPORTED, UnsupportedTensorType, dequantize,
                                  dequantize_bytes)
from tests.conftest import real_model_file

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1,
               T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]

# Byte offsets of the f16 scale fields (d, and m / dmin where the format has one).
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}


def test_supported_is_exactly_the_listed_types():
    assert SUPPORTED == frozenset(BLOCK_TYPES) | {T.F32, T.F16, T.BF16}


# --- 1. random blocks against gguf-py ------------------------------------------------------

def _random_blocks(qtype: T, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """(rows, bytes) uint8: random bytes, with finite f16 scales (some of them subnormal,
    negative or zero) written into the scale fields."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows, blocks_per_row, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, (rows, blocks_per_row))
        scales.flat[:4] = [0.0, -0.0, 3e-6, -5.96e-8]  # f16 zero and subnormals
        b[:, :, offset:offset + 2] = (scales.astype(np.float16).view(np.uint8)
                                      .reshape(rows, blocks_per_row, 2))
    data = b.reshape(rows, blocks_per_row * type_size)
    data.flags.writeable = False  # like the read-only memmap views of a GGUFFile
    return data


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_block_types_match_gguf_py_exactly(qtype, monkeypatch):
    # A small chunk size makes the decoder run over several chunks, the last one partial.
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 1000)
    block, _ = GGML_QUANT_SIZES[qtype]
    data = _random_blocks(qtype, rows=7, blocks_per_row=5, seed=int(qtype))
    ours = dequantize_bytes(data, qtype, (7, 5 * block))
    reference = gguf.quants.dequantize(data, qtype)
    assert ours.dtype == np.float32 and ours.shape == (7, 5 * block)
    assert np.all(np.isfinite(ours))
    # Bit-identical, not merely close: llama.cpp computes these same products in float32.
    np.testing.assert_array_equal(ours.view(np.uint32), reference.astype(np.float32)
                                  .view(np.uint32))


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_plain_types_match_gguf_py(qtype):
    rng = np.random.default_rng(1)
    itemsize = 4 if qtype == T.F32 else 2
    data = rng.integers(0, 256, (6, 10 * itemsize), dtype=np.uint8)
    ours = dequantize_bytes(data, qtype, (3, 2, 10))
    reference = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(3, 2, 10)
    assert ours.dtype == np.float32
    # Random bits include NaNs; their payloads survive both conversions unchanged.
    np.testing.assert_array_equal(ours.view(np.uint32), reference.view(np.uint32))


def test_multi_dimensional_shapes_and_flat_bytes():
    data = _random_blocks(T.Q4_K, rows=6, blocks_per_row=2, seed=5)
    as_matrix = dequantize_bytes(data, T.Q4_K, (6, 512))
    as_cube = dequantize_bytes(data.reshape(-1), T.Q4_K, (2, 3, 512))
    np.testing.assert_array_equal(as_cube.reshape(6, 512), as_matrix)


def test_wrong_byte_count_or_shape_is_a_value_error():
    data = _random_blocks(T.Q8_0, rows=2, blocks_per_row=2, seed=3)
    with pytest.raises(ValueError, match="needs 102 bytes, got 136"):
        dequantize_bytes(data, T.Q8_0, (3, 32))
    with pytest.raises(ValueError, match="multiple of its block size 32"):
        dequantize_bytes(data, T.Q8_0, (4, 16))
    with pytest.raises(ValueError, match="needs 12 bytes"):
        dequantize_bytes(np.zeros(8, np.uint8), T.F32, (3,))


# --- 2. hand-packed blocks --------------------------------------------------------------
# Each builder packs chosen integers bit by bit, following the format's definition in
# ggml's block structs, and returns (bytes, expected values computed from those integers).

def _values(n: int, modulus: int, seed: int) -> list[int]:
    """n arbitrary integers in [0, modulus): irregular, so that any element-order mistake
    (swapped nibbles, halves or bit planes) changes the result."""
    rng = random.Random(seed)
    return [rng.randrange(modulus) for _ in range(n)]


def _f16_bytes(x: float) -> list[int]:
    return list(np.array([x], dtype="<f2").view(np.uint8))


def _hand_q8_0():
    q = list(range(-128, 128, 8))  # 32 values covering the int8 range
    data = _f16_bytes(0.5) + [v & 0xFF for v in q]
    return data, [0.5 * v for v in q]


def _hand_q4_0():
    q = _values(32, 16, seed=1)
    qs = [q[j] | (q[j + 16] << 4) for j in range(16)]  # low nibbles hold elements 0..15
    return _f16_bytes(0.25) + qs, [0.25 * (v - 8) for v in q]


def _hand_q4_1():
    q = _values(32, 16, seed=2)
    qs = [q[j] | (q[j + 16] << 4) for j in range(16)]
    return _f16_bytes(0.5) + _f16_bytes(-1.0) + qs, [0.5 * v - 1.0 for v in q]


def _pack_q5(q):
    qs = [(q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16)]
    qh = sum((v >> 4) << i for i, v in enumerate(q))  # bit i: 5th bit of element i
    return list(qh.to_bytes(4, "little")), qs


def _hand_q5_0():
    q = _values(32, 32, seed=3)
    qh, qs = _pack_q5(q)
    return _f16_bytes(0.125) + qh + qs, [0.125 * (v - 16) for v in q]


def _hand_q5_1():
    q = _values(32, 32, seed=4)
    qh, qs = _pack_q5(q)
    return _f16_bytes(0.25) + _f16_bytes(0.5) + qh + qs, [0.25 * v + 0.5 for v in q]


def _hand_q2_k():
    d, dmin = 0.5, 0.25
    scale = list(range(16))          # one 4-bit scale and min per 16 elements
    mins = [15 - g for g in range(16)]
    q = _values(256, 4, seed=5)
    qs = [0] * 64
    for i, v in enumerate(q):        # element h*128 + j*32 + l: bits 2j of qs[h*32 + l]
        h, j, l = i // 128, (i % 128) // 32, i % 32
        qs[h * 32 + l] |= v << (2 * j)
    scales = [scale[g] | (mins[g] << 4) for g in range(16)]
    expected = [d * scale[i // 16] * q[i] - dmin * mins[i // 16] for i in range(256)]
    return scales + qs + _f16_bytes(d) + _f16_bytes(dmin), expected


def _hand_q3_k():
    d = 0.25
    raw_scale = [(5 * k + 3) % 64 for k in range(16)]  # 6-bit, used as raw - 32
    q = [v - 4 for v in _values(256, 8, seed=6)]  # -4..3
    hmask, qs = [0] * 32, [0] * 64
    for i, v in enumerate(q):
        h, j, l = i // 128, (i % 128) // 32, i % 32
        qs[h * 32 + l] |= ((v + 4) & 3) << (2 * j)
        # A set hmask bit means "no -4": v = low2 - 4 + 4 * bit.
        hmask[l] |= ((v + 4) >> 2) << (4 * h + j)
    scales = [0] * 12
    for k, s in enumerate(raw_scale):
        scales[k % 8] |= (s & 15) << (4 * (k // 8))
        scales[8 + k % 4] |= (s >> 4) << (2 * (k // 4))
    expected = [d * (raw_scale[i // 16] - 32) * q[i] for i in range(256)]
    return hmask + qs + scales + _f16_bytes(d), expected


def _pack_k4_scales(scale, mins):
    """12 bytes for Q4_K/Q5_K: eight 6-bit scales and eight 6-bit mins."""
    b = [0] * 12
    for j in range(4):
        b[j] = scale[j] | ((scale[j + 4] >> 4) << 6)
        b[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6)
        b[j + 8] = (scale[j + 4] & 15) | ((mins[j + 4] & 15) << 4)
    return b


K4_SCALES = [1, 63, 17, 32, 45, 8, 60, 33]
K4_MINS = [0, 5, 63, 40, 16, 31, 2, 59]


def _hand_q4_k():
    d, dmin = 0.5, 0.125
    q = _values(256, 16, seed=7)
    qs = [0] * 128
    for i, v in enumerate(q):  # element c*64 + h*32 + l: nibble h of qs[c*32 + l]
        c, h, l = i // 64, (i % 64) // 32, i % 32
        qs[c * 32 + l] |= v << (4 * h)
    expected = [d * K4_SCALES[i // 32] * q[i] - dmin * K4_MINS[i // 32] for i in range(256)]
    return _f16_bytes(d) + _f16_bytes(dmin) + _pack_k4_scales(K4_SCALES, K4_MINS) + qs, expected


def _hand_q5_k():
    d, dmin = 0.25, 0.5
    q = _values(256, 32, seed=8)
    qs, qh = [0] * 128, [0] * 32
    for i, v in enumerate(q):
        c, h, l = i // 64, (i % 64) // 32, i % 32
        qs[c * 32 + l] |= (v & 15) << (4 * h)
        qh[l] |= (v >> 4) << (i // 32)
    expected = [d * K4_SCALES[i // 32] * q[i] - dmin * K4_MINS[i // 32] for i in range(256)]
    head = _f16_bytes(d) + _f16_bytes(dmin) + _pack_k4_scales(K4_SCALES, K4_MINS)
    return head + qh + qs, expected


def _hand_q6_k():
    d = 0.25
    scale = [-128, -100, -7, -1, 0, 1, 2, 5, 9, 17, 33, 64, 100, 126, 127, -64]
    q = [v - 32 for v in _values(256, 64, seed=9)]  # -32..31
    ql, qh = [0] * 128, [0] * 64
    for i, v in enumerate(q):
        h, k, l = i // 128, (i % 128) // 32, i % 32
        u = v + 32
        ql[h * 64 + (k % 2) * 32 + l] |= (u & 15) << (4 * (k // 2))
        qh[h * 32 + l] |= (u >> 4) << (2 * k)
    expected = [d * scale[i // 16] * q[i] for i in range(256)]
    return ql + qh + [s & 0xFF for s in scale] + _f16_bytes(d), expected


HAND_BUILT = {
    T.Q8_0: _hand_q8_0, T.Q4_0: _hand_q4_0, T.Q4_1: _hand_q4_1, T.Q5_0: _hand_q5_0,
    T.Q5_1: _hand_q5_1, T.Q2_K: _hand_q2_k, T.Q3_K: _hand_q3_k, T.Q4_K: _hand_q4_k,
    T.Q5_K: _hand_q5_k, T.Q6_K: _hand_q6_k,
}


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_hand_built_block(qtype):
    data, expected = HAND_BUILT[qtype]()
    block, type_size = GGML_QUANT_SIZES[qtype]
    assert len(data) == type_size and len(expected) == block
    ours = dequantize_bytes(np.array(data, dtype=np.uint8), qtype, (block,))
    # Every expected value is exactly representable, so equality is exact.
    np.testing.assert_array_equal(ours, np.array(expected, dtype=np.float32))


def test_hand_built_plain_types():
    f16 = np.array([1.0, -2.5, 65504.0, 2.0 ** -24, np.inf, -0.0], dtype="<f2")
    out = dequantize_bytes(f16.view(np.uint8), T.F16, (2, 3))
    np.testing.assert_array_equal(out.ravel(), [1.0, -2.5, 65504.0, 2.0 ** -24, np.inf, -0.0])
    # bfloat16 is the top half of a float32: 0x3F80 = 1.0, 0xC000 = -2.0, 0x4049 = 3.140625.
    bf16 = np.array([0x3F80, 0xC000, 0x4049], dtype="<u2")
    np.testing.assert_array_equal(dequantize_bytes(bf16, T.BF16, (3,)), [1.0, -2.0, 3.140625])
    f32 = np.array([1.5, -3.25e-20], dtype="<f4")
    out32 = dequantize_bytes(f32.view(np.uint8), T.F32, (2,))
    np.testing.assert_array_equal(out32, f32)
    assert out32.flags.writeable  # a copy, not a view into the (read-only) file


# --- 3. unsupported types --------------------------------------------------------------

@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.IQ4_XS, T.TQ1_0, T.MXFP4, T.Q8_1],
                         ids=lambda t: t.name)
def test_unsupported_type_names_type_and_tensor(qtype):
    raw = RawTensor("blk.0.attn_q.weight", qtype, (4, 256), np.zeros(4096, np.uint8))
    with pytest.raises(UnsupportedTensorType) as info:
        dequantize(raw)
    message = str(info.value)
    assert qtype.name in message and "blk.0.attn_q.weight" in message
    assert "Q4_K" in message and "BF16" in message  # lists what is supported
    assert isinstance(info.value, ValueError)


def test_unknown_type_id_is_unsupported():
    with pytest.raises(UnsupportedTensorType, match="unknown type id 999"):
        dequantize_bytes(np.zeros(8, np.uint8), 999, (2,))


# --- 4. real model files -----------------------------------------------------------------

MODELS = ["smollm2", "qwen25coder", "gemma3"]  # kinetic.fetch keys


@pytest.mark.real_model
@pytest.mark.parametrize("model", MODELS)
def test_real_model_tensors_match_gguf_py(model):
    path = real_model_file(model)
    f = GGUFFile(path)  # opening parses the whole vocabulary: most of this test's time
    smallest: dict[T, RawTensor] = {}  # one tensor per type: the smallest keeps this quick
    for t in f.tensors.values():
        if t.qtype not in smallest or t.data.nbytes < smallest[t.qtype].data.nbytes:
            smallest[t.qtype] = t
    assert len(smallest) >= 2
    for qtype, t in smallest.items():
        ours = dequantize(t)
        reference = gguf.quants.dequantize(t.data, qtype).astype(np.float32).reshape(t.shape)
        assert ours.shape == t.shape, t.name
        np.testing.assert_array_equal(ours, reference, err_msg=f"{t.name} ({qtype.name})")
