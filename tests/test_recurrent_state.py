"""The per-slot recurrent state of Qwen3.5's delta-rule layers (kinetic/model/delta_net.py,
kinetic/engine/recurrent_state.py), on a tiny random-weight model, bitwise:

- a verification step's drafts commit nothing: whatever number of them is accepted, the next
  step (which first replays the accepted drafts' inputs) gives the logits of plain one-token
  decoding;
- several decode steps in one call give the tokens of one step per call;
- a row at a position its slot's state does not cover is refused, and a snapshot taken in one
  slot, restored in another, resumes the sequence with the same logits;
- the scheduler cuts a prompt's chunk at its last page boundary, asks for a snapshot there,
  resumes a later prompt from the snapshot (only), and drops a snapshot with its page;
- through the engine: a conversation continued from a cached prefix resumes from the snapshot
  and answers as cold.
"""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.engine.engine import Engine
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.recurrent_state import StateNotRestored, StateSnapshots
from kinetic.engine.request import GenerationRequest
from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.engine.sampling_params import SamplingParams
from kinetic.engine.scheduler import Scheduler
from kinetic.engine.sequence import SchedulerConfig, Sequence
from kinetic.model.loader import load_model
from kinetic.text.tokenizer import Tokenizer
from tests.test_invariance import run
from tests.tiny_models import write_tiny_model

PS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("qwen35") / "tiny-qwen35.gguf", "qwen35",
                            qtype="Q8_0", output_scale=4.0, context_length=1024)
    return load_model(str(path))


def _runner(model, slots: int = 2, max_draft: int = 4,
            step_tokens: int = 32) -> tuple[Runner, np.ndarray]:
    cfg = RunnerConfig(step_tokens=step_tokens, num_slots=slots, page_size=PS,
                       num_pages=1 + 4 * slots, pages_per_slot=4, max_draft=max_draft,
                       decode_steps=4)
    table = np.arange(1, 1 + 4 * slots, dtype=np.int32).reshape(slots, 4)
    return Runner(model, cfg), table


def _step(runner, table, slot, tokens, start, drafts=None):
    pos = np.arange(start, start + len(tokens))
    write = table[slot, pos // PS] * PS + pos % PS
    return np.asarray(runner.step_device(np.asarray(tokens), pos, np.full(len(pos), slot),
                                         write, table, None, drafts))[:len(pos)]


IDS = [int(x) for x in np.random.default_rng(7).integers(100, 5000, 40)]


def _plain(model) -> np.ndarray:
    """The logits of IDS fed one token per step: the reference."""
    runner, table = _runner(model)
    return np.concatenate([_step(runner, table, 0, [t], i) for i, t in enumerate(IDS)])


@pytest.mark.parametrize("accepted", [0, 1, 3, 4])
def test_drafts_commit_nothing_and_accepted_ones_are_replayed(model, accepted):
    want = _plain(model)
    runner, table = _runner(model)
    got = [_step(runner, table, 0, IDS[:20], 0)]
    # verify: the newest token (20) and 4 drafts, the first `accepted` of them right
    drafts = IDS[21:21 + accepted] + [7] * (4 - accepted)
    verify = _step(runner, table, 0, [IDS[20]] + drafts, 20, np.array([0, 1, 1, 1, 1], bool))
    got.append(verify[:1 + accepted])
    # the next step starts after the accepted drafts and the token the verification chose
    nxt = 21 + accepted
    got.append(_step(runner, table, 0, IDS[nxt:nxt + 3], nxt))
    assert np.concatenate(got).tobytes() == np.concatenate(
        [want[:21 + accepted], want[nxt:nxt + 3]]).tobytes()


def test_decode_steps_in_one_call_are_one_step_per_call(model):
    runner, table = _runner(model)
    _step(runner, table, 0, IDS[:20], 0)
    first = int(np.argmax(_step(runner, table, 0, [IDS[20]], 20)[0]))
    one = [first]   # each token drawn from the logits after the one before
    for i in range(4):
        one.append(int(np.argmax(_step(runner, table, 0, [one[-1]], 21 + i)[0])))
    several, table2 = _runner(model)
    _step(several, table2, 0, IDS[:21], 0)
    grid = np.arange(21, 25)[:, None]
    drawn = np.asarray(several.decode_steps(
        np.array([first]), grid, np.array([0]), table2[0, grid // PS] * PS + grid % PS, table2,
        (None,)))[:, 0]
    assert drawn.tolist() == one[1:]   # step i feeds one[i] and draws one[i + 1]


def test_a_row_without_its_state_is_refused_and_a_snapshot_restores_it(model):
    want = _plain(model)
    runner, table = _runner(model)
    _step(runner, table, 0, IDS[:32], 0)
    snapshot = runner.save_state(0)
    assert snapshot.position == 32
    with pytest.raises(StateNotRestored, match="slot 1"):
        _step(runner, table, 1, IDS[32:34], 32)
    # slot 1's pages get slot 0's cached rows (as a prefix hit would share them)
    table[1] = table[0]
    runner.load_state(1, snapshot)
    assert _step(runner, table, 1, IDS[32:36], 32).tobytes() == want[32:36].tobytes()


def test_the_scheduler_cuts_at_the_prompt_boundary_snapshots_and_resumes_there():
    sched = Scheduler(SchedulerConfig(step_tokens=64, num_slots=2, page_size=PS, num_pages=17,
                                      pages_per_slot=8, chunk_tokens=64))
    sched.snapshots = StateSnapshots(4)
    prompt = list(range(1, 41))           # 40 tokens: the last page boundary before 39 is 32
    sched.add(Sequence(1, prompt, max_tokens=2))
    plan = sched.schedule()
    assert len(plan) == 32                # cut at the boundary, although 64 rows were free
    sched.complete(plan, {})
    saves = sched.take_state_saves()
    assert [(slot, pos) for slot, _, pos, _ in saves] == [(0, 32)]
    sched.snapshots.put(saves[0][1], ("state",))
    plan = sched.schedule()
    assert len(plan) == 8 and plan.positions[0] == 32
    sched.complete(plan, {1: 5})
    sched.finish(1)
    # a prompt sharing 38 tokens resumes at the snapshot (32), not at the 2 pages' 32 + more
    sched.add(Sequence(2, prompt[:38] + [99, 98, 97], max_tokens=2))
    plan = sched.schedule()
    assert plan.positions[0] == 32 and plan.state_loads == [(plan.slots[0], ("state",))]
    # one sharing 20 tokens has no snapshot at 16: it starts from the beginning
    sched.add(Sequence(3, prompt[:20] + [50] * 10, max_tokens=2))
    plan = sched.schedule()
    rows = plan.positions[np.asarray(plan.seq_ids) == 3]
    assert rows[0] == 0


def test_a_snapshot_is_dropped_with_its_page():
    sched = Scheduler(SchedulerConfig(step_tokens=64, num_slots=1, page_size=PS, num_pages=5,
                                      pages_per_slot=4, chunk_tokens=64))
    sched.snapshots = StateSnapshots(4)
    sched.add(Sequence(1, list(range(1, 21)), max_tokens=1))
    plan = sched.schedule()
    sched.complete(plan, {})
    (slot, key, pos, tag), = sched.take_state_saves()
    sched.snapshots.put(key, ("state",))
    plan = sched.schedule()
    sched.complete(plan, {1: 3})
    assert key in sched.snapshots
    # a request that needs every page evicts the first one's page, and its snapshot goes too
    sched.add(Sequence(2, list(range(100, 160)), max_tokens=1))
    sched.complete(sched.schedule(), {})
    sched.schedule()
    assert key not in sched.snapshots


def test_a_continued_conversation_resumes_from_the_snapshot_as_cold(model):
    tok = Tokenizer.from_metadata(model.file.metadata)
    first = tok.encode("The days of the week are Monday, Tuesday, Wednesday and so on, "
                       "then the weekend comes with Saturday and Sunday.", add_special=True)
    second = first + tok.encode(" And the months: January, February, March")
    request = GenerationRequest(second, SamplingParams(temperature=0.0), max_tokens=12,
                                logprobs=2)
    config = EngineConfig(n_ctx=512, parallel=2)
    cold = Engine(model, tok, config)
    warm = Engine(model, tok, config)
    try:
        want = run(cold, request)
        run(warm, GenerationRequest(first, SamplingParams(temperature=0.0), max_tokens=4))
        got = run(warm, request)
    finally:
        cold.close()
        warm.close()
    assert want[2] == 0
    assert got[2] == (len(first) - 1) // PS * PS > 0
    assert got[:2] == want[:2]


def test_compiling_every_shape_touches_no_slot_state(model):
    """Runner.compile runs every step shape and decode loop (as `kinetic serve` does at start)
    on the padding state slot: the slots' records and states stay as they were."""
    want = _plain(model)
    runner, table = _runner(model, max_draft=2, step_tokens=4)
    for start in range(0, 20, 4):
        _step(runner, table, 0, IDS[start:start + 4], start)
    runner.compile()
    assert runner.state.committed == [20, 0]
    assert _step(runner, table, 0, IDS[20:24], 20).tobytes() == want[20:24].tobytes()


def test_a_files_multi_token_prediction_block_is_read_past(model, tmp_path):
    """A Qwen3.5 file with its multi-token-prediction block (nextn_predict_layers: a full
    attention block and the nextn tensors after the decoder's, counted in block_count) loads
    as the decoder alone, with the same logits."""
    path = write_tiny_model(tmp_path / "mtp.gguf", "qwen35", qtype="Q8_0", output_scale=4.0,
                            context_length=1024, mtp_layers=1)
    with_mtp = load_model(str(path))
    assert with_mtp.config.n_layer == model.config.n_layer == 4
    assert with_mtp.config.n_layer_unused == 1
    want = _plain(model)
    runner, table = _runner(with_mtp)
    assert _step(runner, table, 0, IDS[:8], 0).tobytes() == want[:8].tobytes()
