"""The determinism contract (docs/architecture.md), bitwise, on a real model: a greedy and a seeded
request give identical token ids and log-probabilities
  (1) alone, (2) while 3 other requests of different lengths run, (3) with --parallel 1
  and 4, (4) with the prompt cold, fully cached and partly cached, (5) with speculative
  decoding on and off, (6) with a different prefill chunking, (7) with the prompt's start
  run before by a prefill (/v1/prefill), alone or beside a stream.
"""

from __future__ import annotations

import queue
import threading

import pytest

from kinetic.engine.engine import Engine
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.request import GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from kinetic.model.loader import load_model
from kinetic.text.tokenizer import Tokenizer
from tests.conftest import real_model_file
from tests.test_model_forward import host_step

pytestmark = pytest.mark.real_model

# Repetitive enough that n-gram drafts are proposed and some accepted.
PROMPT = ("Days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
          "Again: Monday, Tuesday, Wednesday,")
# Of different lengths; the last is long enough that the steps it shares read a longer
# (padded) key axis than the request alone does (Runner.key_bucket).
OTHERS = ["Hi", "Write a long story about a dragon who learns to count to one hundred.",
          " ".join(f"item {i}," for i in range(100))]


@pytest.fixture(scope="module")
def setup():
    yield from engines_over(load_model(real_model_file("smollm2")))


def engines_over(model):
    """A fixture's body: yields (tokenizer, engine(name, draft=None, **EngineConfig fields),
    model), `engine` making each named engine over `model` once (n_ctx 512) and keeping it;
    closes them all after."""
    tok = Tokenizer.from_metadata(model.file.metadata)
    engines: dict[str, Engine] = {}

    def engine(name: str, draft=None, **kw) -> Engine:
        if name not in engines:
            engines[name] = Engine(model, tok, EngineConfig(n_ctx=512, **kw), draft=draft)
        return engines[name]
    yield tok, engine, model
    for e in engines.values():
        e.close()


def requests(tok):
    ids = tok.encode(PROMPT, add_special=True, parse_special=True)
    greedy = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=20, logprobs=3)
    seeded = GenerationRequest(ids, SamplingParams(temperature=0.9, seed=1234), max_tokens=20,
                               logprobs=3)
    return {"greedy": greedy, "seeded": seeded}


def run(engine: Engine, request: GenerationRequest):
    """(token ids, [(token, logprob, top alternatives)], cached tokens) of one request."""
    ids, lps, usage = [], [], None
    for d in engine.generate(request):
        ids += d.token_ids
        lps += [(lp.token, lp.logprob, lp.top) for lp in d.logprobs]
        usage = d.usage or usage
    assert usage is not None and len(ids) == usage.completion_tokens
    return ids, lps, usage.cached_tokens


def alongside(engine: Engine, others: list[GenerationRequest], fn):
    """fn()'s result, called while `others` run on `engine` from their own threads (joined
    before returning)."""
    threads = [threading.Thread(target=lambda r=r: list(engine.generate(r))) for r in others]
    for t in threads:
        t.start()
    result = fn()
    for t in threads:
        t.join()
    return result


def run_with_others(engine: Engine, request: GenerationRequest, tok):
    others = [GenerationRequest(tok.encode(t), SamplingParams(temperature=0.7, seed=i),
                                max_tokens=12 + 5 * i) for i, t in enumerate(OTHERS)]
    return alongside(engine, others, lambda: run(engine, request))


def test_answer_alone_and_among_fifteen_others_at_parallel_16(setup):
    """At --parallel 16 a request gives the same tokens and log-probabilities among 15
    others of mixed lengths, that fill every step, as alone on a 4-slot engine: greedy with
    its prompt cold, then seeded with the same prompt cached."""
    tok, engine, _ = setup
    wide = engine("p16", parallel=16)
    texts = [OTHERS[i % 3][:10 + 25 * i] + f" {i}" for i in range(15)]   # up to ~100 tokens
    others = [GenerationRequest(tok.encode(t), SamplingParams(temperature=0.3 * (i % 3),
                                                              seed=100 + i),
                                max_tokens=4 + 3 * (i % 6)) for i, t in enumerate(texts)]
    for kind, request in requests(tok).items():
        want = run(engine("p4-alone-" + kind, parallel=4), request)[:2]
        done: list = []
        threads = [threading.Thread(target=lambda r=r: done.append(len(list(wide.generate(r)))))
                   for r in others]
        for t in threads:
            t.start()
        got = run(wide, request)[:2]
        for t in threads:
            t.join()
        assert len(done) == len(others) and got == want, kind


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_answer_never_depends_on_load(setup, kind):
    tok, engine, model = setup
    check_never_depends_on_load(tok, engine, model, requests(tok)[kind], kind)


def check_never_depends_on_load(tok, engine, model, request: GenerationRequest, kind: str):
    """(1) to (6) of the module's list for `request` (20 tokens), `engine(name, **config)`
    making and keeping engines over `model`."""
    # (1) alone, cold, on a 4-slot engine
    ids, lps, cached = run(engine(f"p4-{kind}", parallel=4), request)
    assert len(ids) == 20 and cached == 0
    want = (ids, lps)
    # (4) fully cached: the same prompt again on the same engine
    again = run(engine(f"p4-{kind}", parallel=4), request)
    assert again[2] > 0 and again[:2] == want
    # (2) with 3 other requests of different lengths sharing the steps
    assert run_with_others(engine("p4-busy", parallel=4), request, tok)[:2] == want
    # (3) one slot
    assert run(engine("p1", parallel=1), request)[:2] == want
    # (4) partly cached: a different request with the same first 32 tokens ran before
    partial = GenerationRequest(request.prompt[:32] + tok.encode(" Fruits: pear"),
                                SamplingParams(temperature=0.0), max_tokens=4)
    fresh = engine(f"partial-{kind}", parallel=2)
    run(fresh, partial)
    got = run(fresh, request)
    assert 0 < got[2] < len(request.prompt) and got[:2] == want
    # (5) speculative decoding off, and drafts from a draft model (the model itself: every
    # draft is proposed, most are accepted)
    assert run(engine("nospec", parallel=4, speculative=False), request)[:2] == want
    assert run(engine("draft-model", parallel=4, draft=model), request)[:2] == want
    # (6) prompt processed in chunks of 5 tokens instead of 16
    assert run(engine("chunk5", parallel=4, chunk_tokens=5), request)[:2] == want


@pytest.mark.parametrize("kv_dtype", ["float32", "q8_0"])
def test_answer_never_depends_on_load_with_every_cache_type(setup, kv_dtype):
    """The default cache (float16) runs every check above; the other types (-ctk f32, q8_0:
    quantized and rotated) the main ones: alone, fully and partly cached, beside 3 other
    requests, with one slot, without drafts."""
    tok, engine, model = setup

    def typed(name: str, draft=None, **kw):
        return engine(f"{kv_dtype}-{name}", draft, kv_dtype=kv_dtype, **kw)
    request = requests(tok)["seeded"]
    ids, lps, cached = run(typed("p4", parallel=4), request)
    want = (ids, lps)
    assert len(ids) == 20 and cached == 0
    assert run(typed("p4", parallel=4), request)[:2] == want
    assert run_with_others(typed("p4", parallel=4), request, tok)[:2] == want
    assert run(typed("p1", parallel=1, speculative=False), request)[:2] == want
    partial = GenerationRequest(request.prompt[:32] + tok.encode(" Fruits: pear"),
                                SamplingParams(temperature=0.0), max_tokens=4)
    run(typed("p1", parallel=1, speculative=False), partial)
    got = run(typed("p1", parallel=1, speculative=False), request)
    assert 0 < got[2] < len(request.prompt) and got[:2] == want


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_answer_after_a_prefill_of_its_start_is_the_cold_answer(setup, kind):
    """(7) A prefill (Engine.prefill, what /v1/prefill runs) of the prompt's start, alone or
    while another request streams beside it: then the request, served from the prefill's
    pages, answers bitwise as on a fresh engine."""
    tok, engine, _ = setup
    request = requests(tok)[kind]
    cold = run(engine(f"prefill-cold-{kind}", parallel=2), request)
    assert cold[2] == 0
    warm = engine(f"prefill-warm-{kind}", parallel=2)
    streaming, deltas = threading.Event(), queue.SimpleQueue()

    def sink(delta) -> None:
        deltas.put(delta)
        if delta.token_ids:
            streaming.set()
    warm.start(GenerationRequest(tok.encode(OTHERS[1]), SamplingParams(temperature=0.7, seed=3),
                                 max_tokens=30), sink)
    assert streaming.wait(300)   # it decodes (a request arriving would end the prefill)
    done = warm.prefill(request.prompt[:-2])
    while deltas.get(timeout=300).finish_reason is None:
        pass
    assert done.cached_tokens == (len(request.prompt) - 2) // 16 * 16 > 0
    got = run(warm, request)
    assert got[2] == done.cached_tokens and got[:2] == cold[:2]


def test_answers_are_the_same_with_several_decode_steps_per_call_and_one(setup):
    """Greedy requests without logprobs run several decode steps per device call (the
    engine's default decode_steps) when nothing else waits: the same tokens and finish as
    one step per call, alone, with a stop string and ignore_eos, and among 15 others at
    --parallel 16 (whose seeded and logprob rows make some turns ordinary steps)."""
    tok, engine, _ = setup
    ids = tok.encode(PROMPT, add_special=True, parse_special=True)
    plain = GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=23)
    stop = GenerationRequest(ids, SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=30, stop=[" Friday"])

    def answer(e, request):
        out, reason = [], None
        for d in e.generate(request):
            out += d.token_ids
            reason = d.finish_reason or reason
        return out, reason

    one = engine("one-step", parallel=4, decode_steps=1, speculative=False)
    several = engine("four-steps", parallel=4, decode_steps=4, speculative=False)
    for request in (plain, stop):
        before = several.counters()["decode_step_calls"]
        want = answer(one, request)
        assert answer(several, request) == want
        assert several.counters()["decode_step_calls"] > before   # the path ran
    assert answer(one, stop)[1] == "stop"
    wide = engine("p16-steps", parallel=16, speculative=False)
    texts = [OTHERS[i % 3][:10 + 25 * i] + f" {i}" for i in range(15)]
    others = [GenerationRequest(tok.encode(t), SamplingParams(temperature=0.3 * (i % 2),
                                                              seed=i),
                                max_tokens=4 + 5 * (i % 4), logprobs=2 if i % 5 == 0 else None)
              for i, t in enumerate(texts)]
    assert alongside(wide, others, lambda: answer(wide, plain)) == answer(one, plain)


def test_decode_steps_run_past_max_tokens_and_drop_the_rest(setup):
    """Streams that end at different steps keep several decode steps per call to their last
    token (decode_steps.plan: rows past a stream's max_tokens are computed and dropped, as a
    rejected draft's), and a call's rows may pass the step's (8 streams x 4 steps = 32 rows
    at -np 8, whose steps hold 16): each of eight greedy requests of 5 to 12 tokens, started
    together, gets exactly its max_tokens tokens, finish "length", the tokens it gets alone
    at one step a call, and the engine ends with no sequence."""
    tok, engine, _ = setup
    one = engine("one-step", parallel=4, decode_steps=1, speculative=False)
    several = engine("p8-four-steps", parallel=8, decode_steps=4, speculative=False)
    assert several.runner.config.step_tokens == 16 and several.runner.decode_steps_at(8) == 4
    reqs = [GenerationRequest(tok.encode(OTHERS[i % 3] + f" {i}"),
                              SamplingParams(temperature=0.0, ignore_eos=True), max_tokens=5 + i)
            for i in range(8)]

    def answer(e, request):
        out, reason, usage = [], None, None
        for d in e.generate(request):
            out += d.token_ids
            reason, usage = d.finish_reason or reason, d.usage or usage
        return out, reason, usage.completion_tokens

    want = [answer(one, r) for r in reqs]
    assert [w[1:] for w in want] == [("length", 5 + i) for i in range(8)]
    before = several.counters()["decode_step_calls"]
    got = [None] * 8
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, answer(several, reqs[i])))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert several.counters()["decode_step_calls"] > before   # the path ran
    assert several.stats().requests_processing == 0


def test_drafts_are_proposed_and_accepted(setup):
    tok, engine, model = setup
    e = engine("p4-greedy", parallel=4)
    before = e.counters()
    run(e, requests(tok)["greedy"])
    after = e.counters()
    assert after["draft_tokens"] > before["draft_tokens"]
    assert after["draft_accepted"] > before["draft_accepted"]


def test_prefix_evicted_to_host_memory_comes_back_identical(setup):
    """A prompt whose pages were evicted from the device (a small pool, two long requests
    in between) is restored from host memory: same answer, its prefix counted as cached."""
    tok, engine, model = setup
    e = engine("small-pool", parallel=1, num_pages=33)  # 32 usable pages = one context
    request = requests(tok)["seeded"]
    first = run(e, request)
    for i in range(2):
        filler = tok.encode(" ".join(f"{w}{i}" for w in ["alpha", "beta", "gamma"] * 60))
        run(e, GenerationRequest(filler[:400], SamplingParams(temperature=0.0), max_tokens=2))
    assert e.counters()["pages_to_host"] > 0
    again = run(e, request)
    assert e.counters()["pages_from_host"] > 0
    assert again[2] == (len(request.prompt) - 1) // 16 * 16  # every full page reused
    assert again[:2] == first[:2]


DAYS_GRAMMAR = '''root ::= (" " day ",")+ " done."
day ::= "Monday" | "Tuesday" | "Wednesday" | "Thursday"'''


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_constrained_answer_never_depends_on_load_or_drafts(setup, kind):
    """With a grammar, drafts that leave it are cut and every row is masked: the answer is
    the same alone, batched, without drafting and with a draft model, and it follows the
    grammar. The prompt's own history drafts " Friday", which the grammar rejects."""
    import dataclasses
    import re

    from kinetic.grammar import compile_gbnf
    tok, engine, model = setup
    request = dataclasses.replace(requests(tok)[kind], grammar=compile_gbnf(DAYS_GRAMMAR),
                                  max_tokens=24)
    e = engine(f"p4-{kind}", parallel=4)
    before = e.counters()
    ids, lps, _ = run(e, request)
    assert e.counters()["draft_tokens"] > before["draft_tokens"]
    text = tok.decode(ids)
    assert re.fullmatch(r"( (Monday|Tuesday|Wednesday|Thursday),)+( done\.)?", text), text
    want = (ids, lps)
    assert run_with_others(engine("p4-busy", parallel=4), request, tok)[:2] == want
    assert run(engine("nospec", parallel=4, speculative=False), request)[:2] == want
    assert run(engine("draft-model", parallel=4, draft=model), request)[:2] == want


def test_a_row_has_the_same_bits_in_every_row_bucket(setup):
    """The runner steps at the smallest row bucket (1, 2, 4, ... 16) that holds its rows:
    a prompt fed one row per step (M = 1) gives bitwise the logits it gets inside one
    16-row step, and inside 16-row steps shared with another sequence's rows."""
    tok, _, model = setup
    if model.config.kernel != "ffi":
        pytest.skip("row buckets are the ffi kernel's: XLA's dot is not batch-invariant")
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:16],
                      (tok.encode(OTHERS[1]) * 2)[:16])


def check_row_buckets(model, ids: list[int], other: list[int], step: int = 16) -> None:
    """Prompt tokens `ids` (at most `step`, 16 positions) give the same logits fed one row
    per step, 3 rows, all in one step, and in `step`-row steps of half ours, half tokens
    `other` of another sequence (the other's rows first)."""
    import numpy as np

    from kinetic.engine.runner import Runner, RunnerConfig
    cfg = RunnerConfig(step_tokens=step, num_slots=2, page_size=16, num_pages=9,
                       pages_per_slot=4)
    table = np.array([[1, 2, 3, 4], [5, 6, 7, 8]], np.int32)

    def feed(rows_per_step: int, with_other: bool) -> np.ndarray:
        runner, got = Runner(model, cfg), []
        for start in range(0, len(ids), rows_per_step):
            pos = np.arange(start, min(start + rows_per_step, len(ids)))
            toks, slots = np.asarray(ids)[pos], np.zeros(len(pos), int)
            if with_other:  # the other sequence's rows first, then ours
                opos = pos[: step - len(pos)]
                toks = np.concatenate([np.asarray(other)[opos], toks])
                slots = np.concatenate([np.ones(len(opos), int), slots])
                pos = np.concatenate([opos, pos])
            write = table[slots, pos // 16] * 16 + pos % 16
            logits = host_step(runner, toks, pos, slots, write, table)
            got.append(logits[slots == 0])
        return np.concatenate(got)

    alone = feed(1, False)
    assert feed(len(ids), False).tobytes() == alone.tobytes()
    assert feed(3, False).tobytes() == alone.tobytes()
    assert feed(step // 2, True).tobytes() == alone.tobytes()


def test_a_step_computes_only_the_logit_rows_asked_for(setup):
    """A prompt chunk samples only its last row, a chunk before it none, a decode step its
    rows (Runner.step_device logit_rows). With the C++ kernel every want is one compiled
    shape a bucket ([B, V], the asked rows computed and written, the others not): an asked
    row's logits are its bits from the all-rows step; a step that asks for none (the
    projection skipped) fills the cache as the all-rows step does, so the next step's
    logits are the same bits; and the step compiles no shape of its own for one row or
    none."""
    import numpy as np

    from kinetic.engine.runner import Runner, RunnerConfig
    tok, _, model = setup
    if model.config.kernel != "ffi":
        pytest.skip("logit rows are the ffi kernel's: XLA's dot is not batch-invariant")
    ids = np.asarray((tok.encode(PROMPT, add_special=True) * 3)[:20])
    cfg = RunnerConfig(step_tokens=16, num_slots=1, page_size=16, num_pages=3, pages_per_slot=2)
    table = np.array([[1, 2]], np.int32)
    V = model.config.vocab_size

    def chunk(runner, lo, hi, want):
        pos = np.arange(lo, hi)
        write = table[0, pos // 16] * 16 + pos % 16
        return np.asarray(runner.step_device(ids[pos], pos, np.zeros(len(pos)), write, table,
                                             want))

    full, some = Runner(model, cfg), Runner(model, cfg)
    assert all(full._logit_shape(b, want) == "mask"
               for b in full.row_buckets for want in (None, [0], [], [1, 2]))
    all_rows = chunk(full, 0, 16, None)
    assert all_rows.shape == (16, V)
    assert chunk(some, 0, 16, []).shape == (16, V)
    last = chunk(full, 16, 20, None)[:4]
    one = chunk(some, 16, 20, [3])
    assert one.shape == (4, V)
    assert one[3].tobytes() == last[3].tobytes()
    # below the T-row bucket, [] gives the bucket's rows, none computed
    assert chunk(Runner(model, cfg), 0, 4, []).shape == (4, V)
    # several rows: the bucket's rows, those asked for with their bits
    several = chunk(Runner(model, cfg), 0, 16, [2, 7, 15])
    assert several.shape == all_rows.shape
    assert several[[2, 7, 15]].tobytes() == all_rows[[2, 7, 15]].tobytes()
    # all rows of a step under its bucket: its rows with their bits
    padded = chunk(Runner(model, cfg), 0, 5, None)
    assert padded.shape == (8, V)
    assert padded[:5].tobytes() == all_rows[:5].tobytes()
