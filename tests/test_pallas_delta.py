"""Qwen3.5's gated delta rule as a Pallas kernel (kinetic/kernels/pallas_delta.py), run
interpreted on the CPU (compiled on a GPU): the numpy reference's values (kinetic/kernels/reference.py
delta_rule, the C++ kernel's bits) within float32 rounding for prompt rows, replays of
accepted drafts, draft rows and padding; a row's outputs and its slot's state the same bits
alone and beside other rows; the model's recurrence takes it where a step is traced for a
GPU (delta_net.recurrence_kernel)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.kernels import pallas_delta, pallas_matmul, reference, target
from kinetic.model import delta_net

TAPS, SLOTS, PENDING, EPS = 4, 2, 3, 1e-6
S = SLOTS + 3                  # the slots, PADDING, SCRATCH, ZERO (delta_net.extra_states)
PAD, SCRATCH, ZERO = delta_net.extra_states(SLOTS)


def case(seed: int, H: int, HK: int, D: int, rows=None):
    """Random states and a layer's inputs; rows (default): slot 0's prompt rows (from the
    zero state, then onwards), slot 1's next row (after its replays, where there are), a
    draft row from it into the scratch state, a padding row, slot 0 again; replays: two of
    slot 1's pending inputs."""
    C = 2 * HK * D + H * D
    E = C + 2 * H
    rng = np.random.default_rng(seed)
    f32 = np.float32
    taps = (rng.standard_normal((C, TAPS)) * 0.5).astype(f32)
    windows = rng.standard_normal((S, TAPS - 1, C)).astype(f32)
    matrices = (rng.standard_normal((S, H, D, D)) * 0.1).astype(f32)
    windows[ZERO], matrices[ZERO] = 0, 0
    pending = rng.standard_normal((SLOTS + 1, PENDING + 1, E)).astype(f32)
    pending[..., C:C + H] = -np.abs(pending[..., C:C + H])           # g: log-decays
    pending[..., C + H:] = 1 / (1 + np.exp(-pending[..., C + H:]))   # beta in (0, 1)
    if rows is None:
        rows = np.array([[ZERO, 0, 1, 1, PAD, 0],            # read
                         [0, 0, 1, SCRATCH, PAD, 0],         # write
                         [0, 0, 1, 1, SLOTS, 0],             # slot (SLOTS: padding's)
                         [-1, -1, -1, 0, -1, -1]], np.int32)  # pend (row 3 a draft)
    T = rows.shape[1]
    inputs = (rng.standard_normal((T, C)).astype(f32),             # mixed
              rng.standard_normal((T, H * D)).astype(f32),         # z
              rng.standard_normal((T, H)).astype(f32),             # beta, before sigmoid
              rng.standard_normal((T, H)).astype(f32),             # alpha
              rng.standard_normal(H).astype(f32),                  # dt_bias
              -np.abs(rng.standard_normal(H)).astype(f32),         # a
              (1 + 0.1 * rng.standard_normal(D)).astype(f32))      # the output's norm
    replay = np.array([[1, 1, 0], [0, 2, 0]], np.int32)
    return taps, (windows, matrices, pending), inputs, rows, replay


def reference_layer(taps, state, inputs, rows, replay, n_replay, H, HK):
    """The layer's middle in numpy: delta_net.py's decay and beta, the C++ kernel's
    recurrence (reference.delta_rule), the output's RMS norm gated by silu(z)."""
    mixed, z, beta, alpha, dt_bias, a, norm = (np.float64(x) for x in inputs)
    g = np.logaddexp(alpha + dt_bias, 0) * a
    events = np.concatenate([mixed, g, 1 / (1 + np.exp(-beta))], axis=1).astype(np.float32)
    out, *new = reference.delta_rule(taps, *state, events, rows, replay, n_replay, H, HK, EPS)
    T, D = out.shape[0], out.shape[2]
    out = np.float64(out)
    gated = (out / np.sqrt(np.mean(out * out, axis=2, keepdims=True) + EPS) * norm
             * (z / (1 + np.exp(-z))).reshape(T, H, D))
    return gated.reshape(T, H * D), new


def as_partials(inputs, rows: int):
    """The four projections as pallas_matmul's partial sums would give them: three parts
    over K per value, adding up to about it (a row's parts its own values' alone), and
    padding rows and columns past the step's; the weights as they are."""
    out = []
    for x in inputs[:4]:
        parts = np.full((3, rows + 5, x.shape[1] + 3), 7.0, np.float32)
        parts[0, :rows, :x.shape[1]] = x * np.float32(0.625)
        parts[1, :rows, :x.shape[1]] = x * np.float32(0.25)
        parts[2, :rows, :x.shape[1]] = x * np.float32(0.125)
        out.append(parts)
    return (*out, *inputs[4:])


def exact_inputs(inputs, rows):
    """inputs made exactly what their partial sums add up to (in the kernel's order:
    pallas_backend.load_sum's, pallas_matmul.summed's)."""
    parts = as_partials(inputs, rows)
    return (*(pallas_matmul.summed(p)[:rows, :x.shape[1]]
              for p, x in zip(parts[:4], inputs)), *parts[4:])


def run(taps, state, inputs, rows, replay, n_replay, H, HK, interpret=None):
    """The kernel on a case: interpreted here, compiled on a GPU (scripts/device_check.sh)
    unless `interpret` says."""
    T = rows.shape[1]
    out, new = pallas_delta.delta_rule(
        jnp.asarray(taps), tuple(map(jnp.asarray, state)), as_partials(inputs, T),
        jnp.asarray(rows), jnp.asarray(replay), jnp.asarray([n_replay], np.int32), T, H, HK,
        EPS, interpret)
    return np.asarray(out), tuple(map(np.asarray, new))


def close(got, want):
    """Within float32 rounding of want (bench/gpu_preflight.py checks the GPU's kernels so)."""
    err, top = np.abs(np.float64(got) - want).max(), np.abs(want).max()
    assert err <= 2e-5 * max(1.0, top), f"off by {err:.3g} (largest value {top:.3g})"


SHAPES = [(4, 2, 16), (2, 2, 8), (3, 1, 64)]   # (value heads, key heads, width): 64 > COLUMNS


@pytest.mark.parametrize("n_replay", [0, 2])
@pytest.mark.parametrize("H,HK,D", SHAPES)
def test_the_kernel_is_the_references_values(H, HK, D, n_replay):
    taps, state, inputs, rows, replay = case(H * 10 + D, H, HK, D)
    inputs = exact_inputs(inputs, rows.shape[1])
    got_out, got = run(taps, state, inputs, rows, replay, n_replay, H, HK)
    want_out, want = reference_layer(taps, state, inputs, rows, replay, n_replay, H, HK)
    for g, w in [(got_out, want_out), *zip(got, want)]:
        close(g, w)
    C = inputs[0].shape[1]
    kept = got[2][0, PENDING, :C]                 # slot 0's last row kept its mixed inputs
    assert kept.tobytes() == inputs[0][5].tobytes()
    assert not np.array_equal(got[1][1], state[1][1])             # slot 1's state moved on
    assert got[1][ZERO].tobytes() == state[1][ZERO].tobytes()     # ZERO never written
    assert got[0][ZERO].tobytes() == state[0][ZERO].tobytes()


@pytest.mark.parametrize("H,HK,D", SHAPES[:2])
def test_a_rows_bits_are_its_own_alone_and_beside_others(H, HK, D):
    """Slot 0's three prompt rows alone, then beside slot 1's rows and a draft, and then
    with padding rows up to 64: its outputs and its state the same bits each time."""
    taps, state, inputs, rows, replay = case(7, H, HK, D)
    mine = [0, 1, 5]

    def rows_of(x, idx):
        return x if x.ndim == 1 else x[idx]
    alone_out, alone = run(taps, state, [rows_of(x, mine) for x in inputs], rows[:, mine],
                           replay, 0, H, HK)
    shared_out, shared = run(taps, state, inputs, rows, replay, 2, H, HK)
    pad = np.tile(np.array([[PAD], [PAD], [SLOTS], [-1]], np.int32), (1, 64 - len(mine)))
    padded_rows = np.concatenate([rows[:, mine], pad], axis=1)
    many = [x if x.ndim == 1 else np.concatenate([x[mine], np.resize(x, (61, x.shape[1]))])
            for x in inputs]
    padded_out, padded = run(taps, state, many, padded_rows, replay, 0, H, HK)
    for out, new in [(shared_out[mine], shared), (padded_out[:len(mine)], padded)]:
        assert out.tobytes() == alone_out.tobytes()
        for got, want in zip(new[:2], alone[:2]):
            assert got[0].tobytes() == want[0].tobytes()   # slot 0's window and matrix


def test_a_shape_it_cannot_run_is_a_clear_error():
    taps, state, inputs, rows, replay = case(1, 4, 2, 16)
    assert not pallas_delta.supported(4, 2, 12, TAPS)   # a width not a power of 2
    assert not pallas_delta.supported(3, 2, 16, TAPS)   # value heads not a multiple
    with pytest.raises(ValueError, match="not a shape it runs"):
        run(taps, state, inputs, rows, replay, 0, 3, 2)


def test_the_model_takes_it_for_a_gpu(monkeypatch):
    """delta_net.delta_net_layer under target.for_gpu() (Pallas still interpreted here: the
    kernel's own interpret flag) runs the kernel; KINETIC_GPU_DELTA=xla keeps XLA's loop,
    whose values it agrees with within rounding."""
    from kinetic.kernels import pallas_backend
    from kinetic.model import layers
    H, HK, D = 4, 2, 16
    taps, state, inputs, rows, replay = case(3, H, HK, D)
    inputs = exact_inputs(inputs, rows.shape[1])
    mixed, z, beta, alpha, dt_bias, a, norm = inputs
    cfg = types.SimpleNamespace(ssm_v_heads=H, ssm_k_heads=HK, ssm_state=D, ssm_conv=TAPS,
                                norm_eps=EPS)
    recur = delta_net.Recur(*map(jnp.asarray, rows), *map(jnp.asarray, replay),
                            jnp.asarray([2], np.int32))
    w = {"ssm_conv1d": taps, "ssm_dt.bias": dt_bias, "ssm_a": a, "ssm_norm": norm,
         "ssm_out": "out", "attn_qkv": "qkv", "attn_gate": "z", "ssm_beta": "beta",
         "ssm_alpha": "alpha"}   # (the projections' stand-ins: linear_many is the test's)
    monkeypatch.setattr(pallas_backend, "interpreted", lambda interpret: True)
    # the projections' outputs as given, the output projection left out
    parts = as_partials(inputs, rows.shape[1])[:4]
    monkeypatch.setattr(delta_net, "linear_many", lambda x, ws, partials=False: (
        parts if partials else (mixed, z, beta, alpha)))
    monkeypatch.setattr(delta_net, "linear", lambda x, w, pending: x)
    monkeypatch.setattr(layers, "pallas_norms", lambda: False)

    def step(kernel_env):
        monkeypatch.setenv("KINETIC_GPU_DELTA", kernel_env)
        with target.for_gpu():
            assert delta_net.recurrence_kernel(cfg) == kernel_env
            out, new = jax.jit(lambda s: delta_net.delta_net_layer(jnp.zeros((6, 8)), w, s, recur, cfg))(
                tuple(map(jnp.asarray, state)))
        return [np.asarray(a) for a in (out, *new)]

    pallas, xla = step("pallas"), step("xla")
    kernel_out, kernel = run(taps, state, inputs, rows, replay, 2, H, HK, interpret=True)
    for got, want in zip(pallas, (kernel_out, *kernel)):
        assert got.tobytes() == want.tobytes()
    for got, want in zip(pallas, xla):
        close(got, want)
    monkeypatch.setenv("KINETIC_GPU_DELTA", "fast")
    with target.for_gpu(), pytest.raises(ValueError, match="KINETIC_GPU_DELTA"):
        delta_net.recurrence_kernel(cfg)


def test_whole_steps_through_the_kernel_keep_the_contract(tmp_path, monkeypatch):
    """A tiny Qwen3.5 on kernel "pallas" with its delta-rule layers through this kernel
    (interpreted, as a GPU would run them): a row's logits the same bits fed one row a
    step, three, all at once and beside another sequence; and a greedy answer the same
    tokens and log-probabilities with drafts (the model drafting for itself: accepted
    drafts replayed through the kernel, rejected ones dropped) as without."""
    calls = []
    monkeypatch.setattr(delta_net, "recurrence_kernel",
                        lambda cfg: calls.append(1) or "pallas")
    # traced afresh (a step another test compiled on the C++ recurrence is kept by
    # kinetic's compile cache and JAX's, keyed by what does not see this patch), and not
    # kept for the tests after
    from kinetic import compile_cache
    monkeypatch.setitem(compile_cache._state, "enabled", False)
    jax.clear_caches()
    try:
        check_whole_steps(tmp_path, calls)
    finally:
        jax.clear_caches()


def check_whole_steps(tmp_path, calls):
    from kinetic.engine.engine import Engine
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.model.loader import load_model
    from kinetic.text.tokenizer import Tokenizer
    from tests.test_invariance import OTHERS, PROMPT, check_row_buckets, requests, run
    from tests.tiny_models import write_tiny_model
    model = load_model(str(write_tiny_model(tmp_path / "qwen35.gguf", "qwen35",
                                            qtype="Q8_0", context_length=256)),
                       kernel="pallas")
    tok = Tokenizer.from_metadata(model.file.metadata)
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:6],
                      (tok.encode(OTHERS[1]) * 2)[:6], step=8)
    assert calls
    request = requests(tok)["greedy"]
    answers = []
    for draft in (None, model):
        engine = Engine(model, tok, EngineConfig(n_ctx=256, parallel=2,
                                                 speculative=draft is not None), draft=draft)
        try:
            answers.append(run(engine, request)[:2])
            accepted = engine.counters()["draft_accepted"]
        finally:
            engine.close()
        assert (accepted > 0) == (draft is not None)
    assert len(answers[0][0]) == 20 and answers[1] == answers[0]
