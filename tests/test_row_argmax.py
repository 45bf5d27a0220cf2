"""The C++ row argmax (kinetic/kernels/csrc/argmax.h) that draws every greedy token where the
C++ kernels run: the same index as its numpy reference and as sampler.greedy on every kind of
row (NaN, infinities, signed zeros, ties, rows with no finite maximum, lengths that end
inside a vector), with and without a grammar mask and logit-bias pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.engine import sampler
from kinetic.kernels import ffi as native
from kinetic.kernels import reference

pytestmark = pytest.mark.skipif(not native.usable(), reason="the C++ kernels are not built "
                                "here (pip install -e . builds them) or JAX is not on the CPU")

_argmax = jax.jit(native.row_argmax)


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


def greedy(x, ids, values, mask) -> np.ndarray:
    return np.asarray(sampler.greedy(jnp.asarray(x), sampler.Sparse(jnp.asarray(ids),
                                                                    jnp.asarray(values)),
                                     jnp.asarray(mask)))


@pytest.mark.parametrize("V", [1, 3, 16, 37, 1000, 262144])
def test_row_argmax_is_the_references_and_greedys(V):
    x = edge_rows(V, np.random.default_rng(V))
    got = np.asarray(_argmax(jnp.asarray(x)))
    want = reference.row_argmax(x)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    B = len(x)
    ids, values = sampler.pack_pairs([], B, 8)
    assert np.array_equal(got, greedy(x, ids, values, sampler.full_mask(B, V)))
    assert np.array_equal(got, np.asarray(_argmax(jnp.asarray(x), jnp.asarray(ids),
                                                  jnp.asarray(values))))
    if V >= 16:   # the rules themselves, where the rows have room for them
        assert got[3] == V // 3 and got[4] == V - 1 and got[5] == 1
        assert list(got[6:9]) == [-1, -1, -1] and got[9] == 0


def masked_and_biased(V: int, rng):
    """Edge rows with grammar masks (allow-all, allow-few, partial words, none) and bias
    pairs (bans, boosts, bans on +inf logits: NaN, ids past V or -1: unused)."""
    x = edge_rows(V, rng)
    B = len(x)
    mask = sampler.full_mask(B, V)
    words = mask.shape[1]
    for b in range(B):
        kind = b % 4
        if kind == 1:   # a few tokens
            mask[b] = 0
            for t in rng.choice(V, size=min(V, 5), replace=False):
                mask[b, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        elif kind == 2:   # random words, some whole, some partial
            mask[b] = rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32)
            mask[b, rng.random(words) < 0.3] = -1
        elif kind == 3 and b % 8 == 3:
            mask[b] = 0
    rows = []
    for b in range(B):
        n = int(rng.integers(0, min(V, 6) + 1))
        ids = rng.choice(V, size=n, replace=False).astype(np.int32)
        vals = rng.choice(np.array([-np.inf, 100.0, 5.0, -3.0, 0.0, -100.0], np.float32), n)
        if b == 0 and V > 4:   # a ban on the maximum, then a boost of a masked-out token
            ids, vals = np.array([int(np.nanargmax(x[b])), 2], np.int32), np.array(
                [-np.inf, 7.0], np.float32)
        if b == 8:   # the row whose only finite-beating logit is +inf (edge_rows): banned
            ids, vals = np.array([V // 4], np.int32), np.array([-np.inf], np.float32)
        rows.append((ids, vals))
    ids, values = sampler.pack_pairs(rows, B, 8)
    ids[B - 1, 6:] = [V + 3, -1]   # unused pairs: past the vocabulary, and -1
    values[B - 1, 6:] = [np.inf, 9.0]
    return x, ids, values, mask


@pytest.mark.parametrize("V", [1, 3, 33, 100, 1000, 151936])
def test_masks_and_bias_pairs_give_greedys_token(V):
    rng = np.random.default_rng(V + 1)
    for _ in range(4):
        x, ids, values, mask = masked_and_biased(V, rng)
        got = np.asarray(_argmax(*map(jnp.asarray, (x, ids, values, mask))))
        assert np.array_equal(got, reference.row_argmax(x, ids, values, mask))
        assert np.array_equal(got, greedy(x, ids, values, mask))


def test_the_rules_of_masks_and_pairs():
    V = 70   # three mask words, the last partial
    x = np.zeros((5, V), np.float32)
    x[:, 33], x[:, 5] = 2.0, 1.0
    mask = sampler.full_mask(5, V)
    mask[0] = [1 << 5, 0, 0]                         # only token 5 allowed
    ids = np.full((5, 2), -1, np.int32)
    values = np.zeros((5, 2), np.float32)
    ids[1], values[1] = [33, -1], [-np.inf, 0]       # the maximum banned: then 5
    ids[2], values[2] = [20, 33], [3.0, -1.0]        # a boost past the rest: 20
    x[3, 33] = np.inf
    ids[3], values[3] = [33, -1], [-np.inf, 0]       # a ban on +inf: NaN, read as -inf
    ids[4], values[4] = [69, 33], [2.0, 0.0]         # a tie with a pair: the lower id
    got = np.asarray(_argmax(*map(jnp.asarray, (x, ids, values, mask))))
    assert got.tolist() == [5, 5, 20, 5, 33]
    assert np.array_equal(got, greedy(x, ids, values, mask))


def test_random_rows_in_every_bucket_size():
    rng = np.random.default_rng(0)
    for B in (1, 2, 4, 8, 16, 32):
        x = rng.standard_normal((B, 4099)).astype(np.float32)
        x[x > 2.5] = np.nan
        got = np.asarray(_argmax(jnp.asarray(x)))
        assert np.array_equal(got, reference.row_argmax(x))
        # a row's index does not depend on the rows beside it
        assert np.array_equal(got[:1], np.asarray(native.row_argmax(jnp.asarray(x[:1]))))


def test_shapes_that_do_not_fit_are_a_clear_error():
    x = jnp.zeros((2, 40), jnp.float32)
    with pytest.raises(Exception, match="the mask must be"):
        _argmax(x, jnp.full((2, 1), -1, jnp.int32), jnp.zeros((2, 1)),
                jnp.full((2, 1), -1, jnp.int32))
    with pytest.raises(Exception, match="ids and values must be"):
        _argmax(x, jnp.full((2, 1), -1, jnp.int32), jnp.zeros((2, 2)))
