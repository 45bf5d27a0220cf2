"""Qwen3.5's gated delta rule in C++ (kinetic/kernels/csrc/delta_rule.h, under jit through
kinetic_delta_rule): the numpy reference's bits (kinetic/kernels/reference.py delta_rule)
for prompt rows, replays of accepted drafts, draft rows and padding; the XLA recurrence's
values within float32 rounding; bad indices are clear errors, nothing written."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic import kernels
from kinetic.kernels import reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernel is not built")

H, HK, D, TAPS, SLOTS, PENDING = 4, 2, 16, 4, 2, 3
S = SLOTS + 3                  # the slots, PADDING, SCRATCH, ZERO (delta_net.extra_states)


def case(seed: int, D: int = D):
    """Random states and events; rows: slot 0's prompt rows (from the zero state, then
    onwards), slot 1's next row (after its replays, where there are: they change what it
    reads), a draft row from it into the scratch state, a padding row, slot 0 again;
    replays: two of slot 1's pending inputs."""
    C = 2 * HK * D + H * D
    E = C + 2 * H
    rng = np.random.default_rng(seed)
    taps = (rng.standard_normal((C, TAPS)) * 0.5).astype(np.float32)
    windows = rng.standard_normal((S, TAPS - 1, C)).astype(np.float32)
    matrices = (rng.standard_normal((S, H, D, D)) * 0.1).astype(np.float32)
    windows[S - 1], matrices[S - 1] = 0, 0                  # ZERO
    pending = rng.standard_normal((SLOTS + 1, PENDING + 1, E)).astype(np.float32)
    events = rng.standard_normal((6, E)).astype(np.float32)
    events[:, C:C + H] = -np.abs(events[:, C:C + H])        # g: log-decays
    events[:, C + H:] = 1 / (1 + np.exp(-events[:, C + H:]))  # beta in (0, 1)
    pending[..., C:C + H] = -np.abs(pending[..., C:C + H])
    rows = np.array([[4, 0, 1, 1, 3, 0],                    # read (4: ZERO)
                     [0, 0, 1, 3, 2, 0],                    # write (3: SCRATCH, 2: PADDING)
                     [0, 0, 1, 1, 2, 0],                    # slot (2: padding's)
                     [-1, -1, -1, 0, -1, -1]], np.int32)    # pend (row 3 a draft)
    replay = np.array([[1, 1, 0], [0, 2, 0]], np.int32)
    return taps, (windows, matrices, pending), events, rows, replay


def run_native(taps, state, events, rows, replay, n_replay):
    from kinetic.kernels import ffi
    f = jax.jit(lambda *a: ffi.delta_rule(*a, heads=H, key_heads=HK, eps=1e-6))
    out, new = f(jnp.asarray(taps), tuple(map(jnp.asarray, state)), jnp.asarray(events),
                 jnp.asarray(rows), jnp.asarray(replay), jnp.asarray([n_replay], np.int32))
    return np.asarray(out), tuple(map(np.asarray, new))


@pytest.mark.parametrize("n_replay", [0, 2])
@pytest.mark.parametrize("seed,width", [(0, 16), (1, 16), (2, 20)])   # 20: a 4-column tail
def test_the_kernel_is_the_references_bits(seed, width, n_replay):
    taps, state, events, rows, replay = case(seed, width)
    got_out, got = run_native(taps, state, events, rows, replay, n_replay)
    want_out, *want = reference.delta_rule(taps, *state, events, rows, replay, n_replay, H,
                                           HK, 1e-6)
    assert got_out.tobytes() == want_out.tobytes()
    for g, w in zip(got, want):
        assert g.tobytes() == w.tobytes()
    assert not np.array_equal(got[1][1], state[1][1])         # slot 1's state moved on
    assert got[1][S - 1].tobytes() == state[1][S - 1].tobytes()   # ZERO never written


def test_the_xla_recurrence_agrees_within_rounding(monkeypatch):
    """The model's XLA path (kinetic/model/delta_net.py, exp and sums in XLA's own order)
    against the kernel: the same values within float32 rounding."""
    from kinetic.kernels import ffi
    from kinetic.model import delta_net
    taps, state, events, rows, replay = case(3)
    cfg = types.SimpleNamespace(ssm_v_heads=H, ssm_k_heads=HK, ssm_state=D, ssm_conv=TAPS,
                                norm_eps=1e-6)
    recur = delta_net.Recur(*map(jnp.asarray, rows), *map(jnp.asarray, replay),
                            jnp.asarray([2], np.int32))
    native_out, native = run_native(taps, state, events, rows, replay, 2)
    monkeypatch.setattr(ffi, "usable", lambda: False)
    xla_out, xla = jax.jit(lambda *a: delta_net.recurrence(cfg, *a))(
        jnp.asarray(taps), tuple(map(jnp.asarray, state)), jnp.asarray(events), recur)
    for a, b in [(native_out, xla_out), *zip(native, xla)]:
        b = np.asarray(b)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max())


def test_an_index_out_of_range_is_an_error_and_writes_nothing():
    taps, state, events, rows, replay = case(4)
    for bad_rows, bad_replay in [(rows.copy(), replay), (rows, replay.copy())]:
        if bad_rows is not rows:
            bad_rows[0, 2] = S                 # a state past the last
        else:
            bad_replay[1, 0] = PENDING + 1     # a pending place past the last
        with pytest.raises(Exception, match="kinetic_delta_rule: delta_rule: .*out of range"):
            run_native(taps, state, events, bad_rows, bad_replay, 2)


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_every_path_gives_the_references_bits(isa):
    """The head updates on each kernel path (forced), 1 and 2 threads: the reference's bits,
    with a head width of 20 (one 16-column vector and a 4-column tail)."""
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    taps, state, events, rows, replay = case(5, 20)
    want = reference.delta_rule(taps, *state, events, rows, replay, 2, H, HK, 1e-6)
    for threads in (1, 2):
        got = kernels.delta_rule_host(taps, *state, events, rows, replay, 2, H, HK, 1e-6,
                                      isa=isa, threads=threads)
        for g, w in zip(got, want):
            assert g.tobytes() == w.tobytes(), (isa, threads)
