"""The C++ quantized matmul (kinetic/kernels/csrc) against its numpy reference
(kinetic/kernels/reference.py), bit for bit, on every format, path and shape; against
float64 within a stated bound; its dequantized rows against kinetic.model.quants; and its
error messages."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import kinetic.kernels as kk
from kinetic.kernels import KernelError
from kinetic.kernels import reference as R
from kinetic.model import quants

pytestmark = pytest.mark.skipif(not kk.available(), reason="the C++ kernel is not built")

NAMES = {R.Q4_0: "Q4_0", R.Q4_1: "Q4_1", R.Q5_0: "Q5_0", R.Q5_1: "Q5_1", R.Q8_0: "Q8_0",
         R.Q2_K: "Q2_K", R.Q3_K: "Q3_K", R.Q4_K: "Q4_K", R.Q5_K: "Q5_K", R.Q6_K: "Q6_K",
         R.F32: "F32", R.F16: "F16", R.BF16: "BF16"}
BLOCK_FORMATS = [f for f in NAMES if R.FORMATS[f].qk > 1]
# Byte offsets of the f16 scale fields (d, and m / dmin where the format has one).
F16_FIELDS = {R.Q4_0: [0], R.Q4_1: [0, 2], R.Q5_0: [0], R.Q5_1: [0, 2], R.Q8_0: [0],
              R.Q2_K: [80, 82], R.Q3_K: [108], R.Q4_K: [0, 2], R.Q5_K: [0, 2], R.Q6_K: [208]}
MODELS = os.path.expanduser("~/.cache/kinetic/models")
U = 2.0 ** -24  # float32's unit roundoff


def random_weights(fmt: int, n: int, k: int, seed: int) -> np.ndarray:
    """n rows of k values of format fmt as raw bytes: random bytes with finite f16 scales
    of magnitude 1e-3..1e-1 (random sign); float formats: random finite values, some 0."""
    rng = np.random.default_rng(seed)
    f = R.FORMATS[fmt]
    if f.qk == 1:
        w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
        w.flat[::37] = 0.0
        w.flat[5::41] = -0.0
        if fmt == R.F32:
            return w.view(np.uint8).reshape(-1)
        if fmt == R.F16:
            w.flat[7::43] = 3e-6  # a half subnormal
            return w.astype(np.float16).view(np.uint8).reshape(-1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(-1)
    blocks = rng.integers(0, 256, (n * (k // f.qk), f.bytes), dtype=np.uint8)
    for off in F16_FIELDS[fmt]:
        scale = 10.0 ** rng.uniform(-3, -1, len(blocks)) * rng.choice([-1.0, 1.0], len(blocks))
        blocks[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    if fmt == R.Q8_0:
        blocks[::3, 2:6] = 0x80  # int8 -128, which the activation side never holds
        blocks[1::3, 30:34] = 0x7F
    return blocks.reshape(-1)


def activations(k: int, seed: int) -> np.ndarray:
    """16 rows: normal; exact ties; one huge outlier; all zero; f16 / bf16 midpoints; near
    ties; then normal rows of assorted magnitudes. M = 1 and 3 take the first rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, k)).astype(np.float32)
    # Ties: every block of 32 (and of 256) starts with -127 and holds +127 at 17, so q8_0's
    # db = 1 and q8_K's first largest value is -127 (iscale = +1; taking the later +127
    # would flip every sign); all other values are odd multiples of 0.5, exact ties of rint.
    x[1] = rng.integers(-126, 126, k) + 0.5
    x[1, 0::32], x[1, 17::32] = -127.0, 127.0
    x[2, k // 3] = 6.0e4  # huge, yet finite as a half
    x[3] = 0.0
    j = rng.integers(0, 64, k)
    sign = rng.choice([-1.0, 1.0], k)
    x[4] = sign * np.where(np.arange(k) % 2, 1 + (2 * j + 1) * 2.0 ** -11,  # half midpoints
                           1 + (2 * j + 1) * 2.0 ** -8)                     # bfloat16 ones
    x[4, 3::8] = sign[3::8] * (2 * j[3::8] + 1) * 2.0 ** -25  # half subnormal midpoints
    # Near ties: the same scaled by db = 61, whose float32 inverse is off by enough that
    # x * (1 / db) lands beside about half of the halves that x / db would hit exactly.
    x[5] = 61 * (rng.integers(-126, 126, k) + 0.5)
    x[5, 0::32], x[5, 17::32] = -127.0 * 61, 127.0 * 61
    x[6:] *= (10.0 ** rng.uniform(-3, 2, 10))[:, None].astype(np.float32)
    return x


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == np.float32 and want.dtype == np.float32, what
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.argwhere(got.view(np.uint32) != want.view(np.uint32))
    if bad.size:
        i = tuple(bad[0])
        pytest.fail(f"{what}: {len(bad)} of {got.size} values differ; first at {i}: "
                    f"{got[i]!r} (0x{got.view(np.uint32)[i]:08x}) != {want[i]!r} "
                    f"(0x{want.view(np.uint32)[i]:08x})")


def isas() -> list[str | None]:
    return ["scalar", None] + [i for i in kk.supported_isas() if i != "scalar"]


def shapes():
    for fmt, name in NAMES.items():
        qk = R.FORMATS[fmt].qk
        # 512, 608: 16 and 19 blocks of 32, as many and more than the SIMD paths unpack at once
        ks = (256, 512) if qk == 256 else (64, 256, 512, 608) if qk == 32 else (40, 64, 256, 512)
        for n in (16, 33):
            for k in ks:
                yield pytest.param(fmt, n, k, id=f"{name}-n{n}-k{k}")


# --- 1. bit for bit on random blocks ----------------------------------------------------

@pytest.mark.parametrize("fmt,n,k", list(shapes()))
def test_kernel_equals_reference_bitwise(fmt, n, k):
    w = random_weights(fmt, n, k, seed=fmt * 1000 + n + k)
    x = activations(k, seed=k + n)
    for M in (1, 3, 4, 9, 16):  # the SIMD paths' row groups: 1, 3, 4, 8 + 1, 8 + 8
        want = R.qmatmul(fmt, w, n, k, x[:M])
        for isa in isas():
            got = kk.qmatmul_host(fmt, w, n, k, x[:M], isa=isa)
            assert_same_bits(got, want, f"{NAMES[fmt]} n={n} k={k} M={M} isa={isa}")
    got = kk.qmatmul_host(fmt, w, n, k, x, threads=4)
    assert_same_bits(got, want, f"{NAMES[fmt]} n={n} k={k} M=16 threads=4")


@pytest.mark.parametrize("fmt", list(NAMES), ids=NAMES.get)
def test_non_finite_activations_bitwise(fmt):
    """NaN and inf in x: the q8 kinds skip NaN in amax and turn a NaN product into 0; the
    float kinds carry them through. Kernel and reference still agree bit for bit."""
    k = 256
    w = random_weights(fmt, 16, k, seed=7)
    x = activations(k, seed=3)[:9]
    x[0, 5], x[1, 40], x[2, 0], x[2, 1] = np.nan, np.inf, -np.inf, np.nan
    x[3, :] = np.nan
    # NaNs with payloads (signalling ones too), one a row, which f16 makes the quiet NaN
    # and bf16 quiets keeping its top bits (0x7F802000 would otherwise become bf16 inf)
    nans = np.array([0x7F802000, 0xFFA00001, 0x7FC00001, 0x7F800001], np.uint32)
    x[4:8, 3] = nans.view(np.float32)
    x[8, :] = 1e-40  # subnormal: 1 / db overflows to inf and the clamp to 127 decides
    for isa in isas():
        got = kk.qmatmul_host(fmt, w, 16, k, x, isa=isa)
        assert_same_bits(got, R.qmatmul(fmt, w, 16, k, x), f"{NAMES[fmt]} isa={isa}")


def test_reference_activation_rounding_semantics():
    """The points of quantize.cc that the output alone cannot show: q8_K takes the FIRST
    value of the largest magnitude (here -2, so iscale = +63.5 and d > 0), amax skips NaN,
    an all-zero block has d = 0, and q never reaches -128."""
    x = np.zeros((1, 256), np.float32)
    x[0, 3], x[0, 9], x[0, 10] = -2.0, 2.0, np.nan
    a = R.quantize_acts("q8_K", x)
    assert a.d[0, 0] == np.float32(1) / (np.float32(-127) / np.float32(-2.0)) > 0
    assert a.q[0, 3] == -127 and a.q[0, 9] == 127 and a.q[0, 10] == 0
    assert a.bsum[0, 0] == 0 and a.bsum.shape == (1, 16)
    b = R.quantize_acts("q8_1", x)
    assert b.d[0, :2].tolist() == [np.float32(np.float16(2 / 127)), 0.0]
    assert b.q.min() == -127 and b.s[0, 0] == 0.0
    assert R.quantize_acts("q8_0", np.full((1, 32), -np.inf, np.float32)).q.min() == 0


# --- 2. bit for bit on the blocks of real models ----------------------------------------

def real_tensors():
    files = sorted(glob.glob(os.path.join(MODELS, "*.gguf")))
    if not files:
        return [pytest.param(None, id="no-model-files")]
    return [pytest.param(p, id=os.path.basename(p)) for p in files]


@pytest.mark.parametrize("path", real_tensors())
def test_real_model_blocks_bitwise(path):
    if path is None or not os.path.exists(path):
        pytest.skip(f"no GGUF model files in {MODELS}")
    from kinetic.model.gguf_file import GGUFFile
    g = GGUFFile(path)
    named = ["blk.0.attn_q.weight", "blk.0.ffn_down.weight", "output.weight",
             "token_embd.weight"]
    picked, seen = [t for t in named if t in g.tensors], set()
    for name in picked:
        seen.add(int(g.tensors[name].qtype))
    for name, t in g.tensors.items():  # and the first 2-D tensor of every other type
        if len(t.shape) == 2 and int(t.qtype) in R.FORMATS and int(t.qtype) not in seen:
            picked.append(name)
            seen.add(int(t.qtype))
    assert picked
    for name in picked:
        t = g.tensors[name]
        fmt, (n, k) = int(t.qtype), t.shape
        n = min(n, 64)
        w = np.asarray(t.data[:n * kk.row_bytes(fmt, k)])
        x = activations(k, seed=n)[[0, 2, 5]]
        want = R.qmatmul(fmt, w, n, k, x)
        for isa in ("scalar", None):
            got = kk.qmatmul_host(fmt, w, n, k, x, isa=isa)
            assert_same_bits(got, want, f"{os.path.basename(path)} {name} ({NAMES[fmt]}) {isa}")


# --- 3. accuracy against float64 ---------------------------------------------------------

def rounded_acts(fmt: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as the kernel sees it (float64 [M, K]), and the activation scale of each value."""
    f = R.FORMATS[fmt]
    a = R.quantize_acts(f.act, x)
    if f.qk == 1:
        return a.f.astype(np.float64), np.abs(x.astype(np.float64))
    block = 256 if f.act == "q8_K" else 32
    d = np.repeat(a.d.astype(np.float64), block, axis=1)
    return a.q.astype(np.float64) * d, np.abs(d)


@pytest.mark.parametrize("fmt", list(NAMES), ids=NAMES.get)
def test_accuracy_against_float64(fmt):
    """The bound, u = 2^-24, T = K / qk + 4 (block formats) or K / 16 + 5 (float formats):

        |y - xr . W^T| <= 1.01 * T * u / (1 - T * u) * (|xr| . |W|^T) + S
        |y - x  . W^T| <= that + |x - xr| . |W|^T,   |x - xr| <= c * scale (elementwise)

    xr: x after the activation rounding; W: the dequantized weight (float64 products);
    |W| counts the scale part and the min part of each value separately (|d sc q| +
    |dmin mn|), the terms the kernel adds before they cancel. Each block adds one term
    computed with at most 4 roundings into a chain of K / qk additions (float formats:
    one product, K / 16 lane additions, 4 halvings), hence T. S, only for Q4_1 / Q5_1,
    is the exact effect of the activation sum s = f16(db * sum q) being rounded apart from
    d = f16(db): sum over blocks of |m| |s - d sum q|. c = 0.57 for q8_0 / q8_1 (half a
    step, plus d's f16 rounding of up to 127 steps * 2^-11), 0.501 for q8_K, 2^-11 (half)
    and 2^-8 (bfloat16) relative, 0 for F32. With K = 512 the first bound is about 1.2e-6
    (float formats 2.2e-6) of the row's magnitude |xr| . |W|^T."""
    f = R.FORMATS[fmt]
    n, k = 33, 512
    w = random_weights(fmt, n, k, seed=fmt + 11)
    x = activations(k, seed=5)
    x = x[np.isfinite(x).all(1)]
    y = kk.qmatmul_host(fmt, w, n, k, x).astype(np.float64)
    W = R.dequantize(fmt, w, n, k).astype(np.float64)
    if f.qk == 1:
        Wabs, T = np.abs(W), k // 16 + 5
    else:
        q, d, m, sc, mn = (a.astype(np.float64) for a in R.unpack(fmt, w, n, k))
        if f.qk == 32:
            sc, mn = np.ones_like(sc), np.ones_like(mn)
        g = np.arange(f.qk) // f.sub
        Wabs = (np.abs(q * d[..., None] * sc[..., g]) + np.abs(m[..., None] * mn[..., g]))
        Wabs, T = Wabs.reshape(n, k), k // f.qk + 4
    xr, scale = rounded_acts(fmt, x)
    S = np.zeros_like(y)
    if f.act == "q8_1":
        a = R.quantize_acts("q8_1", x)
        sumq = a.q.reshape(len(x), -1, 32).astype(np.float64).sum(-1)
        err_s = np.abs(a.s.astype(np.float64) - a.d.astype(np.float64) * sumq)
        S = err_s @ np.abs(R.unpack(fmt, w, n, k)[2].astype(np.float64)).T
    mag = np.abs(xr) @ Wabs.T
    gamma = T * U / (1 - T * U)
    bound = 1.01 * gamma * mag + S
    assert gamma < (2.3e-6 if f.qk == 1 else 1.3e-6)
    err = np.abs(y - xr @ W.T)
    assert (err <= bound).all(), f"{NAMES[fmt]}: error {err.max()} over bound"
    c = {"q8_0": 0.57, "q8_1": 0.57, "q8_K": 0.501, "f32": 0.0, "f16": 2.0 ** -11,
         "bf16": 2.0 ** -8}[f.act]
    dx = np.abs(x.astype(np.float64) - xr)
    slack = 2.0 ** -25 if f.act == "f16" else 0.0  # half subnormals: absolute half-ulp
    assert (dx <= c * scale + slack).all(), f"{NAMES[fmt]}: activation rounding over bound"
    err64 = np.abs(y - x.astype(np.float64) @ W.T)
    assert (err64 <= bound + dx @ np.abs(W).T).all()


# --- 4. dequantized rows -------------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(NAMES), ids=NAMES.get)
def test_dequant_rows_equal_reference_and_quants(fmt):
    n, k = 24, 512
    w = random_weights(fmt, n, k, seed=fmt + 99)
    if R.FORMATS[fmt].qk == 1:  # raw random bits: NaN payloads, infs, subnormals too
        w = np.random.default_rng(fmt).integers(0, 256, w.size, dtype=np.uint8)
    ref = R.dequantize(fmt, w, n, k)
    assert_same_bits(ref, quants.dequantize_bytes(w, fmt, (n, k)), f"{NAMES[fmt]} quants")
    rows = np.array([5, 0, 23, 5, 11, 11, 1])
    got = kk.dequant_rows_host(fmt, w, n, k, rows)
    assert_same_bits(got, ref[rows], f"{NAMES[fmt]} dequant_rows_host")


def test_f16_conversions_on_every_half():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    assert_same_bits(R.f16_to_f32(h), h.view(np.float16).astype(np.float32), "f16_to_f32")
    v = R.f16_to_f32(h)
    finite = np.isfinite(v)
    assert_same_bits(R.round_f16(v)[finite], v[finite], "round_f16 of halves")
    # bfloat16: ties to even, and a NaN stays NaN
    b = np.array([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, np.nan, -np.inf], np.float32)
    assert R.round_bf16(b)[:2].tolist() == [1.0, 1 + 2 * 2.0 ** -7]
    assert np.isnan(R.round_bf16(b)[2]) and R.round_bf16(b)[3] == -np.inf


# --- 5. errors -------------------------------------------------------------------------------

def test_errors_have_messages():
    x = np.ones((2, 48), np.float32)
    w = random_weights(R.Q4_0, 4, 64, seed=1)
    with pytest.raises(KernelError, match="multiple"):
        kk.qmatmul_host(R.Q4_0, w, 4, 48, x)
    with pytest.raises(KernelError, match="multiple"):
        kk.dequant_rows_host(R.Q4_0, w, 4, 48, [0])
    with pytest.raises(ValueError, match="multiple"):
        R.qmatmul(R.Q4_0, w, 4, 48, x)
    wk = random_weights(R.Q4_K, 2, 256, seed=1)
    with pytest.raises(KernelError, match="multiple"):
        kk.qmatmul_host(R.Q4_K, wk, 1, 128, np.ones((1, 128), np.float32))
    with pytest.raises(KernelError, match="not one the kernel multiplies"):  # 16 = IQ2_XXS
        kk.qmatmul_host(16, w, 4, 64, np.ones((2, 64), np.float32))
    with pytest.raises(KernelError, match="not one the kernel multiplies"):
        kk.dequant_rows_host(16, w, 4, 64, [0])
    with pytest.raises(ValueError, match="not one the kernel multiplies"):
        R.qmatmul(16, w, 4, 64, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="cannot hold"):
        kk.qmatmul_host(R.Q4_0, w[:-1], 4, 64, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="cannot hold"):
        R.qmatmul(R.Q4_0, w[:-1], 4, 64, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError, match="must be"):
        kk.qmatmul_host(R.Q4_0, w, 4, 64, np.ones((2, 32), np.float32))
    with pytest.raises(KernelError, match="row index"):
        kk.dequant_rows_host(R.Q4_0, w, 4, 64, [4])
