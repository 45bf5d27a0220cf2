"""The norms' Pallas kernel (kinetic/kernels/pallas_norm.py: RMS and BERT's layer norm), a
step's norms on a GPU, run by Pallas in interpret mode on CPU: a row's bits do not depend
on how many rows share the call, and the values are within float32 rounding of float64. That it lowers for
CUDA, and that a step traced for a GPU uses it, is tests/test_pallas_lowering.py's."""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.kernels import pallas_norm as pn
from kinetic.model import layers


def reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """float64 x / sqrt(mean(x^2) + eps) * w over the last axis."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def layer_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    """float64 (x - mean) / sqrt(var + eps) * w + b over the last axis."""
    c = np.asarray(x, np.float64)
    c = c - c.mean(axis=-1, keepdims=True)
    return c / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps) * w + b


@pytest.mark.parametrize("shape", [(576,), (1536,), (64,), (12, 128), (4096,)])   # a head too
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(shape):
    rng = np.random.default_rng(len(shape) + shape[-1])
    x = rng.standard_normal((70, *shape)).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    alone = np.asarray(pn.rms_norm(x[:1], w, 1e-6))
    for rows in (2, 7, 16, 17, 64):
        got = np.asarray(pn.rms_norm(x[:rows], w, 1e-6))
        assert got[0].tobytes() == alone[0].tobytes(), rows
    # a row in another place of the block, beside other rows
    assert (np.asarray(pn.rms_norm(x[5:21], w, 1e-6))[2].tobytes()
            == np.asarray(pn.rms_norm(x[7:8], w, 1e-6))[0].tobytes())


@pytest.mark.parametrize("D,dtype", [(576, np.float32), (896, np.float32), (256, "bfloat16")])
def test_the_values_are_within_float32_rounding_of_float64(D, dtype):
    import jax.numpy as jnp
    rng = np.random.default_rng(D)
    x = jnp.asarray(rng.standard_normal((9, D)) * 5, dtype)
    w = rng.standard_normal(D).astype(np.float32)
    got = np.asarray(pn.rms_norm(x, w, 1e-5))
    assert got.dtype == np.float32 and got.shape == (9, D)
    want = reference(np.asarray(x, np.float32), w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def test_it_agrees_with_xlas_norm():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    np.testing.assert_allclose(np.asarray(pn.rms_norm(x, w, 1e-6)),
                               np.asarray(layers.xla_rms_norm(x, w, 1e-6)), rtol=3e-6, atol=3e-6)


@pytest.mark.parametrize("D", [384, 768, 256])   # MiniLM's and BERT-base's widths
def test_the_layer_norm_keeps_a_rows_bits_and_is_within_rounding_of_float64(D):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((40, D)) * 2 + 3).astype(np.float32)   # a mean far from 0
    w, b = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    alone = np.asarray(pn.layer_norm(x[:1], w, b, 1e-12))[0].tobytes()
    for rows in (3, 16, 33):
        got = np.asarray(pn.layer_norm(x[:rows], w, b, 1e-12))
        assert got[0].tobytes() == alone, rows
    want = layer_reference(x[:33], w, b, 1e-12)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=4e-6 * np.abs(want).max())


def test_a_programs_rows_depend_on_the_width_alone():
    assert [pn.block_rows(d) for d in (64, 512, 1024, 2048, 8192, 16384)] == [16, 16, 8, 4, 1, 1]


@pytest.mark.parametrize("D", [384, 1536])
def test_reading_in_place_gives_the_padded_blocks_bits(D):
    """A GPU's layer norm reads x, w and b and writes y where they are, unpadded, the
    padding masked off (in_place); interpreted, they are padded to whole blocks. Both run
    here, interpreted: every byte the same, at 1, 7, 16 and 17 rows."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((17, D)).astype(np.float32)
    w, b = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    for M in (1, 7, 16, 17):
        got = [np.asarray(pn._norm(x[:M], w, b, 1e-6, True, in_place))
               for in_place in (False, True)]
        assert got[0].shape == (M, D) and got[0].tobytes() == got[1].tobytes(), M


def test_the_rms_norms_blocks_are_16_rows_and_a_power_of_2_columns_dividing_d():
    assert pn.NORM_ROWS == 16
    assert [pn.norm_block(d) for d in (576, 896, 1536, 2048, 64, 48)] == [64, 128, 128, 128,
                                                                          64, 16]


@pytest.mark.parametrize("D,chunks,bias", [(576, 1, False), (1536, 3, True), (64, 2, False)])
def test_a_residual_add_and_its_norm_in_one_kernel_are_both_apart(D, chunks, bias):
    """add_rms_norm (layers.add_norm on a GPU): h = x + (a projection's partial sums over
    its chunks of K, in order, plus its bias), as XLA adds them, and y = rms_norm(h), in
    one launch: h and y the bytes of the add and the norm apart, whatever the rows (the
    parts have their tile's 16 or more rows and padded columns, read in place)."""
    import jax.numpy as jnp
    rng = np.random.default_rng(D + chunks)
    w = rng.standard_normal(D).astype(np.float32)
    b = jnp.asarray(rng.standard_normal(D), jnp.float32) if bias else None
    for M in (1, 7, 17):
        x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
        parts = jnp.asarray(rng.standard_normal((chunks, 16 * -(-M // 16), D + 16)),
                            jnp.float32)
        total = parts[0]
        for c in range(1, chunks):
            total = total + parts[c]
        h_want = x + (total[:M, :D] if b is None else total[:M, :D] + b)
        y_want = pn.rms_norm(h_want, w, 1e-6)
        h, y = pn.add_rms_norm(x, parts, b, w, 1e-6)
        assert np.asarray(h).tobytes() == np.asarray(h_want).tobytes(), M
        assert np.asarray(y).tobytes() == np.asarray(y_want).tobytes(), M


@pytest.mark.parametrize("D,chunks,bias", [(640, 2, False), (1152, 1, True)])
def test_a_norm_after_the_projection_the_add_and_the_next_norm_in_one_kernel(D, chunks,
                                                                             bias):
    """post_add_rms_norm (layers.post_add_norm on a GPU: Gemma 3's norm after its mixer's
    and its feed-forward's output, the residual add, the next pre-norm): h = x +
    rms_norm(parts' sum + bias, w_post) and y = rms_norm(h, w). The add may be contracted
    with the norm's last product into one FMA (one rounding where apart there are two:
    XLA's CPU compiler does so here, Triton by default), so h is within the added term's
    rounding of the partial sums' add, the two norm kernels and the add apart, and y is
    rms_norm(h)'s bytes; a row's bytes are its own at 1, 7 and 17 rows."""
    import jax.numpy as jnp
    rng = np.random.default_rng(D)
    w_post, w = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    b = jnp.asarray(rng.standard_normal(D), jnp.float32) if bias else None
    for M in (1, 7, 17):
        x = jnp.asarray(rng.standard_normal((M, D)), jnp.float32)
        parts = jnp.asarray(rng.standard_normal((chunks, 16 * -(-M // 16), D + 32)) * 4,
                            jnp.float32)
        y = layers.Pending(parts, M, D, b).value()
        added = np.asarray(pn.rms_norm(y, w_post, 1e-6))
        h_want = np.asarray(x) + added
        h, got = pn.post_add_rms_norm(x, parts, b, w_post, w, 1e-6)
        h = np.asarray(h)
        # (the added term's rounding, half an ulp of it, and the sum's)
        assert (np.abs(h - h_want) <= np.spacing(np.abs(added)) + np.spacing(np.abs(h))).all()
        assert np.asarray(got).tobytes() == np.asarray(pn.rms_norm(h, w, 1e-6)).tobytes()
        alone = pn.post_add_rms_norm(x[-1:], parts[:, M - 1:M], b, w_post, w, 1e-6)
        assert np.asarray(alone[0]).tobytes() == h[-1:].tobytes(), M
