"""The 16-column layout of the 32-value block formats (csrc/repack.h): the C++ repack gives
the numpy reference's bytes, undoing it gives the file's bytes back, and a repacked weight
gives every kernel path the plain weight's bits (matmul and row gather), whether its rows
fill whole groups of 16 or not. The loader repacks where the AVX-512 path runs; a model
loaded with and without it gives the same logits, and the file on disk is never written.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kinetic import kernels
from kinetic.kernels import reference as R

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernel is not built")

# GGML id -> values and bytes per block, the offsets of its f16 fields (the rest random bytes)
BLOCKS = {2: (32, 18, (0,)), 3: (32, 20, (0, 2)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)),
          8: (32, 34, (0,)), 10: (256, 84, (80, 82)), 11: (256, 110, (108,)),
          12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)), 14: (256, 210, (208,))}
assert sorted(BLOCKS) == sorted(kernels.REPACKABLE) == sorted(R.REPACKABLE)
# whole groups, a partial one, none at all (K in blocks of each format)
SHAPES = ((16, 1), (37, 2), (53, 3), (5, 2))
CASES = [(fmt, n, nb * BLOCKS[fmt][0]) for fmt in sorted(BLOCKS) for n, nb in SHAPES]


def _weight(fmt: int, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    qk, size, halves = BLOCKS[fmt]
    w = rng.integers(0, 256, (n, k // qk, size), dtype=np.uint8)
    for at in halves:
        h = (rng.standard_normal((n, k // qk)) * 0.02).astype(np.float16)
        w[:, :, at:at + 2] = h.view(np.uint8).reshape(n, k // qk, 2)
    return w.reshape(-1).copy()


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_repack_matches_the_numpy_layout_and_undoes(fmt, n, k):
    w = _weight(fmt, n, k)
    mine = w.copy()
    assert kernels.repack16_host(fmt, mine, n, k) == fmt | kernels.REPACK16
    np.testing.assert_array_equal(mine, R.repack16(fmt, w, n, k))
    np.testing.assert_array_equal(R.unrepack16(fmt, mine, n, k), w)
    n16 = n // 16 * 16
    tail = n16 * kernels.row_bytes(fmt, k)
    np.testing.assert_array_equal(mine[tail:], w[tail:])   # rows after the groups stay put
    if n16:
        assert not np.array_equal(mine[:tail], w[:tail])


def _one_group(fmt: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(16 rows of one block repacked, the plain rows [16, block bytes])."""
    qk, size, _ = BLOCKS[fmt]
    w = _weight(fmt, 16, qk, seed=seed)
    out = w.copy()
    kernels.repack16_host(fmt, out, 16, qk)
    return out, w.reshape(16, size)


def test_layout_of_one_q8_0_block():
    """Byte for byte, repack.h's description: column c's scale at 2c, value 4j + i of column
    c at 32 + 64 j + 4c + i, xor 0x80."""
    out, rows = _one_group(8, seed=3)
    for c in range(16):
        assert bytes(out[2 * c:2 * c + 2]) == bytes(rows[c, 0:2])
        for v in range(32):
            j, i = divmod(v, 4)
            assert out[32 + 64 * j + 4 * c + i] == rows[c, 2 + v] ^ 0x80


def test_layout_of_one_q5_0_block():
    """The 5th bits: bit 4c + i of hi[j] is bit 4j + i of column c's qh; values two a byte."""
    out, rows = _one_group(6, seed=4)
    hi = out[32:96].copy().view("<u8")
    vals = out[96:352]
    for c in range(16):
        qh = int(rows[c, 2:6].copy().view("<u4")[0])
        for v in range(32):
            j, i = divmod(v, 4)
            assert (int(hi[j]) >> (4 * c + i)) & 1 == (qh >> v) & 1
        for v in range(16):
            j, i = divmod(v, 4)
            assert vals[64 * j + 4 * c + i] == rows[c, 6 + v]


@pytest.mark.parametrize("fmt,n,k", CASES)
def test_every_path_gives_the_plain_bits(fmt, n, k):
    w = _weight(fmt, n, k, seed=n)
    rep = w.copy()
    rfmt = kernels.repack16_host(fmt, rep, n, k)
    rng = np.random.default_rng(k)
    for m in (1, 3, 8, 9, 16, 17):   # 16: two passes of 8 rows in registers, 17: the strip
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[0, :7] *= 50.0   # an outlier block
        want = R.qmatmul(fmt, w, n, k, x).view(np.uint32)
        np.testing.assert_array_equal(R.qmatmul(rfmt, rep, n, k, x).view(np.uint32), want)
        for isa in kernels.supported_isas():
            for threads in (1, 2):
                got = kernels.qmatmul_host(rfmt, rep, n, k, x, isa=isa, threads=threads)
                np.testing.assert_array_equal(got.view(np.uint32), want,
                                              err_msg=f"{isa}, {threads} threads, M = {m}")


@pytest.mark.parametrize("fmt", sorted(BLOCKS))
def test_row_gather_reads_the_layout(fmt):
    n, k = 37, 2 * BLOCKS[fmt][0]
    w = _weight(fmt, n, k, seed=9)
    rep = w.copy()
    rfmt = kernels.repack16_host(fmt, rep, n, k)
    rows = np.array([0, 15, 16, 31, 32, 36, 5, 5], np.int32)
    want = kernels.dequant_rows_host(fmt, w, n, k, rows)
    np.testing.assert_array_equal(kernels.dequant_rows_host(rfmt, rep, n, k, rows), want)
    np.testing.assert_array_equal(R.dequantize(rfmt, rep, n, k)[rows], want)


def test_layout_of_one_q6_k_block():
    """The K-quants word by word: byte 4c + i of vector w is byte 4w + i of column c's block;
    then the 2 bytes left of each block (Q6_K's d) at 64 * 52 + 2c."""
    out, rows = _one_group(14, seed=5)
    for c in range(16):
        for b in range(208):
            wd, i = divmod(b, 4)
            assert out[64 * wd + 4 * c + i] == rows[c, b]
        assert bytes(out[64 * 52 + 2 * c:64 * 52 + 2 * c + 2]) == bytes(rows[c, 208:210])


def test_refusals_leave_the_bytes_alone():
    w = np.arange(16 * 64, dtype=np.uint32).astype(np.uint8)   # 16 rows of 32 f16 values
    before = w.copy()
    with pytest.raises(kernels.KernelError, match="no 16-column layout"):
        kernels.repack16_host(1, w, 16, 32)
    np.testing.assert_array_equal(w, before)
    w = _weight(14, 16, 256)[:16 * 210].copy()   # Q6_K with K not a multiple of 256
    before = w.copy()
    with pytest.raises(kernels.KernelError, match="multiple"):
        kernels.repack16_host(14, w, 32, 128)
    np.testing.assert_array_equal(w, before)
    frozen = _weight(8, 16, 32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        kernels.repack16_host(8, frozen, 16, 32)
    with pytest.raises(ValueError, match="cannot hold"):
        kernels.repack16_host(8, _weight(8, 16, 32)[:100].copy(), 16, 32)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_1"])
def test_loaded_model_is_the_same_with_and_without_repack(tmp_path, monkeypatch, qtype):
    """The loader's repack (forced here, so that every CPU runs it: off AVX-512 a repacked
    weight goes through the plain paths group by group) changes no logit bit, covers the
    projections and a tied output, whether the engine's compile or its first step does it,
    and leaves the file as it was."""
    pytest.importorskip("jax")
    from kinetic.kernels import ffi
    if not ffi.usable():
        pytest.skip("the FFI kernels need JAX on the CPU")
    import jax

    from kinetic.engine.engine_config import EngineConfig
    from kinetic.llm import open_model
    from kinetic.model import weights as W
    from kinetic.model.layers import Proj
    from tests.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / "m.gguf", "llama", qtype=qtype, d_model=64, d_ffn=128,
                            tied=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    ids = [1, 5, 9, 200, 3, 77, 12]

    def run(repack: bool, compile: bool = False):
        monkeypatch.setattr(W, "repack_wanted", lambda: repack)
        config = EngineConfig(parallel=1, n_ctx=64, speculative=False)
        model = open_model(path, config, kernel="ffi", compile=compile)
        try:
            leaves = jax.tree.leaves(model.loaded.weights, is_leaf=lambda x: isinstance(x, Proj))
            fmts = {p.fmt for p in leaves if isinstance(p, Proj)}
            # the loader leaves the rearrangement to the engine: done by its compile, which
            # warms up on zero weights, else by the first step
            assert bool(model.loaded.pending_repack) == (repack and not compile)
            logits = np.asarray(model.logits(ids))
            assert not model.loaded.pending_repack
            return fmts, logits
        finally:
            model.close()

    plain_fmts, plain = run(False)
    rep_fmts, rep = run(True)
    assert all(not f & kernels.REPACK16 for f in plain_fmts)
    assert any(f & kernels.REPACK16 for f in rep_fmts), rep_fmts
    np.testing.assert_array_equal(rep.view(np.uint32), plain.view(np.uint32))
    if qtype == "Q8_0":
        _, compiled = run(True, compile=True)
        np.testing.assert_array_equal(compiled.view(np.uint32), plain.view(np.uint32))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


@pytest.mark.parametrize("arch", ["qwen35", "gemma3"])
def test_compile_on_zero_weights_changes_nothing(tmp_path, arch):
    """Runner.compile warms every step shape up on a zeroed buffer of the weights' shape
    (then the weights are rearranged): afterwards a compiled engine answers as one that
    compiled nothing, with a recurrent state (qwen35's padding slot took the warm-ups) and
    sliding-window layers (gemma3)."""
    from kinetic.kernels import ffi
    if not ffi.usable():
        pytest.skip("the FFI kernels need JAX on the CPU")
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.llm import open_model
    from tests.tiny_models import write_tiny_model

    path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0")
    ids = [1, 5, 9, 17, 33]
    got = []
    for compile in (False, True):
        model = open_model(path, EngineConfig(parallel=2, n_ctx=64, speculative=False),
                           kernel="ffi", compile=compile)
        try:
            logits = np.asarray(model.logits(ids))
            tokens = [t for d in model.stream(ids, max_tokens=6) for t in d.token_ids]
        finally:
            model.close()
        assert np.isfinite(logits).all()
        got.append((logits, tokens))
    np.testing.assert_array_equal(got[1][0].view(np.uint32), got[0][0].view(np.uint32))
    assert got[1][1] == got[0][1] and len(got[0][1]) == 6
