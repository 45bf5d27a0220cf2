"""A mixture of experts' projections in one C++ call (kinetic_qmatmul_id,
kinetic/kernels/csrc/qmatmul_id.cc): every (row, chosen expert) pair gets the bits of its row
against its expert's weight alone, on every kernel path (scalar / AVX2 / AVX-512 forced),
which tests/test_kernel_isa.py and test_kernel_reference.py tie to the numpy reference; the
same under jit through the FFI; bad ids and shapes are clear errors; and a mixture layer's
output is the per-expert path's bits on the three MoE families."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kinetic import kernels
from kinetic.kernels import reference
from tests.tiny_models import random_blocks, write_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernel is not built")

E, N = 6, 40


def experts(fmt, K: int, seed: int = 0) -> tuple[np.ndarray, int]:
    """E experts' [N, K] weights stacked as a GGUF [E, N, K] tensor; (bytes, stride)."""
    w = random_blocks(fmt, E * N, K, seed, magnitude=0.01)
    return w, w.size // E


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("fmt,K", [(T.Q4_0, 96), (T.Q5_1, 64), (T.Q8_0, 128), (T.Q4_K, 256),
                                   (T.Q6_K, 512), (T.F16, 48), (T.BF16, 40), (T.F32, 33)])
def test_each_pair_is_its_row_against_its_expert_alone(fmt, K, isa):
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    w, stride = experts(fmt, K, int(fmt))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((9, K)).astype(np.float32)
    ids = rng.integers(0, E, (9, 3)).astype(np.int32)
    ids[4] = [5, 5, 0]                     # one row choosing an expert twice
    for threads in (1, 2):
        y = kernels.qmatmul_id_host(int(fmt), w, stride, E, N, K, x, ids, isa=isa,
                                    threads=threads)
        for r in range(9):
            for s in range(3):
                one = w[ids[r, s] * stride:(ids[r, s] + 1) * stride]
                alone = kernels.qmatmul_host(int(fmt), one, N, K, x[r:r + 1], isa=isa)[0]
                assert y[r, s].tobytes() == alone.tobytes(), (r, s, threads)
    # and, on the scalar path, the numpy reference's bits
    if isa == "scalar":
        e = ids[0, 0]
        want = reference.qmatmul(int(fmt), w[e * stride:(e + 1) * stride], N, K, x[:1])
        assert y[0, 0].tobytes() == np.asarray(want, np.float32)[0].tobytes()


def test_a_row_per_pair_and_unchosen_experts():
    """share 1 (the down projection: x holds a row per pair), and experts no row chose
    (skipped: their bytes may be anything, here NaN halves)."""
    fmt, K = T.F16, 64
    w, stride = experts(fmt, K)
    w[2 * stride:3 * stride] = 0xFF            # expert 2: NaN halves, never chosen
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, K)).astype(np.float32)
    ids = np.array([[0], [3], [0], [5], [1]], np.int32)
    y = kernels.qmatmul_id_host(int(fmt), w, stride, E, N, K, x, ids)
    assert np.isfinite(y).all()
    for r in range(5):
        e = ids[r, 0]
        alone = kernels.qmatmul_host(int(fmt), w[e * stride:(e + 1) * stride], N, K, x[r:r + 1])
        assert y[r, 0].tobytes() == alone[0].tobytes()


def test_bad_ids_and_shapes_are_clear_errors():
    fmt, K = T.Q8_0, 64
    w, stride = experts(fmt, K)
    x = np.zeros((2, K), np.float32)
    with pytest.raises(kernels.KernelError, match="expert id out of range"):
        kernels.qmatmul_id_host(int(fmt), w, stride, E, N, K, x, np.array([[0], [E]]))
    with pytest.raises(kernels.KernelError, match="expert id out of range"):
        kernels.qmatmul_id_host(int(fmt), w, stride, E, N, K, x, np.array([[0], [-1]]))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.qmatmul_id_host(int(fmt), w[:-1], stride, E, N, K, x, np.zeros((2, 1)))
    with pytest.raises(kernels.KernelError, match="stride is less than one expert"):
        kernels.qmatmul_id_host(int(fmt), w, stride - 1, E, N, K, x, np.zeros((2, 1)))


def test_the_ffi_call_under_jit_gives_the_host_bits_and_refuses_bad_ids():
    from kinetic.kernels import ffi
    fmt, K = T.Q4_K, 256
    w, stride = experts(fmt, K, 3)
    data = jnp.asarray(w)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((7, K)).astype(np.float32)
    ids = rng.integers(0, E, (7, 2)).astype(np.int32)
    spec = [(int(fmt), 0, stride, N), (int(fmt), 0, stride, N)]
    a, b = jax.jit(lambda x, ids: ffi.qmatmul_id(x, ids, data, spec, K, E))(x, ids)
    want = kernels.qmatmul_id_host(int(fmt), w, stride, E, N, K, x, ids)
    assert np.asarray(a).tobytes() == want.tobytes() == np.asarray(b).tobytes()
    with pytest.raises(Exception, match="kinetic_qmatmul_id: .*expert id out of range"):
        np.asarray(ffi.qmatmul_id(x, ids + E, data, spec, K, E)[0])
    with pytest.raises(Exception, match="kinetic_qmatmul_id: an expert's weight lies outside"):
        np.asarray(ffi.qmatmul_id(x, ids, data, [(int(fmt), 8, stride, N)], K, E)[0])


@pytest.mark.parametrize("arch", ["qwen3moe", "lfm2moe", "qwen35moe"])
def test_a_mixture_layer_is_the_per_expert_paths_bits(tmp_path, arch, monkeypatch):
    """A step's logits with the experts in one call per projection, and with the
    per-expert path (each expert on the rows that chose it): the same bytes."""
    from kinetic.engine.runner import Runner, RunnerConfig
    from kinetic.model import experts as moe
    from kinetic.model.loader import load_model
    from tests.test_model_forward import host_step
    path = write_tiny_model(tmp_path / "moe.gguf", arch, qtype="Q4_0", n_expert=8,
                            n_expert_used=2)

    def logits():
        jax.clear_caches()
        runner = Runner(load_model(str(path)), RunnerConfig(
            step_tokens=16, num_slots=1, page_size=16, num_pages=3, pages_per_slot=2))
        return host_step(runner, np.arange(3, 19), np.arange(16), np.zeros(16, int),
                         np.arange(16) + 16, np.array([[1, 2]], np.int32))
    from kinetic import compile_cache
    monkeypatch.setitem(compile_cache._state, "enabled", False)   # each trace compiled anew
    calls = []
    real = moe._pairs_swiglu
    monkeypatch.setattr(moe, "_pairs_swiglu", lambda *a: calls.append(1) or real(*a))
    fused = logits()
    assert calls, "the packed experts did not take the one-call path"
    monkeypatch.setattr(moe, "_stacked", lambda projs: None)
    assert logits().tobytes() == fused.tobytes()
