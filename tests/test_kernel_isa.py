"""Every SIMD path of the quantized matmul kernel gives the scalar reference's bits.

For each weight format the kernel multiplies, random but valid blocks (random bytes whose
f16 scale fields are overwritten with finite small halves, Q8_0 values of -128 included)
and awkward activations (a row of zeros, rows with large outliers) go through every path
of kinetic.kernels.supported_isas(), on 1 and 2 threads, for several M; the float32
outputs must equal the "scalar" path's bit for bit, and a row's output must not depend on
the other rows. Real blocks from the cached GGUF files are checked too, when present.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from kinetic import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernel is not built")

# GGML id -> (values per block, bytes per block, byte offsets of the block's f16 fields)
FORMATS = {
    2: ("Q4_0", 32, 18, (0,)),
    3: ("Q4_1", 32, 20, (0, 2)),
    6: ("Q5_0", 32, 22, (0,)),
    7: ("Q5_1", 32, 24, (0, 2)),
    8: ("Q8_0", 32, 34, (0,)),
    10: ("Q2_K", 256, 84, (80, 82)),
    11: ("Q3_K", 256, 110, (108,)),
    12: ("Q4_K", 256, 144, (0, 2)),
    13: ("Q5_K", 256, 176, (0, 2)),
    14: ("Q6_K", 256, 210, (208,)),
    0: ("F32", 1, 4, ()),
    1: ("F16", 1, 2, ()),
    30: ("BF16", 1, 2, ()),
}
# The multi-row paths take rows in groups (AVX-512: up to 8, K-quants 4, 2, 1; AVX2: up
# to 4): every group size, and M not a multiple of the largest.
MS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 23, 64)
N = 37  # not a multiple of 8 or 16: partial column groups and a short last chunk
SIMD_ISAS = ("avx2", "avx512")
MODELS = os.path.expanduser("~/.cache/kinetic/models")


def _need_isa(isa: str) -> None:
    if isa not in kernels.supported_isas():
        what = "AVX2, FMA and F16C" if isa == "avx2" else "AVX-512 F/BW/VL/VNNI"
        pytest.skip(f"this CPU lacks {what}, so the {isa} path cannot run here")


def _halves(rng: np.random.Generator, size: int) -> np.ndarray:
    """Finite small halves as raw uint16: mostly normal, some subnormal, zero, negative."""
    v = (rng.standard_normal(size) * 0.02).astype(np.float16).view(np.uint16)
    pick = rng.random(size)
    v = np.where(pick < 0.05, rng.integers(0, 0x400, size, dtype=np.uint16), v)  # subnormals
    v = np.where((pick >= 0.05) & (pick < 0.08), np.uint16(0), v)
    return v.astype(np.uint16)


def _weights(fmt: int, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    _, qk, nbytes, f16_at = FORMATS[fmt]
    if fmt == 0:
        return (rng.standard_normal((n, k)) * 0.1).astype(np.float32).view(np.uint8).reshape(-1)
    if fmt == 1:
        return (rng.standard_normal((n, k)) * 0.1).astype(np.float16).view(np.uint8).reshape(-1)
    if fmt == 30:
        f = (rng.standard_normal((n, k)) * 0.1).astype(np.float32).view(np.uint32)
        return (f >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    blocks = rng.integers(0, 256, (n * (k // qk), nbytes), dtype=np.uint8)
    if fmt == 8:  # plenty of -128 values, and a whole block of them
        blocks[:, 2:][rng.random((blocks.shape[0], 32)) < 0.1] = 0x80
        blocks[0, 2:] = 0x80
    for off in f16_at:
        blocks[:, off:off + 2] = _halves(rng, blocks.shape[0]).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def _acts(m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    x = rng.standard_normal((m, k)).astype(np.float32)
    if m > 1:
        x[1] = 0.0
    if m > 2:
        x[2, rng.integers(0, k, 4)] = np.float32(3e4)
        x[2, rng.integers(0, k, 4)] = np.float32(-5e4)
    if m > 5:
        x[5] *= np.float32(1e-3)
        x[5, 0] = np.float32(-1e3)
    return x


def _bits(y: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)


def _check(fmt: int, w: np.ndarray, n: int, k: int, x: np.ndarray, isa: str, what: str) -> None:
    ref = kernels.qmatmul_host(fmt, w, n, k, x, isa="scalar", threads=1)
    for threads in (1, 2):
        got = kernels.qmatmul_host(fmt, w, n, k, x, isa=isa, threads=threads)
        if not np.array_equal(_bits(got), _bits(ref)):
            bad = np.argwhere(_bits(got) != _bits(ref))
            r, c = bad[0]
            raise AssertionError(
                f"{what}: {isa} (threads={threads}) differs from scalar at {len(bad)} outputs, "
                f"first [{r}, {c}]: {got[r, c]!r} vs {ref[r, c]!r}")


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS), ids=[v[0] for v in FORMATS.values()])
def test_random_blocks_bitwise(fmt: int, isa: str) -> None:
    _need_isa(isa)
    name, qk = FORMATS[fmt][:2]
    rng = np.random.default_rng(1000 + fmt)
    # 32-value blocks: fewer, exactly and more than the 16 blocks unpacked at once (a strip)
    # float weights: K = 2048 splits M = 64 into blocks of rows (simd_driver.h float_rows)
    ks = (512, 768) if qk == 256 else (96, 512, 608) if qk == 32 else (37, 200, 512, 2048)
    for k in ks:
        w = _weights(fmt, N, k, rng)
        x64 = _acts(64, k, rng)
        for m in MS:
            _check(fmt, w, N, k, x64[:m], isa, f"{name} K={k} M={m}")
        # Row independence: each row alone gives the bits it has inside M = 64.
        full = kernels.qmatmul_host(fmt, w, N, k, x64, isa=isa, threads=2)
        for r in (0, 1, 2, 5, 63):
            alone = kernels.qmatmul_host(fmt, w, N, k, x64[r:r + 1], isa=isa, threads=1)
            assert np.array_equal(_bits(alone[0]), _bits(full[r])), f"{name} K={k} row {r}"


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_wide_n_all_threads(isa: str) -> None:
    """Many column groups and chunks, every format, M = 1 and 5."""
    _need_isa(isa)
    rng = np.random.default_rng(7)
    for fmt, (name, qk, _, _) in FORMATS.items():
        k = 256 if qk > 1 else 40
        w = _weights(fmt, 301, k, rng)
        for m in (1, 5):
            _check(fmt, w, 301, k, _acts(m, k, rng), isa, f"{name} N=301 M={m}")


def _real_tensors():
    """(label, tensor) for a few tensors of each quantized type in the cached GGUF files."""
    paths = sorted(glob.glob(os.path.join(MODELS, "*.gguf")))
    if not paths:
        return []
    from kinetic.model.gguf_file import GGUFFile

    out, seen = [], {}
    for path in paths:
        g = GGUFFile(path)
        for name, t in g.tensors.items():
            q = int(t.qtype)
            if q not in FORMATS or len(t.shape) != 2 or seen.get(q, 0) >= 2:
                continue
            seen[q] = seen.get(q, 0) + 1
            out.append((f"{os.path.basename(path)}:{name}", t))
    return out


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_real_blocks_bitwise(isa: str) -> None:
    _need_isa(isa)
    tensors = _real_tensors()
    if not tensors:
        pytest.skip(f"no GGUF files in {MODELS}")
    rng = np.random.default_rng(3)
    for label, t in tensors:
        n, k = t.shape
        rows = min(n, 67)
        w = np.asarray(t.data[:rows * kernels.row_bytes(int(t.qtype), k)])
        for m in (1, 3, 4, 16):
            _check(int(t.qtype), w, rows, k, _acts(m, k, rng), isa, f"{label} ({rows}x{k}) M={m}")


@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_half_rounding_of_special_activations(isa: str) -> None:
    """F16 weights round the activations to half (on the SIMD paths by F16C, on the pool's
    threads): every special value gives the scalar reference's bits. Row m carries value m at
    column m and zeros elsewhere; the weights are one-hot, so y[m, m] is the rounded value
    itself (and the other outputs carry its NaNs and infinities the same way)."""
    _need_isa(isa)
    f32 = np.float32
    bits = np.array([0x7FC00001, 0xFFC12345, 0x7FA00000, 0x00000001, 0x80400000], np.uint32)
    values = np.concatenate([bits.view(f32), np.array([
        np.inf, -np.inf, 65504.0, 65519.99, 65520.0, -65520.0, 1e10, 2.0 ** -24, 2.0 ** -25,
        3 * 2.0 ** -26, -(2.0 ** -25) * 1.5, 6.1e-5, -0.0, 0.0, 1.0 + 2.0 ** -11,
        1.0 + 3 * 2.0 ** -11, 0.1, -3.14159], f32)])
    n = len(values)
    k = 32
    x = np.zeros((n, k), f32)
    x[np.arange(n), np.arange(n) % k] = values
    w = np.zeros((k, k), np.float16)
    w[np.arange(k), np.arange(k)] = 1.0
    _check(1, w.view(np.uint8).ravel(), k, k, x, isa, "F16 special activations")


@pytest.mark.parametrize("isa", SIMD_ISAS)
@pytest.mark.parametrize("fmt", [2, 3, 8, 12, 14], ids=["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
def test_int8_rounding_of_special_activations(fmt: int, isa: str) -> None:
    """The q8_0 / q8_1 / q8_K roundings of the SIMD paths (quantize_avx2.cc: blocks 8 at a
    time, on the threads once a call has 4096 values) on special values: NaN payloads, one
    infinity, a block of zeros, a block whose largest magnitude is negative and comes
    first, half-range scales (a block scale of 65504 * 127 overflows the half), and
    subnormals (1 / scale is infinite). 12 rows of 512 values: every path and split gives
    the scalar reference's bits."""
    _need_isa(isa)
    f32 = np.float32
    rng = np.random.default_rng(fmt)
    k, m = 512, 12
    x = rng.standard_normal((m, k)).astype(f32)
    x[0, 5] = np.array([0x7FA00001], np.uint32).view(f32)[0]   # signalling NaN, a payload
    x[1, 40] = np.inf                                           # q8_1's s: inf * 0
    x[2, 0], x[2, 300] = -np.inf, np.nan
    x[3, :64] = 0.0                                             # two q8_0 blocks of zeros
    x[4, :] = 0.0                                               # a q8_K block of zeros too
    x[5, 32], x[5, 33] = -7.0, 7.0                             # negative largest first
    x[6, :] = 65504.0 * 200                                     # d past the half range
    x[7, :] = np.float32(1e-40)                                 # subnormals
    x[8, ::2] *= 1e30                                           # scales of half inf
    rows = 21
    w = _weights(fmt, rows, k, rng)
    _check(fmt, w, rows, k, x, isa, f"{FORMATS[fmt][0]} special activations")


@pytest.mark.parametrize("isa", ("scalar",) + SIMD_ISAS)
@pytest.mark.parametrize("repack", (False, True), ids=("plain", "repacked"))
def test_live_rows_are_written_in_place_and_no_other(isa: str, repack: bool) -> None:
    """qmatmul_rows (a step's sampled rows of the output projection, MatmulArgs::y_rows): on
    every path and format each live row of y gets exactly the bits of the plain call, in
    its own row, and every other row keeps what it held (a NaN pattern here)."""
    if isa != "scalar":
        _need_isa(isa)
    rng = np.random.default_rng(77)
    patterns = ([1] * 9, [0] * 9, [0] * 8 + [1], [1, 0, 1, 1, 0, 0, 1, 0, 1], [0, 1] * 4 + [0])
    for fmt, (name, qk, _, _) in FORMATS.items():
        if repack and fmt not in (2, 3, 6, 7, 8, 10, 11, 12, 13, 14):
            continue
        k = 256 if qk > 1 else 40
        n = 48 if repack else N
        w = _weights(fmt, n, k, rng)
        if repack:
            w = w.copy()
            fmt = kernels.repack16_host(fmt, w, n, k)
        x = _acts(9, k, rng)
        full = kernels.qmatmul_host(fmt, w, n, k, x, isa=isa, threads=1)
        for live in patterns:
            live = np.asarray(live, np.int32)
            for threads in (1, 2):
                y = np.full((9, n), np.nan, np.float32)
                y.view(np.uint32)[:] = 0x7FC0BEEF
                kernels.qmatmul_rows_host(fmt, w, n, k, x, live, y, isa=isa, threads=threads)
                on = live != 0
                what = f"{name} {isa} threads={threads} live={live.tolist()}"
                assert np.array_equal(_bits(y[on]), _bits(full[on])), what
                assert (y[~on].view(np.uint32) == 0x7FC0BEEF).all(), what
