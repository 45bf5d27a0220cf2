"""The kernels through the XLA FFI, inside jit: the same bits as the C ABI, several weights
in one call the same as one call each, the row-wise pieces (RMS norm, cos / sin) giving a
row the same bits at any row count, and a bad call an error with a message, not a crash."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic import kernels
from kinetic.kernels import ffi

Q4_K, Q8_0, Q5_0, Q6_K = 12, 8, 6, 14


def random_blocks(fmt: int, n: int, k: int, rng) -> np.ndarray:
    """n rows of k values of `fmt` with random quants and small finite f16 scales."""
    qk, nbytes = {Q4_K: (256, 144), Q8_0: (32, 34), Q5_0: (32, 22), Q6_K: (256, 210)}[fmt]
    b = rng.integers(0, 256, (n * k // qk, nbytes), dtype=np.uint8)
    scale_at = {Q4_K: (0, 2), Q8_0: (0,), Q5_0: (0,), Q6_K: (208,)}[fmt]
    for at in scale_at:
        b[:, at:at + 2] = rng.uniform(1e-3, 3e-2, (len(b), 1)).astype(np.float16).view(np.uint8)
    return b.reshape(-1)


@pytest.fixture(scope="module")
def weights():
    rng = np.random.default_rng(0)
    k = 512
    parts = [(Q4_K, 48), (Q8_0, 16), (Q6_K, 32)]
    blobs = [random_blocks(f, n, k, rng) for f, n in parts]
    offsets = np.cumsum([0] + [b.size for b in blobs])[:-1]
    data = np.concatenate(blobs)
    return data, [(f, int(o), n) for (f, n), o in zip(parts, offsets)], k


def test_jit_equals_the_c_abi_and_many_equals_one_each(weights):
    data, parts, k = weights
    x = np.random.default_rng(1).standard_normal((5, k)).astype(np.float32)
    dev = jax.device_put(data)
    many = jax.jit(lambda x: ffi.qmatmul_many(x, dev, parts, k))(x)
    for (fmt, off, n), got in zip(parts, many):
        one = jax.jit(lambda x: ffi.qmatmul(x, dev, fmt, off, n, k))(x)
        host = kernels.qmatmul_host(fmt, data[off:], n, k, x)
        assert np.asarray(got).tobytes() == np.asarray(one).tobytes() == host.tobytes()


def test_live_rows_get_their_bits_in_place(weights):
    """qmatmul with `live` (a step's sampled rows of the output projection): a live row's
    result is the bits of the plain call, in its own row, whatever the pattern (the other
    rows are not written: nothing reads them)."""
    data, parts, k = weights
    rng = np.random.default_rng(4)
    x = rng.standard_normal((9, k)).astype(np.float32)
    dev = jax.device_put(data)
    full = jax.jit(lambda x: ffi.qmatmul_many(x, dev, parts, k))(x)
    masked = jax.jit(lambda x, live: ffi.qmatmul_many(x, dev, parts, k, live))
    for live in ([1] * 9, [0] * 9, [0, 0, 0, 0, 0, 0, 0, 0, 1], [1, 0, 1, 1, 0, 0, 1, 0, 1],
                 rng.integers(0, 2, 9)):
        live = np.asarray(live, np.int32)
        for got, want in zip(masked(x, live), full):
            got, want = np.asarray(got), np.asarray(want)
            on = live != 0
            assert got[on].tobytes() == want[on].tobytes()
    with pytest.raises(Exception, match="live must be"):
        masked(x, np.ones(8, np.int32))[0].block_until_ready()


def test_row_pieces_give_a_row_the_same_bits_at_any_row_count():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    theta = rng.uniform(0, 4000, (64, 32)).astype(np.float32)
    norm = jax.jit(lambda x: ffi.rms_norm(x, jnp.asarray(w), 1e-5))
    cs = jax.jit(ffi.cos_sin)
    alone, (c1, s1) = np.asarray(norm(x[:1])), cs(theta[:1])
    for rows in (2, 3, 8, 16, 64):
        assert np.asarray(norm(x[:rows]))[0].tobytes() == alone[0].tobytes()
        c, s = cs(theta[:rows])
        assert np.asarray(c)[0].tobytes() == np.asarray(c1)[0].tobytes()
        assert np.asarray(s)[0].tobytes() == np.asarray(s1)[0].tobytes()
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(np.asarray(norm(x)), want, rtol=2e-6, atol=1e-6)
    c, s = cs(theta)
    np.testing.assert_allclose(np.asarray(c), np.cos(theta.astype(np.float64)), atol=1e-6)
    np.testing.assert_allclose(np.asarray(s), np.sin(theta.astype(np.float64)), atol=1e-6)


def test_rms_norm_is_its_numpy_reference_bit_for_bit():
    """Widths with and without a tail past the last 16 values (the C++ sums 16 lanes in
    SIMD registers, the tail one by one)."""
    from kinetic.kernels import reference
    rng = np.random.default_rng(7)
    for d in (16, 37, 256, 576, 640, 900):
        x = (rng.standard_normal((9, d)) * 3 + 1).astype(np.float32)
        w = rng.standard_normal(d).astype(np.float32)
        got = np.asarray(jax.jit(lambda x: ffi.rms_norm(x, jnp.asarray(w), 1e-6))(x))
        assert got.tobytes() == reference.rms_norm(x, w, 1e-6).tobytes(), d


def _glu_inputs(rng, n: int, specials: bool) -> tuple[np.ndarray, np.ndarray]:
    g = np.concatenate([rng.standard_normal(n).astype(np.float32) * s for s in (0.1, 3, 40, 120)])
    if specials:   # zeros, infinities, NaN, past exp's cut-off at -86, subnormals
        g = np.concatenate([g, np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 86.5, -86.5, 100,
                                         -100, 1e-40, -1e-40], np.float32)])
    return g, rng.standard_normal(g.size).astype(np.float32)


def test_swiglu_is_its_numpy_reference_bit_for_bit_on_every_path():
    """csrc/glu.h on each instruction-set path through the C ABI (lengths with and without a
    tail past the last 16 and 8 lanes, special values included) and through the FFI inside
    jit (the kernel's threads, in chunks), against reference.swiglu; and within a few ulp of
    XLA's own silu(g) * u, which it replaces on the CPU."""
    from kinetic.kernels import reference
    rng = np.random.default_rng(11)
    for n in (1, 15, 4099):
        g, u = _glu_inputs(rng, n, specials=True)
        want = reference.swiglu(g, u)
        for isa in kernels.supported_isas():
            assert kernels.swiglu_host(g, u, isa=isa).tobytes() == want.tobytes(), (isa, n)
    # XLA runs with subnormals flushed to zero (as the model's steps do), so no input or
    # result here is one (|g| <= 60, |u| >= 0.5); an output past one chunk of the threads'
    # split (16,384 elements)
    g, u = _glu_inputs(rng, 9000, specials=False)
    g = np.clip(g, -60, 60).reshape(8, -1)
    u = (np.sign(u) * rng.uniform(0.5, 2.0, u.size)).astype(np.float32).reshape(8, -1)
    got = np.asarray(jax.jit(ffi.swiglu)(jnp.asarray(g), jnp.asarray(u)))
    assert got.tobytes() == reference.swiglu(g, u).tobytes()
    xla = np.asarray(jax.jit(lambda a, b: jax.nn.silu(a) * b)(g, u))
    np.testing.assert_allclose(got, xla, rtol=2e-6, atol=1e-30)
    with pytest.raises(Exception, match="one shape"):   # an error with a message, not a crash
        jax.jit(ffi.swiglu)(jnp.ones((2, 8)), jnp.ones((2, 4))).block_until_ready()


def test_layer_norm_is_its_numpy_reference_bit_for_bit_at_any_row_count():
    """The encoders' layer norm: the numpy reference's bits (kernels/reference.py), a row the
    same alone as among 64, and close to the float64 formula."""
    from kinetic.kernels import reference
    rng = np.random.default_rng(3)
    for d in (384, 64, 37):
        x = (rng.standard_normal((64, d)) * 3 + 1).astype(np.float32)
        w, b = rng.standard_normal((2, d)).astype(np.float32)
        norm = jax.jit(lambda x: ffi.layer_norm(x, jnp.asarray(w), jnp.asarray(b), 1e-12))
        got = np.asarray(norm(x))
        assert got.tobytes() == reference.layer_norm(x, w, b, 1e-12).tobytes()
        for rows in (1, 3, 8):
            assert np.asarray(norm(x[:rows])).tobytes() == got[:rows].tobytes()
        x64 = x.astype(np.float64)
        mean = x64.mean(-1, keepdims=True)
        want = (x64 - mean) / np.sqrt(((x64 - mean) ** 2).mean(-1, keepdims=True) + 1e-12) * w + b
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_weight_outside_its_buffer_is_an_error_not_a_crash(weights):
    data, parts, k = weights
    dev = jax.device_put(data)
    x = np.zeros((1, k), np.float32)
    with pytest.raises(Exception, match="the weight lies outside its buffer"):
        jax.jit(lambda x: ffi.qmatmul(x, dev, Q8_0, data.size - 10, 16, k))(x).block_until_ready()
    with pytest.raises(Exception, match="K is not a multiple"):
        jax.jit(lambda x: ffi.qmatmul(x, dev, Q4_K, 0, 1, 100))(
            np.zeros((1, 100), np.float32)).block_until_ready()
    with pytest.raises(Exception, match="a row index is outside the matrix"):
        jax.jit(lambda r: ffi.dequant_rows(r, dev, Q8_0, parts[1][1], 16, k))(
            np.array([16], np.int32)).block_until_ready()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_kv_write_in_place_equals_numpy_rounding_and_xla_scatter(dtype):
    """The C++ KV write gives the cache numpy's round-to-nearest-even values (XLA's scatter
    too), leaves every other row as it was, and inside a jit that donates the caches writes
    them in place (the result is the donated buffer)."""
    from kinetic.model.layers import write_kv
    rng = np.random.default_rng(1)
    pages, page_size, K, Q, Qv, T = 6, 4, 2, 8, 16, 5
    dt = jnp.dtype(dtype)
    k0 = rng.standard_normal((pages, page_size, K, Q)).astype(np.float32)
    v0 = rng.standard_normal((pages, page_size, K, Qv)).astype(np.float32)
    # values that round differently to half / bfloat16, and subnormals of half
    k = (rng.standard_normal((T, K, Q)) * np.float32(10.0) ** rng.integers(-9, 4, (T, K, Q))
         ).astype(np.float32)
    v = rng.standard_normal((T, K, Qv)).astype(np.float32)
    index = np.array([5, 23, 0, 12, 7], np.int32)

    def c_write(kc, vc):
        return ffi.kv_write(kc, vc, jnp.asarray(k), jnp.asarray(v), jnp.asarray(index))

    def xla_write(kc, vc):
        return write_kv(kc, jnp.asarray(k), jnp.asarray(index)), write_kv(vc, jnp.asarray(v), jnp.asarray(index))

    kc, vc = jnp.asarray(k0, dt), jnp.asarray(v0, dt)
    want_k = np.asarray(kc).reshape(-1, K, Q).copy()
    want_v = np.asarray(vc).reshape(-1, K, Qv).copy()
    want_k[index], want_v[index] = k.astype(want_k.dtype), v.astype(want_v.dtype)
    ref_k, ref_v = jax.jit(xla_write)(kc, vc)
    # fresh caches in buffers XLA owns (a numpy array put on the device may be borrowed in
    # place, zero-copy, and a borrowed buffer cannot be donated), that nothing else references
    own = jax.jit(lambda a: jnp.asarray(a, dt) + jnp.zeros((), dt))
    kc, vc = own(k0), own(v0)
    pointer = kc.unsafe_buffer_pointer()
    got_k, got_v = jax.jit(c_write, donate_argnums=(0, 1))(kc, vc)
    assert got_k.unsafe_buffer_pointer() == pointer   # in place
    for got, want, ref in ((got_k, want_k, ref_k), (got_v, want_v, ref_v)):
        got = np.asarray(got).reshape(want.shape)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        np.testing.assert_array_equal(got.view(np.uint8), np.asarray(ref).reshape(want.shape).view(np.uint8))


def test_kv_write_q8_0_is_its_reference_blocks_in_place_and_in_xla():
    """A q8_0 cache row written by the C++ KV write holds reference.q8_0_blocks' bytes (each
    block of 32 quantized as llama.cpp's q8_0: f16 scale, int8 values), as XLA's scatter
    (layers.write_kv) writes them; other rows keep their bytes."""
    from kinetic.kernels import reference as R
    from kinetic.model.layers import dequantize_q8_0, write_kv
    rng = np.random.default_rng(3)
    pages, page_size, K, Q, Qv, T = 6, 4, 2, 64, 32, 5
    k = (rng.standard_normal((T, K, Q)) * np.float32(10.0) ** rng.integers(-6, 3, (T, K, Q))
         ).astype(np.float32)
    k[0, 0, :32] = 0   # an all-zero block: scale 0, values 0
    v = rng.standard_normal((T, K, Qv)).astype(np.float32)
    index = np.array([5, 23, 0, 12, 7], np.int32)
    old_k = rng.integers(0, 256, (pages, page_size, K, Q // 32 * 34), np.uint8)
    old_v = rng.integers(0, 256, (pages, page_size, K, Qv // 32 * 34), np.uint8)
    got_k, got_v = jax.jit(lambda kc, vc: ffi.kv_write(kc, vc, jnp.asarray(k), jnp.asarray(v),
                                                       jnp.asarray(index)))(old_k, old_v)
    for got, old, new in ((got_k, old_k, k), (got_v, old_v, v)):
        want = old.reshape(-1, K, old.shape[-1]).copy()
        want[index] = R.q8_0_blocks(new)
        np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
        xla = np.asarray(jax.jit(write_kv)(jnp.asarray(old), jnp.asarray(new),
                                           jnp.asarray(index))).reshape(want.shape)
        np.testing.assert_array_equal(xla, want)
        # read back: d * q, within half a step of each block's scale (and the f16 rounding
        # of the scale, at most 127 * d * 2^-11 more)
        back = np.asarray(dequantize_q8_0(jnp.asarray(want[index])))
        np.testing.assert_array_equal(back, R.q8_0_values(want[index]))
        step = np.abs(new).reshape(T, K, -1, 32).max(-1, keepdims=True) / 127
        assert (np.abs(back - new).reshape(step.shape[:-1] + (32,)) <= step * 0.57).all()
    with pytest.raises(Exception, match="must be"):   # 48 values: not whole blocks
        write = jax.jit(lambda kc, vc: ffi.kv_write(kc, vc, jnp.ones((1, K, 48)),
                                                    jnp.asarray(v[:1]), jnp.zeros(1, jnp.int32)))
        write(old_k, old_v)[0].block_until_ready()


def test_kv_write_outside_the_cache_is_an_error_not_a_write():
    kc, vc = jnp.zeros((2, 4, 1, 8)), jnp.zeros((2, 4, 1, 8))
    rows = jnp.ones((1, 1, 8))
    for bad in (8, -1):
        with pytest.raises(Exception, match="a write index lies outside the cache"):
            jax.jit(lambda kc, vc: ffi.kv_write(kc, vc, rows, rows, jnp.array([bad])))(
                kc, vc)[0].block_until_ready()


def _rss_anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_lazy_zero_zeroes_every_byte_and_only_its_own_range():
    """csrc/lazyzero.h: a range of dirty memory reads as zeros afterwards, whatever its
    alignment (whole pages are handed back, the partial ends and small ranges memset), and
    not one byte around it changes."""
    page = 4096
    big = np.full(64 * page + 64, 0xAB, np.uint8)   # > 256 KiB: malloc maps it anonymously
    for start, stop in ((0, big.size), (3, big.size - 5), (page + 1, page + 2 * page + 7),
                        (17, 17 + 3 * page)):
        big[:] = 0xAB
        handed_back = kernels.lazy_zero_host(big[start:stop])
        assert not big[start:stop].any()
        assert (big[:start] == 0xAB).all() and (big[stop:] == 0xAB).all()
        assert 0 <= handed_back <= stop - start and handed_back % page == 0
    big[:] = 0xAB
    assert kernels.lazy_zero_host(big) >= 60 * page    # the large range went back unwritten
    small = np.full(100, 7, np.float32)
    assert kernels.lazy_zero_host(small) == 0 and not small.any()   # memset, nothing dropped


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_lazy_zeros_equal_jnp_zeros_and_take_memory_only_where_written(dtype):
    """ffi.lazy_zeros gives jnp.zeros' bits, can be donated to the in-place KV write like
    any XLA buffer, and a large one adds to the process's memory only what is written (the
    KV cache is allocated whole at start: kinetic/engine/runner.py)."""
    shape = (4, 4, 2, 8)
    got = ffi.lazy_zeros(shape, dtype)
    assert got.dtype == jnp.dtype(dtype) and got.shape == shape
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8),
                                  np.asarray(jnp.zeros(shape, dtype)).view(np.uint8))
    rows = jnp.ones((1, 2, 8))
    k, v = jax.jit(lambda kc, vc: ffi.kv_write(kc, vc, rows, rows, jnp.array([5])),
                   donate_argnums=(0, 1))(ffi.lazy_zeros(shape, dtype), ffi.lazy_zeros(shape, dtype))
    flat = np.asarray(k, np.float32).reshape(-1, 2, 8)
    assert (flat[5] == 1).all() and not np.delete(flat, 5, axis=0).any()

    big = (64, 1024, 1024)                           # 128-256 MiB
    ffi.lazy_zeros(big, dtype).block_until_ready()   # compiled (and freed) before measuring
    before = _rss_anon_bytes()
    huge = ffi.lazy_zeros(big, dtype)
    huge.block_until_ready()
    grew = _rss_anon_bytes() - before
    assert grew < huge.nbytes // 4, f"{grew} bytes taken for {huge.nbytes} of lazy zeros"
    assert float(huge[63, 1023, 1023]) == 0.0 and float(huge[0, 0, 0]) == 0.0
    del huge
