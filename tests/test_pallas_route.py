"""kernels/pallas_route.py, interpreted on the CPU: a mixture's routing in one kernel chooses
experts.route's experts with its weights within float32 rounding (softmax and sigmoid, a
choice bias, weights rescaled or not, E not a power of 2, ties to the lower index), and a
row gets the same bits alone and beside others."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kinetic.kernels import pallas_route
from kinetic.model.experts import route


def parts_of(logits: np.ndarray, chunks: int, rng) -> np.ndarray:
    """logits [T, E] as `chunks` partial sums [C, T + 3, E + 5] (padded as a matmul's)."""
    T, E = logits.shape
    parts = np.zeros((chunks, T + 3, E + 5), np.float32)
    split = rng.standard_normal((chunks - 1, T, E)).astype(np.float32)
    parts[:chunks - 1, :T, :E] = split
    parts[chunks - 1, :T, :E] = logits - split.sum(axis=0)
    return parts


def summed(parts: np.ndarray, T: int, E: int) -> np.ndarray:
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out[:T, :E]


@pytest.mark.parametrize("E,K,gating,normalize,biased", [
    (8, 2, "softmax", False, False), (60, 4, "softmax", True, False),
    (128, 8, "softmax", True, False), (32, 4, "sigmoid", True, True)])
def test_route_chooses_experts_routes_experts(E, K, gating, normalize, biased):
    rng = np.random.default_rng(E + K)
    T = 9
    logits = (rng.standard_normal((T, E)) * 3).astype(np.float32)
    logits[0, 5] = logits[0].max() + 1.0
    parts = parts_of(logits, 3, rng)
    parts[:, 0, 6] = parts[:, 0, 5]     # a tie, in every chunk: expert 5 first
    bias = rng.standard_normal(E).astype(np.float32) if biased else None
    chosen, weights = map(np.asarray, pallas_route.route(parts, T, E, K, gating, normalize,
                                                         bias))
    assert chosen.shape == weights.shape == (T, K) and chosen.dtype == np.int32
    cfg = SimpleNamespace(n_expert=E, n_expert_used=K, expert_gating=gating,   # route's
                          expert_weights_norm=normalize)
    want_chosen, want_weights = map(np.asarray, route(summed(parts, T, E), cfg, bias))
    assert (chosen == want_chosen).all()
    assert np.allclose(weights, want_weights, rtol=1e-5, atol=1e-7)
    if not biased:
        assert tuple(chosen[0, :2]) == (5, 6)
    if normalize:
        assert np.allclose(weights.sum(axis=1), 1.0, atol=1e-5)


def test_a_rows_routing_is_its_own():
    """A row's experts and weights are the same bits alone, among its first 7 rows and
    among 64 (each row's partial sums the same, the rows beside it not)."""
    rng = np.random.default_rng(3)
    E, K = 128, 8
    parts = parts_of(rng.standard_normal((64, E)).astype(np.float32), 2, rng)
    full = [np.asarray(a) for a in pallas_route.route(parts, 64, E, K, normalize=True)]
    for rows in (1, 7):
        got = pallas_route.route(parts, rows, E, K, normalize=True)
        assert all(np.asarray(g).tobytes() == f[:rows].tobytes() for g, f in zip(got, full))
    alone = pallas_route.route(parts[:, 40:41], 1, E, K, normalize=True)
    assert all(np.asarray(a)[0].tobytes() == f[40].tobytes() for a, f in zip(alone, full))


def test_bad_routing_arguments_say_what_is_wrong():
    parts = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(ValueError, match="gating"):
        pallas_route.route(parts, 2, 8, 2, gating="relu")
    with pytest.raises(ValueError, match="experts a row"):
        pallas_route.route(parts, 2, 8, 9)
