"""The pallas kernel's paged attention (kinetic/kernels/pallas_attention.py), run by Pallas in
interpret mode on CPU: within float32 rounding of the XLA path (layers.paged_attention) with
GQA, windows, softcap, images' two-way rows and an f16 cache, and a row's bits the same alone
and inside larger steps, whatever the other rows' slots and positions."""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.kernels import pallas_attention as pa
from kinetic.kernels.pallas_attention import paged_attention
from kinetic.model import layers

PS, P, S = 4, 6, 3           # page size, pages per slot, slots
NUM_PAGES = 1 + S * P


def cache(dtype, K=2, Q=8, Qv=8, seed=0):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((NUM_PAGES, PS, K, Q)).astype(dtype)
    v = rng.standard_normal((NUM_PAGES, PS, K, Qv)).astype(dtype)
    table = (1 + np.arange(S * P)).reshape(S, P)[:, ::-1].copy()   # pages out of order
    return k, v, table


def step(table, slots, positions):
    n = len(slots)
    return layers.StepInput(np.zeros(n, np.int32), np.asarray(positions, np.int32),
                            np.asarray(slots, np.int32), np.zeros(n, np.int32), table)


# split: a row's keys walked by one program (0), or in 3 lanes (page i in lane i % 3) merged
# in order (pallas_attention._split_attention, a GPU's default, of 8 lanes)
SPLITS = (0, 3)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dtype,window,softcap,H", [
    (np.float32, 0, 0.0, 4), (np.float16, 0, 0.0, 2), (np.float32, 5, 0.0, 4),
    (np.float32, 0, 30.0, 6)])
def test_it_is_the_xla_paths_within_rounding(dtype, window, softcap, H, split):
    k, v, table = cache(dtype)
    rng = np.random.default_rng(1)
    slots = np.array([0, 1, 2, 1, 0, 2, 0])
    positions = np.array([0, 3, 23, 9, 17, 4, 12])
    q = rng.standard_normal((len(slots), H, 8)).astype(np.float32)
    got = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, window, softcap,
                                     split=split))
    want = np.asarray(layers.paged_attention(q, k, v, step(table, slots, positions), 0.35,
                                             window, softcap, kernel="xla"))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("split", SPLITS)
def test_rows_that_see_each_other_both_ways(split):
    k, v, table = cache(np.float32)
    q = np.random.default_rng(2).standard_normal((3, 4, 8)).astype(np.float32)
    slots, positions, ends = np.array([1, 1, 1]), np.array([5, 6, 7]), np.array([7, 7, 7])
    got = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, ends=ends,
                                     split=split))
    want = np.asarray(layers.paged_attention(q, k, v, step(table, slots, positions), 0.35,
                                             kernel="xla", ends=ends))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("split", SPLITS)
def test_a_rows_bits_do_not_depend_on_its_step(split):
    k, v, table = cache(np.float32, seed=3)
    rng = np.random.default_rng(4)
    T = 64
    slots = rng.integers(0, S, T)
    positions = rng.integers(0, P * PS, T)
    q = rng.standard_normal((T, 4, 8)).astype(np.float32)
    whole = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, split=split))
    for r in (0, 9, 63):
        alone = np.asarray(paged_attention(q[r:r + 1], k, v, table, slots[r:r + 1],
                                           positions[r:r + 1], 0.35, split=split))
        assert alone.tobytes() == whole[r:r + 1].tobytes(), r
        pair = [r, (r + 7) % T]
        wider = np.pad(table, ((0, 0), (0, 3)))   # a wider page table: the same bits
        two = np.asarray(paged_attention(q[pair[::-1]], k, v, wider, slots[pair[::-1]],
                                         positions[pair[::-1]], 0.35, split=split))
        assert two[1:].tobytes() == alone.tobytes(), r


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dtype,window,softcap,H", [
    (np.float32, 0, 0.0, 6), (np.float16, 5, 30.0, 2), (np.float32, 0, 0.0, 4)])
def test_reading_in_place_gives_the_padded_rows_bits(dtype, window, softcap, H, split):
    """A GPU reads q and writes the output where they are, [T, H, *], a kv head's query
    heads masked to its own (in_place); interpreted, each kv head's rows are padded to a
    block. Both run here, interpreted: every byte the same."""
    k, v, table = cache(dtype, seed=5)
    rng = np.random.default_rng(6)
    slots = np.array([0, 1, 2, 1, 0], np.int32)
    positions = np.array([0, 3, 23, 9, 17], np.int32)
    q = rng.standard_normal((len(slots), H, 8)).astype(np.float32)
    padded = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, window,
                                        softcap, split=split))
    q = np.asarray(q.astype(dtype), np.float32)
    args = (q, k, v, table.astype(np.int32), slots, positions, positions, 0.35, window,
            softcap, True, True, H // k.shape[2])
    in_place = np.asarray(pa._split_attention(*args, split) if split else pa._attention(*args))
    assert in_place.shape == padded.shape and in_place.tobytes() == padded.tobytes()


def test_an_output_gate_inside_is_the_gate_applied_after():
    """Qwen3.5's gated attention: the gate read from its projection's partial sums (each
    head's q then its gate; more rows and columns than the step's) and applied in the
    kernel, the bits of the output times sigmoid(the sums added in order) after it; read
    in place (a GPU's way) the same bits. Interpreted: the arithmetic's test."""
    from kinetic.kernels import pallas_matmul
    H, Q = 4, 8
    k, v, table = cache(np.float32, seed=7)
    rng = np.random.default_rng(8)
    slots = np.array([0, 1, 2, 1, 0], np.int32)
    positions = np.array([0, 3, 23, 9, 17], np.int32)
    T = len(slots)
    q = rng.standard_normal((T, H, Q)).astype(np.float32)
    parts = rng.standard_normal((3, T + 11, 2 * H * Q + 16)).astype(np.float32)
    # (interpreted, on a GPU too: XLA's sigmoid after the kernel and Triton's inside it
    # are not one function there)
    got = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, gate=parts,
                                     interpret=True))
    gate = np.asarray(pallas_matmul.summed(parts))[:T, :2 * H * Q].reshape(T, H, 2, Q)[:, :, 1]
    import jax
    plain = paged_attention(q, k, v, table, slots, positions, 0.35, interpret=True)
    want = np.asarray(plain * jax.nn.sigmoid(gate))
    assert got.tobytes() == want.tobytes()
    in_place = np.asarray(pa._attention(q, k, v, table.astype(np.int32), slots, positions,
                                        positions, 0.35, 0, 0.0, True, True, H // k.shape[2],
                                        parts))
    assert in_place.tobytes() == got.tobytes()
    # the keys in lanes (a GPU's default): the gate applied by the merging program
    split = np.asarray(paged_attention(q, k, v, table, slots, positions, 0.35, gate=parts,
                                       interpret=True, split=3))
    plain = paged_attention(q, k, v, table, slots, positions, 0.35, interpret=True, split=3)
    assert split.tobytes() == np.asarray(plain * jax.nn.sigmoid(gate)).tobytes()
    in_place = np.asarray(pa._split_attention(q, k, v, table.astype(np.int32), slots,
                                              positions, positions, 0.35, 0, 0.0, True, True,
                                              H // k.shape[2], 3, parts))
    assert in_place.tobytes() == split.tobytes()
    with pytest.raises(ValueError, match="pallas kernel"):
        layers.paged_attention(q, k, v, step(table, slots, positions), 0.35, kernel="xla",
                               gate=parts)


def test_a_gpu_splits_a_rows_keys_unless_told_whole(monkeypatch):
    """KINETIC_GPU_ATTENTION: a GPU's attention takes a row's keys in SPLIT_LANES lanes by
    default (more programs for a decode step's few rows), interpreted one program walks
    them all, either when the variable says so; anything else is one clear error."""
    monkeypatch.delenv("KINETIC_GPU_ATTENTION", raising=False)
    assert pa.split_lanes(interpret=False) == pa.SPLIT_LANES > 1
    assert pa.split_lanes(interpret=True) == 0
    monkeypatch.setenv("KINETIC_GPU_ATTENTION", "whole")
    assert pa.split_lanes(interpret=False) == 0
    monkeypatch.setenv("KINETIC_GPU_ATTENTION", "split")
    assert pa.split_lanes(interpret=True) == pa.SPLIT_LANES
    monkeypatch.setenv("KINETIC_GPU_ATTENTION", "chunks")
    with pytest.raises(ValueError, match="KINETIC_GPU_ATTENTION='chunks'"):
        pa.split_lanes(interpret=False)
