"""The numpy reference of kinetic's C++ quantized matmul (csrc/): what a reader checks the
C++ against, and what tests/test_kernel_reference.py holds it to, bit for bit.

y[M, N] = x[M, K] . W[N, K]^T, W in a GGUF block format, in three steps:

1. Unpack (formats.cc). A weight block becomes small integers q, already offset (Q4_0
   holds q - 8, Q5_0 q - 16, Q3_K q - 4 where its hmask bit is clear, Q6_K q - 32), the
   block scale d and the min m (Q4_1, Q5_1) or dmin (Q2_K, Q4_K, Q5_K); K-quants also
   carry an integer scale sc (and min mn) per sub-block. Halves are decoded exactly.

2. Round the activations (quantize.cc) as llama.cpp's CPU backend does for each weight.
   q8_0 (Q4_0, Q5_0, Q8_0): blocks of 32; amax = the largest |x| (fmax: NaN is skipped);
     db = amax / 127; q = clamp(rint(x * (1 / db)), -127, 127), 0 when db = 0 and for a
     NaN product; the scale kept is d = f16(db).
   q8_1 (Q4_1, Q5_1): q8_0 plus s = f16(db * float(sum of the block's q)), unrounded db.
   q8_K (K-quants): blocks of 256; max = the FIRST value of the largest magnitude, signed;
     iscale = -127 / max; q = clamp(rint(iscale * x)); d = 1 / iscale (zeros when max = 0);
     bsum = the sums of each 16 q.
   f32 / f16 / bf16 (float weights): x as is or rounded to nearest even. rint: half to even.

3. Combine (qmatmul.h, qmatmul_ref.cc). Integer sums per block (exact: int32 in C++,
   int64 here, checked to fit int32), then one fixed float32 sequence per output element:
   acc = 0, and for each block b in order
     q8_1 formats:       acc = acc + (float(sumi) * (dw * dx) + mw * sx)
     K-quants with mins: acc = acc + (float(sumi) * (dw * dx) - float(summ) * (mw * dx))
     the others:         acc = acc + float(sumi) * (dw * dx)
   sumi = weight . activation integers (K-quants: sum over sub-blocks of sc * dot), summ =
   sum over sub-blocks of mn * (the sub-block's activation sum, from bsum); dw, mw: the
   weight block's d, m; dx, sx: the activation block's d, s.
   Float weights: 16 lanes; x[k] * w[k] (rounded) is added to lane k % 16 in order of k,
   then lane i += lane i + 8, then + 4, + 2, + 1; the result is lane 0.

A repacked weight (fmt | REPACK16, repack16 below) is the same blocks in another order:
the same results.

Dequantized rows (dequant.cc): float(q) * d (+ m), or float(q) * (d * float(sc)) (- dmin *
float(mn)) for K-quants. All float math is float32 (nothing promotes to float64).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16 = 10, 11, 12, 13, 14, 30
_f32 = np.float32

# formats.h FormatInfo: values and bytes per block, values per sub-block with its own integer
# scale (= qk when none), the activation rounding, whether the block has a min.
Format = namedtuple("Format", "qk bytes sub act has_min")
FORMATS = {  # formats.cc format_info
    Q4_0: Format(32, 18, 32, "q8_0", False), Q4_1: Format(32, 20, 32, "q8_1", True),
    Q5_0: Format(32, 22, 32, "q8_0", False), Q5_1: Format(32, 24, 32, "q8_1", True),
    Q8_0: Format(32, 34, 32, "q8_0", False), Q2_K: Format(256, 84, 16, "q8_K", True),
    Q3_K: Format(256, 110, 16, "q8_K", False), Q4_K: Format(256, 144, 32, "q8_K", True),
    Q5_K: Format(256, 176, 32, "q8_K", True), Q6_K: Format(256, 210, 16, "q8_K", False),
    F32: Format(1, 4, 1, "f32", False), F16: Format(1, 2, 1, "f16", False),
    BF16: Format(1, 2, 1, "bf16", False),
}


def format_info(fmt: int) -> Format:
    if fmt & REPACK16 and fmt & ~REPACK16 in REPACKABLE:
        return FORMATS[fmt & ~REPACK16]
    if fmt not in FORMATS:
        raise ValueError(f"GGML type {fmt} is not one the kernel multiplies")
    return FORMATS[fmt]


def _rows(fmt: int, data, n: int, k: int) -> np.ndarray:
    """data as uint8 [n, row bytes], after the checks of check_matmul (qmatmul.cc)."""
    f = format_info(fmt)
    if n <= 0 or k <= 0 or k % f.qk:
        raise ValueError(f"n = {n}, K = {k}: empty, or K is not a multiple of the format's "
                         f"block size {f.qk}")
    buf = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    need = n * (k // f.qk) * f.bytes
    if buf.size < need:
        raise ValueError(f"{buf.size} bytes cannot hold {n} rows of {need // n} bytes")
    return buf[:need].reshape(n, need // n)


# --- the 16-column layout (repack.h, repack.cc) ---------------------------------------------

REPACK16 = 256  # format id flag
# a plain block's bytes and where it keeps m, qh and qs (None: absent)
REPACK_FIELDS = {Q4_0: (18, None, None, 2), Q4_1: (20, 2, None, 4), Q5_0: (22, None, 2, 6),
                 Q5_1: (24, 2, 4, 8), Q8_0: (34, None, None, 2)}
KQUANTS = (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)   # repacked word by word (repack.h)
REPACKABLE = tuple(REPACK_FIELDS) + KQUANTS


def _grouped(fmt: int, data, n: int, k: int) -> tuple[np.ndarray, int, int]:
    """(a copy of the n rows' bytes, flat; the whole groups of 16 rows; blocks per row)."""
    return _rows(fmt, data, n, k).reshape(-1).copy(), n // 16, k // FORMATS[fmt].qk


def _kquant_words(fmt: int, data, n: int, k: int, pack: bool) -> np.ndarray:
    """A K-quant weight's groups in (pack) or out of repack.h's word layout: block b of a
    group is its 16 columns' blocks word by word (byte 4c + i of vector w: byte 4w + i of
    column c's block), then the 2 bytes left of each block (Q3_K, Q6_K), column after column."""
    out, G, nb = _grouped(fmt, data, n, k)
    size = FORMATS[fmt].bytes
    W, n16 = size // 4, 16 * G * nb * size
    if G == 0:
        return out
    if pack:
        g = out[:n16].reshape(G, 16, nb, size).transpose(0, 2, 1, 3)              # [G, nb, c, B]
        words = g[..., :4 * W].reshape(G, nb, 16, W, 4).transpose(0, 1, 3, 2, 4)
        parts = [words.reshape(G, nb, 64 * W), g[..., 4 * W:].reshape(G, nb, -1)]
        out[:n16] = np.concatenate(parts, axis=-1).reshape(-1)
    else:
        blocks = out[:n16].reshape(G, nb, 16 * size)
        words = blocks[..., :64 * W].reshape(G, nb, W, 16, 4).transpose(0, 1, 3, 2, 4)
        plain = np.concatenate([words.reshape(G, nb, 16, 4 * W),
                                blocks[..., 64 * W:].reshape(G, nb, 16, size - 4 * W)], axis=-1)
        out[:n16] = plain.transpose(0, 2, 1, 3).reshape(-1)
    return out


def repack16(fmt: int, data, n: int, k: int) -> np.ndarray:
    """The n rows' bytes in the 16-column layout (fmt | REPACK16), as uint8: rows [0, n16)
    (n16 = n // 16 * 16) in groups of 16; block b of a group is d[16] (u16), m[16] where the
    format has a min, hi[8] (u64: bit 4c + i of hi[j] is the 5th bit of column c's value 4j +
    i) where it has 5th bits, then the values: byte 4c + i of vector j is column c's qs byte 4j
    + i (Q8_0: 8 vectors, each byte xor 0x80; the 4-bit formats: 4, two values a byte).
    The K-quants: _kquant_words' layout."""
    if fmt in KQUANTS:
        return _kquant_words(fmt, data, n, k, pack=True)
    size, m_at, qh_at, qs_at = REPACK_FIELDS[fmt]
    out, G, nb = _grouped(fmt, data, n, k)
    if G == 0:
        return out
    n16 = 16 * G
    g = out[:n16 * nb * size].reshape(G, 16, nb, size).transpose(0, 2, 1, 3)  # [G, nb, c, B]
    parts = [g[..., 0:2].reshape(G, nb, 32)]
    if m_at is not None:
        parts.append(g[..., m_at:m_at + 2].reshape(G, nb, 32))
    if qh_at is not None:
        qh = g[..., qh_at:qh_at + 4].copy().view("<u4")[..., 0].astype(np.uint64)  # [G, nb, c]
        nibble = (qh[..., None] >> (4 * np.arange(8, dtype=np.uint64))) & 0xF      # [.., c, j]
        at = (4 * np.arange(16, dtype=np.uint64))[:, None]                       # c's place
        hi = np.bitwise_or.reduce(nibble << at, axis=-2)                          # [G, nb, j]
        parts.append(hi.astype("<u8").view(np.uint8).reshape(G, nb, 64))
    words = 8 if fmt == Q8_0 else 4
    qs = g[..., qs_at:qs_at + 4 * words].reshape(G, nb, 16, words, 4).transpose(0, 1, 3, 2, 4)
    parts.append((qs ^ 0x80 if fmt == Q8_0 else qs).reshape(G, nb, 64 * words))
    out[:n16 * nb * size] = np.concatenate(parts, axis=-1).reshape(-1)
    return out


def unrepack16(fmt: int, data, n: int, k: int) -> np.ndarray:
    """repack16 undone: the plain rows' bytes of a repacked weight (fmt plain)."""
    if fmt in KQUANTS:
        return _kquant_words(fmt, data, n, k, pack=False)
    size, m_at, qh_at, qs_at = REPACK_FIELDS[fmt]
    out, G, nb = _grouped(fmt, data, n, k)
    if G == 0:
        return out
    n16 = 16 * G
    blocks = out[:n16 * nb * size].reshape(G, nb, 16 * size)
    plain = np.zeros((G, nb, 16, size), np.uint8)
    plain[..., 0:2] = blocks[..., 0:32].reshape(G, nb, 16, 2)
    at = 32
    if m_at is not None:
        plain[..., m_at:m_at + 2] = blocks[..., at:at + 32].reshape(G, nb, 16, 2)
        at += 32
    if qh_at is not None:
        hi = blocks[..., at:at + 64].copy().view("<u8")                           # [G, nb, j]
        nibble = (hi[..., None, :] >> (4 * np.arange(16, dtype=np.uint64))[:, None]) & 0xF
        qh = np.bitwise_or.reduce(nibble << (4 * np.arange(8, dtype=np.uint64)), axis=-1)
        plain[..., qh_at:qh_at + 4] = qh.astype("<u4").view(np.uint8).reshape(G, nb, 16, 4)
        at += 64
    words = 8 if fmt == Q8_0 else 4
    qs = blocks[..., at:at + 64 * words].reshape(G, nb, words, 16, 4).transpose(0, 1, 3, 2, 4)
    plain[..., qs_at:qs_at + 4 * words] = (qs ^ 0x80 if fmt == Q8_0 else qs).reshape(
        G, nb, 16, 4 * words)
    out[:n16 * nb * size] = plain.transpose(0, 2, 1, 3).reshape(-1)
    return out


def _plain(fmt: int, data, n: int, k: int):
    """(the plain format, its bytes) of a weight, repacked or not."""
    if fmt & REPACK16:
        format_info(fmt)   # a known repackable format
        return fmt & ~REPACK16, unrepack16(fmt & ~REPACK16, data, n, k)
    return fmt, data


# --- conversions (common.h) and 1. unpack (formats.cc) -------------------------------------

def f16_to_f32(h) -> np.ndarray:
    """IEEE half bits -> float32, exact for every input (as common.h's f16_to_f32)."""
    h = np.asarray(h, np.uint16).astype(np.uint32)
    sign, exp, man = (h & 0x8000) << 16, (h >> 10) & 0x1F, h & 0x3FF
    bits = np.where(exp == 0x1F, sign | 0x7F800000 | (man << 13),
                    sign | ((exp + 112) << 23) | (man << 13)).astype(np.uint32).view(_f32)
    sub = man.astype(_f32) * _f32(1.0 / 16777216.0)  # exp == 0: man * 2^-24, exact
    return np.where(exp == 0, np.where(sign != 0, -sub, sub), bits).astype(_f32)


def round_f16(v) -> np.ndarray:
    """float32 -> nearest-even half -> float32. A NaN becomes the quiet NaN sign|0x7FC00000,
    as common.h's f32_to_f16 writes sign|0x7E00 whatever the payload."""
    v = np.asarray(v, _f32)
    with np.errstate(over="ignore", invalid="ignore"):
        r = v.astype(np.float16).astype(_f32)
    nan = (v.view(np.uint32) & 0x80000000) | np.uint32(0x7FC00000)
    return np.where(np.isnan(v), nan.view(_f32), r)


def round_bf16(v) -> np.ndarray:
    """float32 -> nearest-even bfloat16 -> float32; a NaN keeps its top bits, quieted."""
    u = np.asarray(v, _f32).view(np.uint32)
    nan = ((u >> 16) | 0x40) << 16
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16) << 16
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, nan, rounded).astype(np.uint32).view(_f32)


def _legacy32(qs: np.ndarray, qh: np.ndarray | None, offset: int) -> np.ndarray:
    """Element i < 16 is the low nibble of qs[i], i + 16 the high nibble; bit i of the
    little-endian u32 qh is bit 4 of element i."""
    v = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int16)
    if qh is not None:
        h = qh.copy().view("<u4").astype(np.uint32)  # (blocks, 1)
        v |= (((h >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.int16)
    return (v - offset).astype(np.int8)


def _k4_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and mins of the 8 sub-blocks of Q4_K / Q5_K from 12 packed bytes."""
    s = s.astype(np.int32)
    j = np.arange(4, 8)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, j + 4] & 0x0F) | ((s[:, j - 4] >> 6) << 4)], 1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, j + 4] >> 4) | ((s[:, j] >> 6) << 4)], 1)
    return sc, mn


def unpack(fmt: int, data, n: int, k: int):
    """Every block of W [n, k] as (q int8 [n, nb, qk], d float32 [n, nb], m float32 [n, nb],
    sc int32 [n, nb, groups], mn int32 [n, nb, groups]); groups = qk / sub, and sc / mn are
    zero where the format has none (as unpack_block leaves them)."""
    f = format_info(fmt)
    if f.qk == 1:
        raise ValueError("float formats have no blocks to unpack")
    nb, groups = k // f.qk, f.qk // f.sub
    b = _rows(fmt, data, n, k).reshape(n * nb, f.bytes)
    f16 = lambda off: f16_to_f32(b[:, off:off + 2].copy().view("<u2")[:, 0])
    m = np.zeros(n * nb, _f32)  # stays 0 where the format has no min
    sc, mn = np.zeros((2, n * nb, groups), np.int32)
    e = np.arange(256)
    # d f16 at 0 | (m f16 at 2) | (qh u32 at qh_at) | qs[16] at qs_at; values minus offset
    legacy = {Q4_0: (2, None, 8), Q4_1: (4, None, 0), Q5_0: (6, 2, 16), Q5_1: (8, 4, 0)}
    if fmt in legacy:
        qs_at, qh_at, offset = legacy[fmt]
        qh = b[:, qh_at:qh_at + 4] if qh_at else None
        q, d = _legacy32(b[:, qs_at:qs_at + 16], qh, offset), f16(0)
        m = f16(2) if f.has_min else m
    elif fmt == Q8_0:
        q, d = b[:, 2:34].view(np.int8), f16(0)
    elif fmt == Q2_K:  # scales[16] | qs[64] | d | dmin
        h, j, l = e // 128, (e % 128) // 32, e % 32
        q = ((b[:, 16:80][:, h * 32 + l] >> (2 * j)) & 3).astype(np.int8)
        sc[:], mn[:] = b[:, 0:16] & 0x0F, b[:, 0:16] >> 4
        d, m = f16(80), f16(82)
    elif fmt == Q3_K:  # hmask[32] | qs[64] | scales[12] | d; a clear hmask bit: minus 4
        h, j, l = e // 128, (e % 128) // 32, e % 32
        low = (b[:, 32:96][:, h * 32 + l] >> (2 * j)) & 3
        high = (b[:, 0:32][:, l] >> (e // 32)) & 1
        q = (low.astype(np.int16) - np.where(high != 0, 0, 4)).astype(np.int8)
        s, kk = b[:, 96:108].astype(np.int32), np.arange(16)
        lo = np.where(kk < 8, s[:, kk % 8] & 0x0F, s[:, kk % 8] >> 4)
        hi = (s[:, 8 + kk % 4] >> (2 * (kk // 4))) & 3
        sc[:] = (lo | (hi << 4)) - 32
        d = f16(108)
    elif fmt in (Q4_K, Q5_K):  # d | dmin | scales[12] | (Q5_K: qh[32]) | qs[128]
        c, h, l = e // 64, (e % 64) // 32, e % 32
        qs = b[:, 16:144] if fmt == Q4_K else b[:, 48:176]
        v = (qs[:, c * 32 + l] >> (4 * h)) & 0x0F
        if fmt == Q5_K:
            v = v | (((b[:, 16:48][:, e % 32] >> (e // 32)) & 1) << 4)
        q = v.astype(np.int8)
        sc[:], mn[:] = _k4_scale_min(b[:, 4:16])
        d, m = f16(0), f16(2)
    elif fmt == Q6_K:  # ql[128] | qh[64] | scales int8[16] | d
        h, kq, l = e // 128, (e % 128) // 32, e % 32
        lo = (b[:, 0:128][:, h * 64 + (kq % 2) * 32 + l] >> (4 * (kq // 2))) & 0x0F
        hi = (b[:, 128:192][:, h * 32 + l] >> (2 * kq)) & 3
        q = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)
        sc[:] = b[:, 192:208].view(np.int8)
        d = f16(208)
    return (q.reshape(n, nb, f.qk), d.reshape(n, nb), m.reshape(n, nb),
            sc.reshape(n, nb, groups), mn.reshape(n, nb, groups))


def dequantize(fmt: int, data, n: int, k: int) -> np.ndarray:
    """W as float32 [n, k], the values of dequant.cc (weight_value for float formats)."""
    fmt, data = _plain(fmt, data, n, k)
    f = format_info(fmt)
    rows = _rows(fmt, data, n, k)
    if f.qk == 1:
        if fmt == F32:
            return rows.copy().view("<f4").astype(_f32)
        bits = rows.copy().view("<u2")
        return f16_to_f32(bits) if fmt == F16 else (bits.astype(np.uint32) << 16).view(_f32)
    q, d, m, sc, mn = unpack(fmt, data, n, k)
    qf = q.astype(_f32)
    if f.qk == 32:
        out = qf * d[..., None] + m[..., None] if f.has_min else qf * d[..., None]
    else:
        g = np.arange(f.qk) // f.sub  # the sub-block of each value
        scale = d[..., None] * sc[..., g].astype(_f32)
        out = qf * scale - m[..., None] * mn[..., g].astype(_f32) if f.has_min else qf * scale
    return out.reshape(n, k)


# --- 2. activation rounding (quantize.cc) --------------------------------------------------

# quantize.h QuantActs: q int8 [M, K], d float32 [M, K / block], s (q8_1) float32 [M, K / 32],
# bsum (q8_K) int32 [M, K / 16], f (float kinds) float32 [M, K]; None where a kind has none.
QuantActs = namedtuple("QuantActs", "kind q d s bsum f")


def _to_q(v: np.ndarray) -> np.ndarray:
    """nearbyint (half to even), NaN -> 0, clamped to [-127, 127], as int8."""
    v = np.rint(v)
    return np.clip(np.where(np.isnan(v), _f32(0), v), _f32(-127), _f32(127)).astype(np.int8)


def quantize_acts(kind: str, x) -> QuantActs:
    x = np.ascontiguousarray(x, _f32)
    M, K = x.shape
    if kind in ("f32", "f16", "bf16"):
        f = x.copy() if kind == "f32" else round_f16(x) if kind == "f16" else round_bf16(x)
        return QuantActs(kind, None, None, None, None, f)
    block = 256 if kind == "q8_K" else 32
    if K % block:
        raise ValueError(f"K = {K} is not a multiple of {block}")
    xb = x.reshape(M, K // block, block)
    with np.errstate(all="ignore"):
        if kind == "q8_K":
            a = np.abs(xb)
            first = np.argmax(np.where(np.isnan(a), _f32(0), a), axis=-1)[..., None]
            amax = np.take_along_axis(a, first, -1)[..., 0]
            vmax = np.take_along_axis(xb, first, -1)[..., 0]  # the first largest, signed
            nz = (amax > 0) & ~np.isnan(amax)
            iscale = _f32(-127) / np.where(nz, vmax, _f32(1))
            q = np.where(nz[..., None], _to_q(iscale[..., None] * xb), np.int8(0))
            d = np.where(nz, _f32(1) / iscale, _f32(0)).astype(_f32)
            bsum = q.reshape(M, K // 16, 16).astype(np.int32).sum(-1, dtype=np.int32)
            return QuantActs(kind, q.reshape(M, K), d, None, bsum, None)
        amax = np.fmax.reduce(np.abs(xb), axis=-1, initial=_f32(0))  # fmax skips NaN
        db = amax / _f32(127)
        inv = np.where(db > 0, _f32(1) / db, _f32(0)).astype(_f32)
        q = _to_q(xb * inv[..., None])
        total = q.astype(np.int32).sum(-1, dtype=np.int32)  # q8_1: s = f16(db * float(sum))
        s = round_f16(db * total.astype(_f32)) if kind == "q8_1" else None
        return QuantActs(kind, q.reshape(M, K), round_f16(db), s, None, None)


def hadamard(x, n: int) -> np.ndarray:
    """csrc/hadamard.h: each block of n values of the last axis through the butterflies
    (a + b, a - b) for h = 1, 2 ... n/2, then times float32(1 / sqrt(n)), in float32."""
    x = np.asarray(x, _f32)
    v = x.reshape(-1, n).copy()
    h = 1
    while h < n:
        v = v.reshape(-1, n // (2 * h), 2, h)
        a, b = v[:, :, 0].copy(), v[:, :, 1].copy()
        v[:, :, 0], v[:, :, 1] = a + b, a - b
        h *= 2
    return (v.reshape(x.shape) * _f32(1 / np.sqrt(n))).astype(_f32)


def q8_0_blocks(x) -> np.ndarray:
    """x [..., n] (n a multiple of 32) as a q8_0 KV cache stores it (csrc/kvwrite.cc): per
    block of 32 quantize_acts("q8_0")'s q and d, as bytes: d's f16 bits, then the 32 int8
    q, GGUF's Q8_0 block; uint8 [..., n / 32 * 34]."""
    x = np.ascontiguousarray(x, _f32)
    rows = x.reshape(-1, x.shape[-1])
    a = quantize_acts("q8_0", rows)
    f = FORMATS[Q8_0]
    nb = rows.shape[1] // f.qk
    d = a.d.astype(np.float16).view(np.uint8).reshape(len(rows), nb, 2)
    q = a.q.view(np.uint8).reshape(len(rows), nb, f.qk)
    return np.concatenate([d, q], axis=-1).reshape(*x.shape[:-1], nb * f.bytes)


def q8_0_values(b) -> np.ndarray:
    """q8_0 blocks uint8 [..., n / 32 * 34] as float32 [..., n]: dequantize's d * q, exact."""
    b = np.ascontiguousarray(b, np.uint8)
    f = FORMATS[Q8_0]
    width, n = b.shape[-1], b.shape[-1] // f.bytes * f.qk
    return dequantize(Q8_0, b, b.size // width, n).reshape(*b.shape[:-1], n)


# --- 3. the matmul (qmatmul.h combine, qmatmul_ref.cc) -------------------------------------

def _float_matmul(w: np.ndarray, xf: np.ndarray) -> np.ndarray:
    """The 16-lane scheme: lane k % 16 accumulates x[k] * w[k] in order of k; then halving."""
    M, K = xf.shape
    lanes = np.zeros((M, w.shape[0], 16), _f32)
    with np.errstate(all="ignore"):
        for k0 in range(0, K, 16):
            width = min(16, K - k0)
            prod = xf[:, None, k0:k0 + width] * w[None, :, k0:k0 + width]
            lanes[..., :width] = lanes[..., :width] + prod
        for half in (8, 4, 2, 1):
            lanes[..., :half] = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0].copy()


def qmatmul(fmt: int, data, n: int, k: int, x) -> np.ndarray:
    """x [M, k] . W^T as float32 [M, n], bit for bit what the C++ kernel returns."""
    fmt, data = _plain(fmt, data, n, k)
    f = format_info(fmt)
    x = np.ascontiguousarray(x, _f32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}], got {x.shape}")
    _rows(fmt, data, n, k)  # the shape and size checks
    acts = quantize_acts(f.act, x)
    if f.qk == 1:
        return _float_matmul(dequantize(fmt, data, n, k), acts.f)
    M, nb, G = x.shape[0], k // f.qk, f.qk // f.sub
    q, d, m, sc, mn = unpack(fmt, data, n, k)
    xq = acts.q.reshape(M, nb, G, f.sub).astype(np.int64)
    dots = np.einsum("mbgi,nbgi->mnbg", xq, q.reshape(n, nb, G, f.sub).astype(np.int64))
    sumi, summ = dots[..., 0], None  # one plain dot per block
    if f.act == "q8_K":
        sumi = (dots * sc[None].astype(np.int64)).sum(-1)
        xs = acts.bsum.reshape(M, nb, G, f.sub // 16).astype(np.int64).sum(-1)
        summ = np.einsum("mbg,nbg->mnb", xs, mn.astype(np.int64))
    summ = np.zeros_like(sumi) if summ is None else summ
    # The C++ holds these in int32 (and they fit); float(int32) rounds as the C++ converts.
    assert max(np.abs(sumi).max(), np.abs(summ).max()) < 2**31, "int32 overflow"
    sumi_f, summ_f = sumi.astype(np.int32).astype(_f32), summ.astype(np.int32).astype(_f32)
    acc = np.zeros((M, n), _f32)
    with np.errstate(all="ignore"):
        for b in range(nb):
            dw, mw, dx = d[None, :, b], m[None, :, b], acts.d[:, b, None]
            if f.act == "q8_1":
                acc = acc + (sumi_f[..., b] * (dw * dx) + mw * acts.s[:, b, None])
            elif f.has_min:
                acc = acc + (sumi_f[..., b] * (dw * dx) - summ_f[..., b] * (mw * dx))
            else:
                acc = acc + sumi_f[..., b] * (dw * dx)
    return acc


# --- the row norms (rownorm.cc) -------------------------------------------------------------

def _lane_sum(v: np.ndarray) -> np.ndarray:
    """Sum over the last axis as the C++ does: value d into lane d % 16 in order of d, then
    lane i += lane i + 8, + 4, + 2, + 1."""
    lanes = np.zeros((*v.shape[:-1], 16), _f32)
    for k0 in range(0, v.shape[-1], 16):
        width = min(16, v.shape[-1] - k0)
        lanes[..., :width] = lanes[..., :width] + v[..., k0:k0 + width]
    for half in (8, 4, 2, 1):
        lanes[..., :half] = lanes[..., :half] + lanes[..., half:2 * half]
    return lanes[..., 0]


def rms_norm(x, w, eps: float) -> np.ndarray:
    """(x * (1 / sqrt(mean(x * x) + eps))) * w per row of x [..., D], float32 throughout, the
    mean's sum in 16 lanes: bit for bit the C++ RMS norm (ffi.rms_norm)."""
    x = np.asarray(x, _f32)
    w, d = np.asarray(w, _f32), _f32(x.shape[-1])
    with np.errstate(all="ignore"):
        inv = (_f32(1) / np.sqrt(_lane_sum(x * x) / d + _f32(eps)))[..., None]
        return (x * inv) * w


def layer_norm(x, w, b, eps: float) -> np.ndarray:
    """((x - mean) * (1 / sqrt(var + eps))) * w + b per row of x [..., D], float32 throughout:
    bit for bit the C++ layer norm (ffi.layer_norm)."""
    x = np.asarray(x, _f32)
    w, b, d = np.asarray(w, _f32), np.asarray(b, _f32), _f32(x.shape[-1])
    with np.errstate(all="ignore"):
        mean = (_lane_sum(x) / d)[..., None]
        c = x - mean
        inv = (_f32(1) / np.sqrt(_lane_sum(c * c) / d + _f32(eps)))[..., None]
        return (c * inv) * w + b


def row_argmax(x, ids=None, values=None, mask=None) -> np.ndarray:
    """argmax.h in numpy: per row, y = (the mask allows t ? x[t], NaN read as -inf : -inf)
    plus the value of the bias pair naming t (ids outside [0, V) unused), NaN read as -inf;
    the first index of the largest y, -1 where that value is not finite."""
    x = np.asarray(x, np.float32)
    B, V = x.shape
    y = np.where(np.isnan(x), -np.inf, x)
    if mask is not None:
        bits = (np.asarray(mask, np.int32).view(np.uint32)[:, :, None]
                >> np.arange(32, dtype=np.uint32)) & 1
        y = np.where(bits.reshape(B, -1)[:, :V] == 1, y, -np.inf).astype(np.float32)
    if ids is not None:
        ids, values = np.asarray(ids), np.asarray(values, np.float32)
        rows, cols = np.nonzero((ids >= 0) & (ids < V))
        with np.errstate(invalid="ignore"):
            y[rows, ids[rows, cols]] = y[rows, ids[rows, cols]] + values[rows, cols]
    clean = np.where(np.isnan(y), -np.inf, y)
    top = clean.max(axis=1)
    first = np.argmax(clean == top[:, None], axis=1)
    return np.where(np.isfinite(top), first, -1).astype(np.int32)


def _exp_f(x) -> np.ndarray:
    """exp as csrc/delta_rule.cc computes it: in double, rounded to float."""
    return np.exp(np.asarray(x, np.float32).astype(np.float64)).astype(np.float32)


# exp_softmax's constants (csrc/exp_f32.h): Cephes' expf polynomial
_LOG2E, _MAGIC = np.float32(1.44269504088896341), np.float32(12582912.0)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_P = [np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                  4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)]
_EXP_LOW = np.float32(-86.0)


def exp_softmax(x) -> np.ndarray:
    """The kernel's exp of x = score - max <= 0 (csrc/exp_f32.h: the attention's softmax and swiglu's sigmoid), in the
    same float32 operations, each rounded on its own: n = round(x log2 e) by adding 1.5 * 2^23,
    r = x - n ln2 in two parts, Cephes' polynomial p(r), then n added to p's exponent bits;
    0 below -86 and for a NaN. Within 2 ulp of e^x."""
    x = np.asarray(x, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        t = x * _LOG2E + _MAGIC
        n = t - _MAGIC
        shift = (t.view(np.uint32) - _MAGIC.view(np.uint32)) << np.uint32(23)
        r = x - n * _LN2_HI
        r = r - n * _LN2_LO
        z = r * r
        p = r * _EXP_P[0] + _EXP_P[1]
        for c in _EXP_P[2:]:
            p = p * r + c
        p = p * z + r
        p = p + np.float32(1.0)
        bits = np.where(x >= _EXP_LOW, p.view(np.uint32) + shift, np.uint32(0))
    return bits.astype(np.uint32).view(np.float32)


def exp_any(x) -> np.ndarray:
    """e^x for any x (csrc/exp_f32.h exp_any): exp_softmax's sequence up to x = 88, +inf
    above, 0 below -86 and for a NaN."""
    x = np.asarray(x, np.float32)
    big = x > np.float32(88.0)
    e = exp_softmax(np.where(big, np.float32(0.0), x))
    return np.where(big, np.float32(np.inf), e).astype(np.float32)


def swiglu(g, u) -> np.ndarray:
    """silu(g) * u elementwise in csrc/glu.h's float32 sequence, each operation rounded on
    its own: (g * (1 / (1 + exp_any(-g)))) * u."""
    g, u = np.asarray(g, np.float32), np.asarray(u, np.float32)
    one = np.float32(1.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        s = one / (one + exp_any(-g))
        return ((g * s) * u).astype(np.float32)


def delta_rule(taps, windows, matrices, pending, events, rows, replay, n_replay: int,
               heads: int, key_heads: int, eps: float):
    """csrc/delta_rule.h in numpy, the same operations in the same order (every sum over
    its index in order; exp in double, rounded): (out [T, H, d], windows, matrices,
    pending), the three states as new arrays. rows [4, T]: read, write, slot, pend;
    replay [2, R]: slot, idx."""
    f32 = np.float32
    windows, matrices, pending = (np.array(a, f32) for a in (windows, matrices, pending))
    taps, events = np.asarray(taps, f32), np.asarray(events, f32)
    read, write, slot, pend = np.asarray(rows)
    C, n_taps = taps.shape
    H, Hk, d = heads, key_heads, matrices.shape[-1]
    T, K = events.shape[0], pending.shape[1] - 1
    out = np.zeros((T, H, d), f32)
    scale = f32(1.0 / np.sqrt(np.float64(d)))
    for i in range(n_replay + T):
        is_row = i >= n_replay
        r = i - n_replay
        src, dst = (read[r], write[r]) if is_row else (replay[0][i], replay[0][i])
        event = (events[r] if is_row else pending[replay[0][i], replay[1][i]]).copy()
        mixed, g, beta = event[:C], event[C:C + H], event[C + H:]
        window, m = windows[src].copy(), matrices[src].copy()
        full = np.concatenate([window, mixed[None]], axis=0)
        conv = full[0] * taps[:, 0]
        for j in range(1, n_taps):
            conv = conv + full[j] * taps[:, j]
        conv = conv * (f32(1) / (f32(1) + _exp_f(-conv)))
        q = conv[:Hk * d].reshape(Hk, d).copy()
        k = conv[Hk * d:2 * Hk * d].reshape(Hk, d).copy()
        v = conv[2 * Hk * d:].reshape(H, d)
        for x in (q, k):
            ss = np.zeros(Hk, f32)
            for j in range(d):
                ss = ss + x[:, j] * x[:, j]
            x /= np.maximum(np.sqrt(ss), f32(eps))[:, None]
        q = q * scale
        kh, qh = k[np.arange(H) % Hk], q[np.arange(H) % Hk]      # [H, d]
        m = m * _exp_f(g)[:, None, None]
        acc = np.zeros((H, d), f32)
        for j in range(d):
            acc = acc + m[:, j, :] * kh[:, j:j + 1]
        acc = (v - acc) * beta[:, None]
        m = m + kh[:, :, None] * acc[:, None, :]
        o = np.zeros((H, d), f32)
        for j in range(d):
            o = o + m[:, j, :] * qh[:, j:j + 1]
        windows[dst], matrices[dst] = full[1:], m
        at_slot = slot[r] if is_row else replay[0][i]
        at = pend[r] if is_row and pend[r] >= 0 else K
        pending[at_slot, at] = event
        if is_row:
            out[r] = o
    return out, windows, matrices, pending
