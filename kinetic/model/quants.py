"""Dequantizing GGUF tensors to float32 with numpy.

Every block format that real GGUF text models use is decoded here from its byte layout,
vectorized over all blocks at once (blocks are processed in cache-sized chunks, never one
at a time in Python). The results are bit-identical to ggml's reference dequantizers: in
every format the products `d * scale * q` are exact in float32 (or rounded once), so the
order of operations cannot change the last bit.

Layouts (all little-endian; "f16" is an IEEE half; QK_K = 256 elements per super-block):

    Q8_0  32 elems, 34 B: d f16 | qs int8[32]                 y = d*q
    Q4_0  32 elems, 18 B: d f16 | qs[16] (lo nibbles = elems 0..15, hi = 16..31)  y = d*(q-8)
    Q4_1  32 elems, 20 B: d f16 | m f16 | qs[16]              y = d*q + m
    Q5_0  32 elems, 22 B: d f16 | qh u32 (bit i = 5th bit of elem i) | qs[16]  y = d*(q-16)
    Q5_1  32 elems, 24 B: d f16 | m f16 | qh u32 | qs[16]     y = d*q + m
    Q2_K  256, 84 B:  scales[16] (lo 4 = scale, hi 4 = min) | qs[64] | d f16 | dmin f16
    Q3_K  256, 110 B: hmask[32] | qs[64] | scales[12] (16 x 6 bit) | d f16
    Q4_K  256, 144 B: d f16 | dmin f16 | scales[12] (8 x 6-bit scale + 8 x 6-bit min) | qs[128]
    Q5_K  256, 176 B: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
    Q6_K  256, 210 B: ql[128] | qh[64] | scales int8[16] | d f16
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from gguf import GGMLQuantizationType as T

from kinetic.model.gguf_file import RawTensor


class UnsupportedTensorType(ValueError):
    """A tensor whose GGML type kinetic cannot dequantize; the message names the type, the
    tensor and the supported types."""


_U8 = np.uint8
_F32 = np.float32

# Shift vectors, shaped to broadcast against a trailing axis of bytes.
_SHIFT_NIBBLES = np.array([0, 4], dtype=_U8).reshape(1, 1, 2, 1)
_SHIFT_CRUMBS = np.array([0, 2, 4, 6], dtype=_U8).reshape(1, 1, 4, 1)
_SHIFT_BITS8 = np.arange(8, dtype=_U8).reshape(1, 8, 1)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The little-endian half at byte `offset` of each block, as float32 of shape (n, 1)."""
    return blocks[:, offset:offset + 2].view("<f2").astype(_F32)


# --- 32-element legacy formats ---------------------------------------------------------

def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) uint8: low nibbles are elements 0..15, high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) uint8 with bit i at position i."""
    return np.unpackbits(qh, axis=1, bitorder="little")


# The _1 formats add their minimum m; as parts it is the minimum -m that _scaled subtracts
# (x - (-m) is x + m exactly).

def _q8_0_parts(b: np.ndarray) -> tuple:
    return b[:, 2:34].view(np.int8), _f16(b, 0), None


def _q4_0_parts(b: np.ndarray) -> tuple:
    return _nibbles32(b[:, 2:18]).view(np.int8) - np.int8(8), _f16(b, 0), None


def _q4_1_parts(b: np.ndarray) -> tuple:
    return _nibbles32(b[:, 4:20]), _f16(b, 0), -_f16(b, 2)


def _q5_0_parts(b: np.ndarray) -> tuple:
    q = (_nibbles32(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4)).view(np.int8) - np.int8(16)
    return q, _f16(b, 0), None


def _q5_1_parts(b: np.ndarray) -> tuple:
    return _nibbles32(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4), _f16(b, 0), -_f16(b, 2)


# --- 256-element K-quants ----------------------------------------------------------------

def _scaled(q: np.ndarray, scale: np.ndarray, minimum: np.ndarray | None,
            out: np.ndarray) -> None:
    """out = scale[g] * q - minimum[g] where g is the sub-block: q is (n, block) and scale,
    minimum are (n, G) float32 (G = 1 for the 32-element formats, 8 or 16 for the K-quants)."""
    groups = scale.shape[1]
    o = out.reshape(out.shape[0], groups, -1)
    np.multiply(q.reshape(o.shape), scale[:, :, None], out=o)
    if minimum is not None:
        o -= minimum[:, :, None]


def _q2_k_parts(b: np.ndarray) -> tuple:
    n = b.shape[0]
    sc = b[:, 0:16]
    # Element h*128 + j*32 + l is bits 2j..2j+1 of qs[h*32 + l].
    q = (b[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3
    d, dmin = _f16(b, 80), _f16(b, 82)
    return q.reshape(n, 256), d * (sc & 0x0F), dmin * (sc >> 4)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """(n, 12) packed bytes -> (n, 16) int8 signed scales (6-bit value minus 32).

    Scale k has its low 4 bits in byte k % 8 (low nibble for k < 8, high for k >= 8) and
    its high 2 bits in byte 8 + k % 4 at bit position 2 * (k // 4)."""
    n = s.shape[0]
    low = np.concatenate([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], axis=1)
    high = (s[:, 8:12].reshape(n, 1, 4) >> _SHIFT_CRUMBS.reshape(1, 4, 1)) & 3
    return (low | (high.reshape(n, 16) << 4)).view(np.int8) - np.int8(32)


def _q3_k_parts(b: np.ndarray) -> tuple:
    n = b.shape[0]
    # Element e = h*128 + j*32 + l: low 2 bits are bits 2j.. of qs[h*32 + l]; the 3rd bit is
    # bit (e // 32) of hmask[l], and a *clear* bit means "subtract 4".
    low = (b[:, 32:96].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3
    high = (b[:, 0:32].reshape(n, 1, 32) >> _SHIFT_BITS8) & 1
    q = (low.reshape(n, 256) | (high.reshape(n, 256) << 2)).view(np.int8) - np.int8(4)
    return q, _f16(b, 108) * _q3_k_scales(b[:, 96:108]), None


def _k4_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 12) packed bytes -> two (n, 8) uint8 arrays: the 6-bit scales and mins of the
    eight 32-element sub-blocks of Q4_K / Q5_K.

    Sub-blocks 0..3 keep scale and min in the low 6 bits of bytes 0..3 and 4..7; sub-blocks
    4..7 take their low 4 bits from the nibbles of bytes 8..11 and their high 2 bits from
    the top bits of bytes 0..3 (scales) and 4..7 (mins)."""
    first, second, third = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    scales = np.concatenate([first & 63, (third & 0x0F) | ((first >> 6) << 4)], axis=1)
    mins = np.concatenate([second & 63, (third >> 4) | ((second >> 6) << 4)], axis=1)
    return scales, mins


def _k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) bytes -> (n, 256): element c*64 + h*32 + l is nibble h of qs[c*32 + l]."""
    n = qs.shape[0]
    return ((qs.reshape(n, 4, 1, 32) >> _SHIFT_NIBBLES) & 0x0F).reshape(n, 256)


def _q4_k_parts(b: np.ndarray) -> tuple:
    scales, mins = _k4_scales_mins(b[:, 4:16])
    return _k4_nibbles(b[:, 16:144]), _f16(b, 0) * scales, _f16(b, 2) * mins


def _q5_k_parts(b: np.ndarray) -> tuple:
    n = b.shape[0]
    scales, mins = _k4_scales_mins(b[:, 4:16])
    # The 5th bit of element e is bit (e // 32) of qh[e % 32].
    high = ((b[:, 16:48].reshape(n, 1, 32) >> _SHIFT_BITS8) & 1).reshape(n, 256)
    q = _k4_nibbles(b[:, 48:176]) | (high << 4)
    return q, _f16(b, 0) * scales, _f16(b, 2) * mins


def _q6_k_parts(b: np.ndarray) -> tuple:
    n = b.shape[0]
    # Element e = h*128 + k*32 + l: low nibble is nibble k//2 of ql[h*64 + (k%2)*32 + l],
    # high 2 bits are bits 2k.. of qh[h*32 + l].
    low = (b[:, 0:128].reshape(n, 2, 1, 64) >> _SHIFT_NIBBLES) & 0x0F
    high = (b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3
    q = (low.reshape(n, 256) | (high.reshape(n, 256) << 4)).view(np.int8) - np.int8(32)
    return q, _f16(b, 208) * b[:, 192:208].view(np.int8), None


def _from_parts(parts: Callable[[np.ndarray], tuple]) -> Callable[[np.ndarray, np.ndarray],
                                                                  None]:
    """A block format's decoder from its integer parts: out = q * scale - minimum."""
    def decode(b: np.ndarray, out: np.ndarray) -> None:
        _scaled(*parts(b), out)
    return decode


# block format -> (q [n, block] integers, scale [n, G] float32, minimum [n, G] float32 or
# None) of its blocks: the value of element e is q * scale[g] - minimum[g], g = e // (block /
# G). The decoders below are these; the pallas kernel's planes are made from them too.
PARTS = {T.Q8_0: _q8_0_parts, T.Q4_0: _q4_0_parts, T.Q4_1: _q4_1_parts,
         T.Q5_0: _q5_0_parts, T.Q5_1: _q5_1_parts, T.Q2_K: _q2_k_parts,
         T.Q3_K: _q3_k_parts, T.Q4_K: _q4_k_parts, T.Q5_K: _q5_k_parts, T.Q6_K: _q6_k_parts}


# qtype -> (elements per block, bytes per block, decoder writing (n, elements) float32).
_BLOCK_FORMATS: dict[T, tuple[int, int, Callable[[np.ndarray, np.ndarray], None]]] = {
    T.Q8_0: (32, 34, _from_parts(_q8_0_parts)),
    T.Q4_0: (32, 18, _from_parts(_q4_0_parts)),
    T.Q4_1: (32, 20, _from_parts(_q4_1_parts)),
    T.Q5_0: (32, 22, _from_parts(_q5_0_parts)),
    T.Q5_1: (32, 24, _from_parts(_q5_1_parts)),
    T.Q2_K: (256, 84, _from_parts(_q2_k_parts)),
    T.Q3_K: (256, 110, _from_parts(_q3_k_parts)),
    T.Q4_K: (256, 144, _from_parts(_q4_k_parts)),
    T.Q5_K: (256, 176, _from_parts(_q5_k_parts)),
    T.Q6_K: (256, 210, _from_parts(_q6_k_parts)),
}

_PLAIN_FORMATS = {T.F32: 4, T.F16: 2, T.BF16: 2}  # qtype -> bytes per element

SUPPORTED: frozenset[T] = frozenset(_PLAIN_FORMATS) | frozenset(_BLOCK_FORMATS)

# About 256K output elements per chunk keeps every temporary within a few MB of cache.
_CHUNK_ELEMENTS = 1 << 18


_SUPPORTED_NAMES = frozenset(t.name for t in SUPPORTED)


def _type_name(qtype: object) -> str:
    """The GGML type's name ("Q4_K"), or a description of an id GGML does not define."""
    try:
        return T(int(qtype)).name  # type: ignore[call-overload]
    except (ValueError, TypeError):
        return f"unknown type id {qtype!r}"


def check_supported(qtype: T | int, name: str | None = None) -> None:
    """UnsupportedTensorType (naming the tensor, its type and the supported ones) unless
    kinetic can read this type."""
    if _type_name(qtype) not in _SUPPORTED_NAMES:
        what = f"tensor {name!r}" if name is not None else "tensor"
        raise UnsupportedTensorType(
            f"{what} has GGML type {_type_name(qtype)}, which kinetic cannot dequantize "
            f"(supported: {', '.join(t.name for t in sorted(SUPPORTED))})")


def block_size(qtype: T | int) -> int:
    """Values per block of a supported type (1 for the float types)."""
    qtype = T[_type_name(qtype)]
    return _BLOCK_FORMATS[qtype][0] if qtype in _BLOCK_FORMATS else 1


def block_bytes(qtype: T | int) -> int:
    """Bytes per block of a supported block format."""
    return _BLOCK_FORMATS[T[_type_name(qtype)]][1]


def dequantize(raw: RawTensor) -> np.ndarray:
    """The tensor's values as a new float32 array of shape `raw.shape`.

    Raises UnsupportedTensorType for a type outside SUPPORTED, ValueError when the byte
    count does not match the shape."""
    return dequantize_bytes(raw.data, raw.qtype, raw.shape, name=raw.name)


def dequantize_bytes(data: np.ndarray, qtype: T | int, shape: tuple[int, ...],
                     name: str | None = None) -> np.ndarray:
    """Decode `data` (the tensor's raw bytes, any dtype, C-contiguous or copyable) of GGML
    type `qtype` into a new float32 array of `shape` (numpy order, outermost first).

    `name` only serves error messages. Raises UnsupportedTensorType for a type outside
    SUPPORTED, ValueError when the bytes do not fit the shape."""
    what = f"tensor {name!r}" if name is not None else "tensor"
    check_supported(qtype, name)
    qtype = T[_type_name(qtype)]
    shape = tuple(int(d) for d in shape)
    n_elements = int(np.prod(shape, dtype=np.int64))
    buf = np.ascontiguousarray(data).reshape(-1).view(_U8)

    if qtype in _PLAIN_FORMATS:
        _check_size(what, qtype, shape, buf.size, n_elements * _PLAIN_FORMATS[qtype])
        if qtype == T.F32:
            return buf.view("<f4").astype(_F32).reshape(shape)  # astype copies: ours to keep
        if qtype == T.F16:
            return buf.view("<f2").astype(_F32).reshape(shape)
        # bfloat16 is the upper half of a float32.
        return (buf.view("<u2").astype(np.uint32) << 16).view(_F32).reshape(shape)

    block, block_bytes, decode = _BLOCK_FORMATS[qtype]
    if not shape or shape[-1] % block:
        raise ValueError(f"{what}: shape {shape} does not fit {qtype.name}: the last "
                         f"dimension must be a multiple of its block size {block}")
    n_blocks = n_elements // block
    _check_size(what, qtype, shape, buf.size, n_blocks * block_bytes)
    blocks = buf.reshape(n_blocks, block_bytes)
    out = np.empty((n_blocks, block), dtype=_F32)
    step = max(1, _CHUNK_ELEMENTS // block)
    # A NaN or inf scale (a damaged file) propagates into its block as in ggml, silently.
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, n_blocks, step):
            decode(blocks[start:start + step], out[start:start + step])
    return out.reshape(shape)


def _check_size(what: str, qtype: T, shape: tuple[int, ...], have: int, need: int) -> None:
    if have != need:
        raise ValueError(f"{what}: {qtype.name} data of shape {shape} needs {need} bytes, "
                         f"got {have}")
