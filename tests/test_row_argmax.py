"""The C++ row argmax (kinetic/kernels/csrc/argmax.h) that draws greedy tokens for rows with
no grammar mask and no bias pairs: the same index as its numpy reference and as
sampler.greedy on every kind of row (NaN, infinities, signed zeros, ties, rows with no finite
maximum, lengths that end inside a vector)."""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.kernels import ffi as native

pytestmark = pytest.mark.skipif(not native.usable(), reason="the C++ kernels are not built "
                                "here (pip install -e . builds them) or JAX is not on the CPU")


def edge_rows(V: int, rng) -> np.ndarray:
    """Rows that probe each rule: ties keep the first index, NaN is -inf, +inf or no finite
    value gives -1, +0 and -0 are the same maximum."""
    rows = [rng.standard_normal(V).astype(np.float32) for _ in range(3)]
    tie = rng.standard_normal(V).astype(np.float32)
    tie[[V // 3, V // 2, V - 1]] = 50.0   # (small V: indices may coincide)
    nan = rng.standard_normal(V).astype(np.float32)
    nan[::7] = np.nan
    nan[V - 1] = 80.0   # the maximum in the scalar tail
    zeros = np.full(V, -np.inf, np.float32)
    zeros[[1 % V, (V - 2) % V]] = [-0.0, 0.0]
    rows += [tie, nan, zeros,
             np.full(V, -np.inf, np.float32), np.full(V, np.nan, np.float32),
             np.where(np.arange(V) == V // 4, np.inf, 0).astype(np.float32),
             np.full(V, 3.0, np.float32)]
    return np.stack(rows)


@pytest.mark.parametrize("V", [1, 3, 16, 37, 1000, 262144])
def test_row_argmax_is_the_references_and_greedys(V):
    import jax
    import jax.numpy as jnp
    from kinetic.engine import sampler
    from kinetic.kernels import reference
    x = edge_rows(V, np.random.default_rng(V))
    got = np.asarray(jax.jit(native.row_argmax)(jnp.asarray(x)))
    want = reference.row_argmax(x)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    B = len(x)
    ids, values = sampler.pack_pairs([], B, 8)
    greedy = sampler.greedy(jnp.asarray(x), sampler.Sparse(jnp.asarray(ids), jnp.asarray(values)),
                            jnp.asarray(sampler.full_mask(B, V)))
    assert np.array_equal(got, np.asarray(greedy))
    if V >= 16:   # the rules themselves, where the rows have room for them
        assert got[3] == V // 3 and got[4] == V - 1 and got[5] == 1
        assert list(got[6:9]) == [-1, -1, -1] and got[9] == 0


def test_random_rows_in_every_bucket_size():
    import jax
    import jax.numpy as jnp
    from kinetic.kernels import reference
    rng = np.random.default_rng(0)
    for B in (1, 2, 4, 8, 16, 32):
        x = rng.standard_normal((B, 4099)).astype(np.float32)
        x[x > 2.5] = np.nan
        got = np.asarray(jax.jit(native.row_argmax)(jnp.asarray(x)))
        assert np.array_equal(got, reference.row_argmax(x))
        # a row's index does not depend on the rows beside it
        assert np.array_equal(got[:1], np.asarray(native.row_argmax(jnp.asarray(x[:1]))))
