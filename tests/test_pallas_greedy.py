"""The greedy draw's Pallas kernel (kinetic/kernels/pallas_greedy.py: a GPU's decode loop
draws with it), run by Pallas in interpret mode on CPU: sampler.greedy's token on every
kind of row (NaN, infinities, signed zeros, ties across and inside the vocabulary's
blocks, rows with no finite maximum) and with logit-bias pairs (a ban on the maximum, a
new maximum, +inf on -inf, unused pairs), and a row's token alone as among others."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.engine import sampler
from kinetic.kernels import pallas_greedy as pg
from tests.test_row_argmax import edge_rows


def bias_pairs(x: np.ndarray, W: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """[B, W] ids and values: row 0 none, row 1 a ban on its maximum, row 2 a new maximum
    at its last column, row 3 +inf on a -inf logit (NaN: -inf), the rest random pairs."""
    B, V = x.shape
    ids = np.full((B, W), -1, np.int32)
    values = np.zeros((B, W), np.float32)
    ids[1, 0], values[1, 0] = int(np.nanargmax(np.where(np.isnan(x[1]), -np.inf, x[1]))), -np.inf
    ids[2, :2], values[2, :2] = [V - 1, 0], [1e3, -2.0]
    ids[3, 0], values[3, 0] = 0, np.inf
    x[3, 0] = -np.inf
    for b in range(4, B):
        n = int(rng.integers(0, W + 1))
        ids[b, :n] = rng.choice(V, n, replace=False)
        values[b, :n] = rng.standard_normal(n) * 4
    return ids, values


@pytest.mark.parametrize("V", [100, 8192, 8193, 20000])
def test_the_token_is_sampler_greedys(V):
    rng = np.random.default_rng(V)
    x = edge_rows(V, rng)
    tie = rng.standard_normal(V).astype(np.float32)   # a tie in two blocks: the first wins
    tie[[V - 1, V // 2]] = 60.0
    x = np.concatenate([x, tie[None]])
    ids, values = bias_pairs(x, 8, rng)
    want = np.asarray(sampler.greedy(jnp.asarray(x), sampler.Sparse(jnp.asarray(ids),
                                                                      jnp.asarray(values)),
                                     jnp.full((x.shape[0], -(-V // 32)), -1, jnp.int32)))
    got = np.asarray(pg.greedy(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(values)))
    assert got.dtype == np.int32 and (got == want).all(), (got, want)
    assert want[1] != int(np.nanargmax(np.where(np.isnan(x[1]), -np.inf, x[1])))   # banned
    assert want[2] == V - 1
    for b in (1, 5):   # a row alone: its own token
        one = pg.greedy(jnp.asarray(x[b:b + 1]), jnp.asarray(ids[b:b + 1]),
                        jnp.asarray(values[b:b + 1]))
        assert int(one[0]) == want[b]
