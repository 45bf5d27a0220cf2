"""The rotary-and-write kernel (kinetic/kernels/pallas_rope.py: a dense layer's q rotated and
its k and v written into the cache, one launch on a GPU), run by Pallas in interpret mode
on CPU: the bytes of XLA's formulation (layers.Pending's sum, layers.apply_rope,
layers.write_kv), and a row's bytes whatever the rows beside it. That it lowers for CUDA is
tests/test_pallas_lowering.py's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.kernels import pallas_rope as pr
from kinetic.model import layers


def xla_way(parts, biases, cos, sin, index, k_cache, v_cache, heads, neox):
    """What the step ran before (and runs where the kernel does not apply)."""
    T = index.shape[0]
    H, K = heads
    Q = k_cache.shape[-1]
    q, k, v = (layers.Pending(p, T, n * Q, b).value().reshape(T, n, Q)
               for p, b, n in zip(parts, biases, (H, K, K)))
    q, k = layers.apply_rope(q, cos, sin, neox), layers.apply_rope(k, cos, sin, neox)
    # q in the cache's type, as the attention rounds it
    return (q.astype(k_cache.dtype), layers.write_kv(k_cache, k, index),
            layers.write_kv(v_cache, v, index))


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("H,K,Q,chunks,bias,dtype", [
    (4, 2, 16, 1, False, jnp.float16),
    (12, 2, 64, 3, True, jnp.float16),      # Qwen2.5-1.5B's heads (padded to 16, masked)
    (14, 2, 32, 2, True, jnp.bfloat16),
    (3, 1, 8, 1, False, jnp.float32)])
def test_the_kernel_is_xlas_rotary_and_writes_bitwise(H, K, Q, chunks, bias, dtype, neox):
    rng = np.random.default_rng(H * Q + chunks)
    pages, page_size = 6, 16
    for T in (1, 3, 17):
        Mp = 16 * -(-T // 16)
        parts = [jnp.asarray(rng.standard_normal((chunks, Mp, n * Q + 16)), jnp.float32)
                 for n in (H, K, K)]
        biases = [jnp.asarray(rng.standard_normal(n * Q), jnp.float32) if bias else None
                  for n in (H, K, K)]
        positions = rng.integers(0, 500, T)
        freqs = 1.0 / 10000 ** (np.arange(Q // 2) * 2 / Q)
        angles = positions[:, None] * freqs[None, :]
        cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
        index = jnp.asarray(rng.permutation(pages * page_size)[:T], jnp.int32)
        caches = [jnp.asarray(rng.standard_normal((pages, page_size, K, Q)), dtype)
                  for _ in range(2)]
        want = jax.jit(xla_way, static_argnums=(7, 8))(parts, biases, cos, sin, index,
                                                       *caches, (H, K), neox)
        got = pr.rope_write(*parts, biases, cos, sin, index, *caches, (H, K), neox)
        for g, w, what in zip(got, want, ("q", "k cache", "v cache")):
            assert g.shape == w.shape and g.dtype == w.dtype, what
            assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), (what, T)


def test_what_it_takes():
    assert pr.supported(128, 128, jnp.float16) and pr.supported(64, 64, jnp.bfloat16)
    assert pr.supported(256, 64, jnp.float16)          # partial rotary (Qwen3.5's quarter)
    assert not pr.supported(128, 48, jnp.float16)      # a part Triton cannot block
    assert not pr.supported(96, 96, jnp.float16)       # a head Triton cannot block
    assert not pr.supported(128, 128, jnp.uint8)       # q8_0: quantized (and rotated)


def xla_way_normed(parts, cos, sin, index, k_cache, v_cache, q_w, k_w, heads, neox, eps):
    """Qwen3's layer before, jitted as a step is: the chunks' sums, each head of q and k
    RMS-normalized by the Pallas norm kernel (layers.rms_norm on a GPU), then XLA's rotary
    and writes."""
    from kinetic.kernels import pallas_norm
    T = index.shape[0]
    H, K = heads
    Q = k_cache.shape[-1]
    q, k, v = (layers.Pending(p, T, n * Q, None).value().reshape(T, n, Q)
               for p, n in zip(parts, (H, K, K)))
    q, k = pallas_norm.rms_norm(q, q_w, eps), pallas_norm.rms_norm(k, k_w, eps)
    q, k = layers.apply_rope(q, cos, sin, neox), layers.apply_rope(k, cos, sin, neox)
    return (q.astype(k_cache.dtype), layers.write_kv(k_cache, k, index),
            layers.write_kv(v_cache, v, index))


@pytest.mark.parametrize("H,K,Q,chunks,dtype,neox", [
    (4, 2, 16, 1, jnp.float16, True),
    (16, 8, 128, 2, jnp.bfloat16, True),     # Qwen3-1.7B's heads
    (6, 2, 64, 3, jnp.float32, False)])
def test_qwen3s_head_norms_in_the_kernel_are_the_norm_kernels_bits(H, K, Q, chunks, dtype,
                                                                     neox):
    """With norms, each head of q and k is RMS-normalized first, the bytes of the Pallas
    norm kernel's own rows; and a row's bytes are its own whichever rows share the call."""
    rng = np.random.default_rng(7 * H + Q)
    pages, page_size = 4, 16
    eps = 1e-6
    norms = (jnp.asarray(rng.standard_normal(Q), jnp.float32),
             jnp.asarray(rng.standard_normal(Q), jnp.float32), eps)
    T = 17
    parts = [jnp.asarray(rng.standard_normal((chunks, 32, n * Q)) * 3, jnp.float32)
             for n in (H, K, K)]
    angles = rng.integers(0, 900, T)[:, None] * (1.0 / 10000 ** (np.arange(Q // 2) * 2 / Q))
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    index = jnp.asarray(rng.permutation(pages * page_size)[:T], jnp.int32)
    caches = [jnp.asarray(rng.standard_normal((pages, page_size, K, Q)), dtype)
              for _ in range(2)]
    want = jax.jit(xla_way_normed, static_argnums=(8, 9, 10))(
        parts, cos, sin, index, *caches, *norms[:2], (H, K), neox, eps)
    got = pr.rope_write(*parts, (None,) * 3, cos, sin, index, *caches, (H, K), neox, norms)
    for g, w, what in zip(got, want, ("q", "k cache", "v cache")):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), what
    # rows 5 and 11 alone: their q and their cache rows the same bytes
    pick = np.array([5, 11])
    one = pr.rope_write(*(p[:, pick] for p in parts), (None,) * 3, cos[pick], sin[pick],
                        index[pick], *caches, (H, K), neox, norms)
    assert np.asarray(one[0]).tobytes() == np.asarray(got[0][pick]).tobytes()
    flat = [np.asarray(c).reshape(pages * page_size, K, Q) for c in (*got[1:], *one[1:])]
    rows = np.asarray(index[pick])
    assert flat[0][rows].tobytes() == flat[2][rows].tobytes()
    assert flat[1][rows].tobytes() == flat[3][rows].tobytes()
    with pytest.raises(ValueError, match="biases with head norms or a gate"):
        pr.rope_write(*parts, (jnp.zeros(H * Q), None, None), cos, sin, index, *caches,
                      (H, K), neox, norms)


@pytest.mark.parametrize("H,K,Q,rot,neox,dtype", [
    (4, 2, 64, 16, True, jnp.float16),
    (8, 2, 256, 64, True, jnp.bfloat16),     # Qwen3.5's heads: a quarter rotated
    (2, 1, 32, 8, False, jnp.float32)])
def test_qwen35s_gated_q_and_partial_rotary_are_xlas_bits(H, K, Q, rot, neox, dtype):
    """q_gated (Qwen3.5's q, each head's q then its gate) and a partial rotary (the first
    rot features rotated, the rest as they are), with the heads' norms: the bytes of the
    norm kernel, layers.apply_rope and layers.write_kv on q sliced out of the gated parts;
    a row's bytes its own."""
    from kinetic.kernels import pallas_norm
    rng = np.random.default_rng(H + Q + rot)
    pages, page_size, eps, T, chunks = 4, 16, 1e-6, 9, 2
    q_w, k_w = (jnp.asarray(rng.standard_normal(Q), jnp.float32) for _ in range(2))
    parts = [jnp.asarray(rng.standard_normal((chunks, 16, n * Q)) * 3, jnp.float32)
             for n in (2 * H, K, K)]
    angles = rng.integers(0, 900, T)[:, None] * (1.0 / 10000 ** (np.arange(rot // 2) * 2 / rot))
    cos, sin = (jnp.asarray(f(angles), jnp.float32) for f in (np.cos, np.sin))
    index = jnp.asarray(rng.permutation(pages * page_size)[:T], jnp.int32)
    caches = [jnp.asarray(rng.standard_normal((pages, page_size, K, Q)), dtype)
              for _ in range(2)]

    def xla(parts, cos, sin, index, k_cache, v_cache):
        qg, k, v = (layers.Pending(p, T, n * Q, None).value() for p, n in zip(parts, (2 * H, K, K)))
        q = qg.reshape(T, H, 2, Q)[:, :, 0]
        q = pallas_norm.rms_norm(q, q_w, eps)
        k = pallas_norm.rms_norm(k.reshape(T, K, Q), k_w, eps)
        q, k = layers.apply_rope(q, cos, sin, neox), layers.apply_rope(k, cos, sin, neox)
        return (q.astype(k_cache.dtype), layers.write_kv(k_cache, k, index),
                layers.write_kv(v_cache, v.reshape(T, K, Q), index))
    want = jax.jit(xla)(parts, cos, sin, index, *caches)
    got = pr.rope_write(*parts, (None,) * 3, cos, sin, index, *caches, (H, K), neox,
                        (q_w, k_w, eps), q_gated=True)
    for g, w, what in zip(got, want, ("q", "k cache", "v cache")):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes(), what
    pick = np.array([3])
    one = pr.rope_write(*(p[:, pick] for p in parts), (None,) * 3, cos[pick], sin[pick],
                        index[pick], *caches, (H, K), neox, (q_w, k_w, eps), q_gated=True)
    assert np.asarray(one[0]).tobytes() == np.asarray(got[0][pick]).tobytes()
    # without norms, a partial rotary alone: XLA's too
    plain = pr.rope_write(parts[1], parts[1], parts[2], (None,) * 3, cos, sin, index,
                          *caches, (K, K), neox)
    k_only = jax.jit(lambda p, c, s_: layers.apply_rope(
        layers.Pending(p, T, K * Q, None).value().reshape(T, K, Q), c, s_, neox))(
        parts[1], cos, sin)
    assert np.asarray(plain[0]).tobytes() == np.asarray(k_only.astype(dtype)).tobytes()
