"""The engine over the hand-calculable mock model (tests/mock_model.py): exact tokens,
finish reasons, usage, stop strings, context limits, prefix reuse, cancellation, seeded
sampling, log-probabilities, speculative decoding, scoring, the async interface and stats.

Reminder of the mock's rule: after `tokens` the next token is (sum(tokens) + len(tokens)) % 31,
then x -> 2x + 1 (mod 31); token 27 ends generation. "hello" = [7, 4, 11, 11, 14] sums to 47,
so its answer starts at (47 + 5) % 31 = 21 "v" and runs round v m z u k (21 12 25 20 10).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import types
from typing import AsyncIterator

import numpy as np
import pytest

from kinetic.engine.request import Delta, GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from kinetic.engine.sequence import ContextOverflow
from tests import mock_model as mm
from tests.mock_model import TIMEOUT, Collector, Gate, Paused, Result, greedy, ids, run

HELLO = ids("hello")
VMZUK = [21, 12, 25, 20, 10]


def sampled(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, **kw)


def behind_three(e, request):
    """`request`'s Collector after it ran with three sampled requests ahead of it, all
    admitted together (its rows sit elsewhere in every step), and the three Collectors."""
    with Paused(e):
        others = [Collector() for _ in range(3)]
        for i, c in enumerate(others):
            e.start(GenerationRequest(ids("abcdefgh"[i:]), params=sampled(i), max_tokens=20), c)
        mine = Collector()
        e.start(request, mine)
    return mine.wait(), others



def all_at_once(e, requests):
    """The results of `requests` started together, so that they share the engine's steps."""
    with Paused(e):
        outs = [Collector() for _ in requests]
        for r, out in zip(requests, outs):
            e.start(r, out)
    return [out.wait() for out in outs]


@pytest.fixture
def engine(make_engine):
    return make_engine()  # 2 slots, 64-token context, 16-row steps, 4-token pages


@pytest.fixture
def long_engine(make_engine):
    """A 4096-token context: an unbounded answer runs for thousands of steps, so a request
    the test leaves early is certainly still running when its cancel arrives."""
    return make_engine(n_ctx=4096, page_size=16)


# --- tokens, finish reasons, usage ------------------------------------------------------------

def test_greedy_answer_is_the_hand_computed_one(engine):
    r = run(engine, GenerationRequest(HELLO, max_tokens=12, speculative=False))
    assert r.tokens == VMZUK + VMZUK + [21, 12]
    assert r.text == "vmzukvmzukvm"
    assert [d.token_ids for d in r.deltas[:-1]] == [(t,) for t in r.tokens]  # a token a step
    assert r.finish_reason == "length"
    assert (r.tokens, r.finish_reason) == greedy(HELLO, 12)


def test_prompt_longer_than_a_step_is_chunked_over_pages(engine):
    prompt = ids("the quick brown fox jumps over the lazy dog")  # 43 rows: 3 steps, 11 pages
    expected, reason = greedy(prompt, 10)
    assert len(expected) == 10 and reason == "length"
    r = run(engine, GenerationRequest(prompt, max_tokens=10))
    assert r.tokens == expected and r.text == mm.text_of(expected)


def test_chunk_size_changes_nothing(make_engine):
    prompt = ids("the quick brown fox jumps over the lazy dog")
    e = make_engine(chunk_tokens=3)  # 15 chunks of at most 3 rows
    r = run(e, GenerationRequest(prompt, max_tokens=10, logprobs=1))
    assert r.tokens == greedy(prompt, 10)[0]
    assert r.logprobs == run(make_engine(), GenerationRequest(prompt, max_tokens=10,
                                                              logprobs=1)).logprobs


def test_max_tokens_ends_with_length_and_usage_counts(engine):
    r = run(engine, GenerationRequest(HELLO, params=SamplingParams(temperature=0.0, seed=42),
                                      max_tokens=7))
    assert r.tokens == VMZUK + [21, 12]
    assert r.finish_reason == "length"
    u = r.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.seed) == (5, 7, 0, 42)
    assert r.deltas[-1].token_ids == () and r.deltas[-1].text == ""


def test_eog_ends_the_answer_and_is_not_emitted(engine):
    # "abc": (0 + 1 + 2 + 3) % 31 = 6 "g", then 13 "n", then 27 = EOG
    r = run(engine, GenerationRequest(ids("abc"), max_tokens=10))
    assert r.tokens == [6, 13] and r.text == "gn"
    assert r.finish_reason == "stop" and r.usage.completion_tokens == 2
    # " " = [26]: (26 + 1) % 31 = 27, EOG at once: no token at all
    r = run(engine, GenerationRequest(ids(" "), max_tokens=10))
    assert r.tokens == [] and r.text == "" and r.finish_reason == "stop"
    assert r.usage.completion_tokens == 0 and len(r.deltas) == 1
    # ignore_eos bans 27: the runner-up 28 follows "gn"; then (3 + 6 + 13 + 28 + 6) % 31 = 25
    r = run(engine, GenerationRequest(ids("abc"), params=SamplingParams(
        temperature=0.0, ignore_eos=True), max_tokens=5))
    assert r.tokens == [6, 13, 28, 25, 20] and r.finish_reason == "length"
    assert (r.tokens, r.finish_reason) == greedy(ids("abc"), 5, banned={mm.EOG})


def test_logit_bias_bans_and_boosts(engine):
    # banning "m" (12) after "v": the runner-up 13 "n" is taken; then (47 + 21 + 13 + 7) % 31
    # = 26 " ", and the cycle 26 22 14 29 28 (" wo" + "é") follows
    r = run(engine, GenerationRequest(HELLO, params=SamplingParams(
        temperature=0.0, logit_bias=((12, -100.0),)), max_tokens=10))
    assert r.tokens == [21, 13, 26, 22, 14, 29, 28, 26, 22, 14] and r.text == "vn woé wo"
    assert (r.tokens, r.finish_reason) == greedy(HELLO, 10, banned={12})
    # +5 on "a" (0) beats every target (the best logit is 0, "a" is never below -30)
    r = run(engine, GenerationRequest(HELLO, params=SamplingParams(
        temperature=0.0, logit_bias=((0, 31.0),)), max_tokens=4))
    assert r.tokens == [0, 0, 0, 0]


def test_stop_string_across_tokens_is_not_emitted(engine):
    r = run(engine, GenerationRequest(HELLO, stop=("zu",), speculative=False))
    assert [(d.token_ids, d.text) for d in r.deltas] == [
        ((21,), "v"), ((12,), "m"), ((25,), ""), ((20,), ""), ((), "")]
    assert r.finish_reason == "stop" and r.usage.completion_tokens == 4


def test_possible_stop_start_is_held_back_then_released(engine):
    r = run(engine, GenerationRequest(HELLO, stop=("zq", "xyz"), max_tokens=7,
                                      speculative=False))
    assert [d.text for d in r.deltas] == ["v", "m", "", "zu", "k", "v", "m", ""]
    assert r.finish_reason == "length"
    # held text still pending at the end comes out with the final delta
    r = run(engine, GenerationRequest(HELLO, stop=("zq",), max_tokens=3, speculative=False))
    assert [d.text for d in r.deltas] == ["v", "m", "", "z"] and r.finish_reason == "length"


def test_stop_string_inside_accepted_drafts_cuts_the_answer_there(engine):
    # "ukvmzukv" first ends at the 11th token, when n-gram drafts are being accepted: the
    # tokens accepted after it in the same step are dropped
    r = run(engine, GenerationRequest(HELLO, stop=("ukvmzukv",), max_tokens=40))
    assert r.text == "vmz" and r.finish_reason == "stop"
    assert r.tokens == greedy(HELLO, 11)[0] and r.usage.completion_tokens == 11
    assert len(r.deltas[-2].token_ids) > 1  # the stop came inside an accepted draft


def test_a_character_split_over_tokens_is_held_until_complete(engine):
    # "n" = [13]: 14 "o", then 29 and 28 (the two bytes of "é"), 26 " ", 22 "w"
    r = run(engine, GenerationRequest(ids("n"), max_tokens=5, speculative=False))
    assert r.tokens == [14, 29, 28, 26, 22]
    assert [d.text for d in r.deltas] == ["o", "", "é", " ", "w", ""]
    r = run(engine, GenerationRequest(ids("n"), max_tokens=2, speculative=False))
    assert [d.text for d in r.deltas] == ["o", "", "\ufffd"]  # an unfinished byte at the end


# --- context limits ---------------------------------------------------------------------------

def test_prompt_that_does_not_fit_is_refused_at_once(engine):
    assert engine.max_context == 64
    for n in (64, 65, 200):
        with pytest.raises(ContextOverflow, match=f"{n} tokens"):
            engine.start(GenerationRequest([0] * n), Collector())
        with pytest.raises(ValueError):  # ContextOverflow is a ValueError, raised at once
            next(engine.generate(GenerationRequest([0] * n)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.start(GenerationRequest([0, mm.V]), Collector())
    with Paused(engine) as p:  # nothing was queued, nothing runs
        p.assert_only_this_runs()
    # 63 tokens fit: 63 % 31 = 1 "b", then (1 + 64) % 31 = 3; 65 tokens pass the context
    r = run(engine, GenerationRequest([0] * 63))
    assert r.tokens == [1, 3] and r.finish_reason == "length"


def test_answer_reaching_the_context_end_stops_with_length(engine):
    expected, reason = greedy(HELLO, n_ctx=64)
    assert len(expected) == 60 and reason == "length"  # 5 + 60 = 65: the last needs no K/V
    r = run(engine, GenerationRequest(HELLO))
    assert r.tokens == expected and r.finish_reason == "length"
    assert r.usage.completion_tokens == 60
    r = run(engine, GenerationRequest(HELLO, speculative=False))  # drafts never pass the end
    assert r.tokens == expected and r.finish_reason == "length"


# --- prefix reuse -----------------------------------------------------------------------------

def test_shared_prefix_is_taken_from_the_cache_and_changes_nothing(engine):
    prompt = ids("thequickbrown")  # 13 tokens: 3 full pages of 4 can be reused
    expected = greedy(prompt, 6)[0]
    first = run(engine, GenerationRequest(prompt, max_tokens=6))
    assert first.tokens == expected and first.usage.cached_tokens == 0
    again = run(engine, GenerationRequest(prompt, max_tokens=6))
    assert again.tokens == expected and again.usage.cached_tokens == 12
    assert again.usage.prompt_tokens == 13
    other = prompt[:9] + ids("zz")  # shares 2 full pages
    r = run(engine, GenerationRequest(other, max_tokens=6))
    assert r.usage.cached_tokens == 8 and r.tokens == greedy(other, 6)[0]
    # exactly 3 full pages: the last token is always computed, so 2 pages are reused
    r = run(engine, GenerationRequest(prompt[:12], max_tokens=6))
    assert r.usage.cached_tokens == 8 and r.tokens == greedy(prompt[:12], 6)[0]
    # the answer's own rows were kept too: prompt + its answer reuses 4 whole pages and the
    # 2 rows of the partly filled fifth (host memory keeps a finished request's last page)
    longer = prompt + expected
    r = run(engine, GenerationRequest(longer, max_tokens=6))
    assert r.usage.cached_tokens == 18 and r.tokens == greedy(longer, 6)[0]


@pytest.mark.parametrize("host_cache_mb", [0, 1])
def test_evicted_prefix_comes_back_from_host_memory(make_engine, host_cache_mb):
    # one slot of 8 pages and no page more: the second request evicts all of the first's
    e = make_engine(parallel=1, n_ctx=32, num_pages=9, host_cache_mb=host_cache_mb)
    prompt = ids("thequickbrown")
    first = run(e, GenerationRequest(prompt, max_tokens=3))  # 3 full prompt pages kept
    filler = [30] * 29  # 29 + 2 tokens: every page
    assert run(e, GenerationRequest(filler, max_tokens=2)).tokens == greedy(filler, 2)[0]
    # the 3 whole pages evicted, and the first request's partly filled last page, kept when
    # it finished
    assert e.counters()["pages_to_host"] == (4 if host_cache_mb else 0)
    again = run(e, GenerationRequest(prompt, max_tokens=3))
    assert again.tokens == first.tokens == greedy(prompt, 3)[0]
    assert again.usage.cached_tokens == (12 if host_cache_mb else 0)
    assert e.counters()["pages_from_host"] == (3 if host_cache_mb else 0)


def test_a_running_sequence_shares_its_prefix_pages(engine):
    prompt = ids("thequickbrown")
    a_gate = Gate(at=2)  # a's second step: its first one registered 3 full prompt pages
    a = engine.start(GenerationRequest(prompt, max_tokens=20, speculative=False), a_gate)
    a_gate.wait_reached()
    a_pages = list(engine.scheduler.sequences[a].pages)
    c_gate = Gate(at=1)
    c = engine.start(GenerationRequest(prompt, max_tokens=3), c_gate)
    a_gate.release()
    c_gate.wait_reached()  # c admitted next to the running a, reading a's pages
    c_seq = engine.scheduler.sequences[c]
    assert c_seq.num_cached == 12 and c_seq.pages[:3] == a_pages[:3]
    assert c_seq.pages[3] not in a_pages
    assert [engine.scheduler.pages.refcount(p) for p in a_pages[:3]] == [2, 2, 2]
    engine.scheduler.check_invariants()
    c_gate.release()
    r = c_gate.wait()
    assert r.tokens == greedy(prompt, 3)[0] and r.usage.cached_tokens == 12
    assert a_gate.wait().tokens == greedy(prompt, 20)[0]
    with Paused(engine) as p:
        p.assert_only_this_runs()


# --- cancellation -----------------------------------------------------------------------------

def test_cancel_frees_the_slot_and_pages_at_once(engine):
    gate = Gate(at=3)  # holds the engine inside the step that samples the 3rd token
    seq_id = engine.start(GenerationRequest(HELLO, speculative=False), gate)
    gate.wait_reached()
    held = list(engine.scheduler.sequences[seq_id].pages)
    assert len(held) == 2 and [engine.scheduler.pages.refcount(p) for p in held] == [1, 1]
    engine.cancel(seq_id)
    gate.release()
    r = gate.wait()
    # the step in flight completes; the cancel is taken before the next one
    assert r.tokens == VMZUK[:3] and r.finish_reason == "cancelled"
    assert r.usage.completion_tokens == 3
    with Paused(engine) as p:
        p.assert_only_this_runs()
        # 7 computed tokens: the full first page stays reusable, the partial one is free
        assert engine.scheduler.pages.evictable == held[:1]
        assert p.seq.pages[0] == held[1]   # the freed partial page, reused first
    engine.cancel(seq_id)  # cancelling a finished request does nothing
    assert run(engine, GenerationRequest(HELLO, max_tokens=3)).tokens == VMZUK[:3]


def test_leaving_generate_early_cancels(long_engine):
    request = GenerationRequest(HELLO, speculative=False)  # would run for 4091 steps
    for delta in long_engine.generate(request):
        assert delta.token_ids == (21,)
        break
    with Paused(long_engine) as p:
        p.assert_only_this_runs()
    gen = long_engine.generate(request)
    assert next(gen).token_ids == (21,)
    gen.close()
    with Paused(long_engine) as p:
        p.assert_only_this_runs()


def test_cancel_of_a_queued_request(long_engine):
    engine = long_engine
    with Paused(engine):  # the held request takes one of the two slots
        long = [Collector() for _ in range(2)]
        ids_ = [engine.start(GenerationRequest(HELLO, speculative=False), c) for c in long]
        queued = Collector()
        queued_id = engine.start(GenerationRequest(ids("abc")), queued)
        engine.cancel(queued_id)
    r = queued.wait()
    assert r.tokens == [] and r.finish_reason == "cancelled"
    for seq_id in ids_:
        engine.cancel(seq_id)
    assert all(c.wait().finish_reason == "cancelled" for c in long)
    with Paused(engine) as p:
        p.assert_only_this_runs()


# --- sampling, log-probabilities, speculative decoding ----------------------------------------

def test_seeded_sampling_repeats_alone_and_batched(make_engine):
    e = make_engine(parallel=4)
    request = GenerationRequest(HELLO, params=sampled(7), max_tokens=30, logprobs=3)
    alone, again = run(e, request), run(e, request)
    assert [d.token_ids for d in again.deltas] == [d.token_ids for d in alone.deltas]
    assert again.logprobs == alone.logprobs and again.text == alone.text
    assert again.usage.cached_tokens == 4 and again.usage.seed == alone.usage.seed == 7
    # top_p 0.95 and min_p 0.05 keep exactly the 3 best tokens (p = 0.63, 0.23, 0.09)
    context = list(HELLO)
    for t in alone.tokens:
        assert (t - mm.target(context)) % mm.V in (0, 1, 2)
        context.append(t)
    assert len(alone.tokens) == 23 and alone.tokens != greedy(HELLO, 30)[0][:len(alone.tokens)]
    # batched: three requests ahead of it, so its rows sit elsewhere in every step
    batched, others = behind_three(e, request)
    assert batched.tokens == alone.tokens and batched.logprobs == alone.logprobs
    assert batched.text == alone.text and batched.finish_reason == alone.finish_reason
    assert all(c.wait().finish_reason for c in others)
    answers = {tuple(run(e, GenerationRequest(HELLO, params=sampled(s), max_tokens=20)).tokens)
               for s in range(4)}
    assert len(answers) > 1  # the seed matters


def test_logprobs_are_the_log_softmax_of_the_mock_logits(engine):
    r = run(engine, GenerationRequest(HELLO, max_tokens=8, logprobs=5))
    assert len(r.logprobs) == 8 and [lp.token for lp in r.logprobs] == r.tokens
    context = list(HELLO)
    for lp in r.logprobs:
        t, ref = mm.target(context), mm.log_softmax(mm.logits_of(context))
        assert lp.token == t
        assert lp.logprob == pytest.approx(ref[t], abs=1e-6)
        assert [i for i, _ in lp.top] == [(t + j) % mm.V for j in range(5)]
        assert [x for _, x in lp.top] == pytest.approx([ref[(t + j) % mm.V] for j in range(5)],
                                                       abs=1e-6)
        context.append(t)
    # a sampled token's logprob is its own, not the best one's
    r = run(engine, GenerationRequest(HELLO, params=sampled(7), max_tokens=20, logprobs=0))
    context, off_target = list(HELLO), 0
    for lp in r.logprobs:
        ref = mm.log_softmax(mm.logits_of(context))
        assert lp.top == () and lp.logprob == pytest.approx(ref[lp.token], abs=1e-6)
        off_target += lp.token != mm.target(context)
        context.append(lp.token)
    assert off_target > 0
    assert run(engine, GenerationRequest(HELLO, max_tokens=3)).logprobs == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), sampled(8),
    SamplingParams(temperature=0.0, frequency_penalty=0.6),  # 2 repeats: -1.2 < runner-up
    SamplingParams(temperature=0.0, dry_multiplier=0.8, dry_allowed_length=2),
], ids=["greedy", "sampled", "frequency-penalty", "dry"])
def test_speculative_decoding_gives_the_same_tokens_and_logprobs(make_engine, params):
    on, off = make_engine(), make_engine(speculative=False)
    steps = []
    step_device = on.runner.step_device
    on.runner.step_device = lambda *a: steps.append(1) or step_device(*a)  # counts steps
    request = GenerationRequest(HELLO, params=params, max_tokens=40, logprobs=2)
    a, b = run(on, request), run(off, request)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.text == b.text and a.finish_reason == b.finish_reason
    assert all(len(d.token_ids) <= 1 for d in b.deltas)
    if params == SamplingParams(temperature=0.0):
        assert a.tokens == greedy(HELLO, 40)[0]
        assert max(len(d.token_ids) for d in a.deltas) > 1  # drafts were accepted
        assert len(steps) < 40
    elif params.temperature == 0:  # the penalties break the plain cycle
        assert a.tokens != greedy(HELLO, 40)[0][:len(a.tokens)]


# --- scoring ----------------------------------------------------------------------------------

def test_score_gives_the_logits_of_every_position(engine):
    tokens = ids("thequickbrownfoxjumpsoverthelazydog")  # 35 rows: 3 steps
    expected = np.stack([mm.logits_of(tokens[:i + 1]) for i in range(len(tokens))])
    out = engine.score(tokens)
    assert out.dtype == np.float32 and out.shape == (35, mm.V)
    np.testing.assert_array_equal(out, expected)
    run(engine, GenerationRequest(tokens, max_tokens=2))  # its pages are now in the cache
    np.testing.assert_array_equal(engine.score(tokens), expected)  # still every row
    other = Collector()  # and in steps shared with a generation
    engine.start(GenerationRequest(HELLO, speculative=False), other)
    np.testing.assert_array_equal(engine.score(tokens), expected)
    assert other.wait().tokens == greedy(HELLO, n_ctx=64)[0]
    with Paused(engine) as p:
        p.assert_only_this_runs()


# --- the async interface and stats ------------------------------------------------------------

async def submit(engine, request: GenerationRequest) -> AsyncIterator[Delta]:
    """The request's deltas as an async iterator, as the server's bridge gives them
    (api/core.generation): leaving it early cancels the request."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue = asyncio.Queue()
    seq_id = engine.start(request, lambda d: loop.call_soon_threadsafe(out.put_nowait, d))
    done = False
    try:
        while not done:
            delta = await out.get()
            done = delta.finish_reason is not None
            yield delta
    finally:
        if not done:
            engine.cancel(seq_id)


def test_async_submit_and_leaving_early(long_engine):
    e = long_engine
    requests = [GenerationRequest(ids(w), max_tokens=10) for w in ("hello", "abc", "thequick")]

    async def collect(request):
        return Result([d async for d in submit(e, request)])

    async def main():
        results = await asyncio.gather(*(collect(r) for r in requests))
        request = GenerationRequest(HELLO, speculative=False)
        async with contextlib.aclosing(submit(e, request)) as it:
            async for first in it:
                break
        # queued after the cancel: once it has answered, the cancel has been handled (and
        # its "cancelled" delta reached this loop while it still runs)
        after = await collect(GenerationRequest(ids("abc")))
        return results, first, after

    results, first, after = asyncio.run(main())
    for request, r in zip(requests, results):
        assert (r.tokens, r.finish_reason) == greedy(request.prompt, 10)
    assert first.token_ids == (21,)
    assert after.tokens == [6, 13] and after.finish_reason == "stop"
    with Paused(e) as p:
        p.assert_only_this_runs()


def test_stats_while_requests_run(engine):
    st = engine.stats()
    assert (st.queue_length, st.requests_processing) == (0, 0)
    assert [s.busy for s in st.slots] == [False, False]
    gate = Gate(at=1)
    with Paused(engine):  # all three reach the engine together
        a = engine.start(GenerationRequest(HELLO, max_tokens=3), gate)
        b_out, c_out = Collector(), Collector()
        b = engine.start(GenerationRequest(ids("abcd"), max_tokens=3), b_out)
        engine.start(GenerationRequest(ids("xyz"), max_tokens=3), c_out)
    gate.wait_reached()  # a's first token: a and b were admitted into the 2 slots, c waits
    st = engine.stats()
    assert (st.queue_length, st.requests_processing) == (1, 2)
    assert [(s.slot, s.busy, s.seq_id, s.n_prompt_tokens, s.n_cached, s.n_decoded)
            for s in st.slots] == [(0, True, a, 5, 0, 0), (1, True, b, 4, 0, 0)]
    gate.release()
    assert gate.wait().tokens == VMZUK[:3]
    assert b_out.wait().tokens == [10, 21, 12]
    assert c_out.wait().tokens == [13]  # (23 + 24 + 25 + 3) % 31 = 13, then 27 = EOG
    with Paused(engine) as p:
        p.assert_only_this_runs()
        st = engine.stats()
        assert (st.queue_length, st.requests_processing) == (0, 1)


# --- consumers that go away, and failures -----------------------------------------------------
# The first two were engine bugs found by these tests (fixed in 8bd68d0): a sink that raised
# killed the engine thread, and the failure handler stopped at the first sink that raised.

def test_cancelled_submit_after_its_loop_closed_leaves_the_engine_alive(engine, monkeypatch):
    done, died = threading.Event(), threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: (died.set(), done.set()))

    async def leave_before_the_first_token():
        it = submit(engine, GenerationRequest(HELLO))
        task = asyncio.ensure_future(it.__anext__())
        await asyncio.sleep(0)  # one turn of the loop: start() has queued the request
        task.cancel()           # the consumer goes away (a client disconnect): cancel
        with pytest.raises(asyncio.CancelledError):
            await task

    with Paused(engine):  # the add and the cancel are handled after the loop has closed
        asyncio.run(leave_before_the_first_token())
    later = Collector()
    try:
        engine.start(GenerationRequest(ids("abc")),
                     lambda d: (later(d), d.finish_reason and done.set()))
    except RuntimeError:  # the engine is already dead
        died.set()
        done.set()
    assert done.wait(TIMEOUT)
    assert not died.is_set(), "the engine thread died"
    assert later.wait().tokens == [6, 13]
    with Paused(engine) as p:
        p.assert_only_this_runs()


def test_a_raising_sink_ends_its_request_and_no_other(engine, monkeypatch):
    died = threading.Event()
    monkeypatch.setattr(threading, "excepthook", lambda args: died.set())
    other = Collector()

    def broken(delta):
        raise RuntimeError("a broken sink")

    with Paused(engine):  # both reach the engine together and share steps
        engine.start(GenerationRequest(HELLO, max_tokens=3), broken)
        engine.start(GenerationRequest(ids("abc")), other)
    assert other.wait().tokens == [6, 13]
    with Paused(engine) as p:  # the broken one was ended and its pages freed
        p.assert_only_this_runs()
    assert not died.is_set()


def test_an_engine_failure_reaches_every_request(make_engine, monkeypatch):
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)

    def forward(weights, cfg, cache, step):
        raise RuntimeError("a broken model")

    monkeypatch.setattr(mm, "mock_model", lambda: mm.LoadedModel(
        None, mm.CONFIG, {}, types.SimpleNamespace(forward=forward)))
    e = make_engine()
    outs = [Collector() for _ in range(3)]
    for c, text in zip(outs, ("hello", "abc", "xyz")):
        try:
            e.start(GenerationRequest(ids(text)), c)
        except RuntimeError as err:  # already dead: refused at once, saying why
            c(Delta(finish_reason="error", error=str(err)))
    for c in outs:
        r = c.wait()
        assert r.finish_reason == "error" and "a broken model" in r.deltas[-1].error
    with pytest.raises(RuntimeError, match="engine error: RuntimeError: a broken model"):
        e.start(GenerationRequest(HELLO), Collector())
    e.close()
    assert [type(a.exc_value) for a in died] == [RuntimeError]



def test_close_ends_requests_still_running(make_engine):
    """Closing an engine sends every request still in it a final 'cancelled' delta, so no
    generate() is left waiting."""
    e = make_engine(parallel=1)
    gen = e.generate(GenerationRequest(HELLO, max_tokens=None, speculative=False))
    assert next(gen).finish_reason is None
    e.close()
    rest = list(gen)
    assert rest and rest[-1].finish_reason == "cancelled"


def test_no_request_compiles_after_engine_compile(make_engine):
    """Engine.compile compiles every sampler variant a request can select: greedy, seeded,
    penalties over the whole context, DRY, Mirostat, logit bias, ignore_eos and logprobs,
    alone or mixed in one step (logprobs for some of its rows), then add no compiled entry
    (a compile on a request would stall every stream)."""
    from jax._src import dispatch, monitoring

    from kinetic.engine import sampler
    engine = make_engine(parallel=4)
    # the ffi kernel's row buckets (the mock's logits are exact at any row count): the sampler
    # at buckets 1, 4 and 16, logprob rows picked from steps of any row bucket
    engine.runner.row_buckets = [1, 2, 4, 8, 16]
    engine.compile()
    jitted = (sampler.logprobs, sampler.greedy, sampler.pick_rows)   # the chain: one AOT executable
    before = [f._cache_size() for f in jitted]
    compiles = []   # every XLA compile from here on (a persistent cache's hit included)

    def count(event: str, seconds: float, **kw) -> None:
        if event == dispatch.BACKEND_COMPILE_EVENT:
            compiles.append(kw.get("fun_name", event))
    monitoring.register_event_duration_secs_listener(count)
    asks = [SamplingParams(temperature=0.0), sampled(1), sampled(2, repeat_penalty=1.3,
            repeat_last_n=-1, presence_penalty=0.2), sampled(3, dry_multiplier=0.8),
            sampled(4, mirostat=2), SamplingParams(temperature=0.0, frequency_penalty=0.5),
            SamplingParams(temperature=0.0, logit_bias=((12, -100.0), (3, 1.0), (3, 0.5))),
            sampled(5, ignore_eos=True), SamplingParams(temperature=0.0, ignore_eos=True),
            SamplingParams(temperature=0.0, dry_multiplier=0.8, dry_allowed_length=0,
                           logit_bias=((0, 2.0),))]
    for i, params in enumerate(asks):
        run(engine, GenerationRequest(HELLO, params, max_tokens=4, logprobs=2 if i % 2 else None))
    for group in (asks[:4], asks[4:8], asks[6:]):   # mixed steps
        with Paused(engine):
            outs = [Collector() for _ in group]
            for i, (params, out) in enumerate(zip(group, outs)):
                engine.start(GenerationRequest(ids("abcdefgh"[i:]), params, max_tokens=6,
                                               logprobs=1 if i % 2 else None), out)
        assert all(out.wait().finish_reason for out in outs)
    monitoring.unregister_event_duration_listener(count)
    assert [f._cache_size() for f in jitted] == before
    assert compiles == [], " ".join(compiles)


def test_logprobs_are_computed_only_for_the_rows_that_ask(make_engine, monkeypatch):
    """A step whose sampled rows include some that want log-probabilities computes them for
    those rows alone, at the sampler bucket of their count, with the bits they have alone."""
    from kinetic.engine import sampler
    e = make_engine(parallel=4)
    # the ffi kernel's row buckets (the mock's logits are exact at any row count), so that the
    # sampler runs at buckets 1, 4 and 16
    ffi_row_buckets(e)
    assert e.sample_shape.buckets == (1, 4, 16)
    chain_calls, logprob_rows = [], []   # (rows, rows counted) of chain calls; logprobs' rows
    count_chain_calls(monkeypatch, chain_calls)
    real_logprobs = sampler.logprobs
    monkeypatch.setattr(sampler, "logprobs", lambda logits, tokens, n: logprob_rows.append(
        logits.shape[0]) or real_logprobs(logits, tokens, n))
    request = GenerationRequest(HELLO, params=sampled(7), max_tokens=12, logprobs=3,
                                speculative=False)
    alone = run(e, request)
    batched, others = behind_three(e, request)
    assert all(c.wait().finish_reason for c in others)
    assert batched.tokens == alone.tokens and batched.logprobs == alone.logprobs
    assert max(n for _, n in chain_calls) >= 4 and set(logprob_rows) == {1}


def test_the_chain_compiles_without_options_this_xla_does_not_know(make_engine, monkeypatch):
    """The chain's compiler options (sample_device.CHAIN_OPTIONS, older XLA fusion emitters
    for less memory) are dropped where XLA does not know them, with the same draws."""
    import jax
    import jax.numpy as jnp

    from kinetic.engine import sample_device
    unknown = {"xla_cpu_no_such_option": False}
    with pytest.raises(jax.errors.JaxRuntimeError, match="no_such_option"):
        jax.jit(lambda x: x + 1).lower(jnp.zeros(2)).compile(compiler_options=unknown)
    request = GenerationRequest(HELLO, params=sampled(3), max_tokens=6, logprobs=2,
                                speculative=False)
    want = run(make_engine(), request)
    monkeypatch.setattr(sample_device, "CHAIN_OPTIONS", unknown)
    got = run(make_engine(), request)
    assert got.tokens and (got.tokens, got.logprobs) == (want.tokens, want.logprobs)


def count_chain_calls(monkeypatch, calls: list) -> None:
    """Record (rows compiled, rows counted) of every call of the sampling chain's executable
    (DeviceSampler._chain: sampler.sample_rows compiled at the chain bucket)."""
    from kinetic.engine import sampler
    from kinetic.engine.sample_device import DeviceSampler
    real = DeviceSampler._chain

    def chain(self, fn, shape, B):
        exe = real(self, fn, shape, B)
        if fn is not sampler.sample_rows:
            return exe
        return lambda logits, *a: calls.append((logits.shape[0], int(a[-1]))) or exe(logits, *a)
    monkeypatch.setattr(DeviceSampler, "_chain", chain)


def ffi_row_buckets(e) -> None:
    """Give a mock engine the ffi kernel's row buckets (the mock's logits are exact at any
    row count) and the sampler buckets that follow from them."""
    from kinetic.engine.sample_batch import sample_buckets
    e.runner.row_buckets = [1, 2, 4, 8, 16]
    e.sample_shape = dataclasses.replace(e.sample_shape,
                                         buckets=tuple(sample_buckets(e.runner.row_buckets)))


def test_more_sampled_rows_than_a_chunk_sample_four_at_a_time(make_engine, monkeypatch):
    """The chain (sampler.sample_rows) runs at one compiled size, SAMPLE_CHUNK (4) rows, and
    at most that many a call: a step sampling 7 rows calls it in chunks of 4 and 3 rows, a
    request sampling alone calls it for 1 row at the same size, and each request gets the
    tokens and logprobs it gets alone."""
    from kinetic.engine.sample_batch import SAMPLE_CHUNK
    e = make_engine(parallel=8)
    ffi_row_buckets(e)
    assert e.sample_shape.buckets == (1, 4, 16) and e.sample_shape.chain_bucket == 4
    assert SAMPLE_CHUNK == 4
    requests = [GenerationRequest(ids("abcab"[:2 + i % 3]), params=sampled(10 + i),
                                  max_tokens=6, logprobs=2 if i % 2 else None, speculative=False)
                for i in range(7)]
    calls = []   # (compiled rows, rows counted) of each chain call
    count_chain_calls(monkeypatch, calls)
    alone = [run(e, r) for r in requests]
    assert calls and set(calls) == {(4, 1)}   # one row, at the one compiled size
    calls.clear()
    together = all_at_once(e, requests)
    assert [(r.tokens, r.logprobs) for r in together] == [(r.tokens, r.logprobs) for r in alone]
    assert {b for b, _ in calls} == {4} and (4, 4) in calls and (4, 3) in calls


def test_on_a_gpu_the_chain_draws_all_rows_at_once_with_the_same_bits(make_engine,
                                                                      monkeypatch):
    """Where the step runs on a GPU (SampleShape.whole_batch), DeviceSampler._chain runs
    sampler.sample_batch (and distribution_batch) in place of sample_rows' loop over the
    rows, at the smallest bucket that holds a call's rows (and 4), up to GPU_SAMPLE_CHUNK
    rows a call: the same tokens, log-probabilities and post-sampling probabilities, alone and
    sharing steps."""
    from kinetic.engine import runner, sample_device, sampler
    requests = [GenerationRequest(ids("abcab"[:2 + i % 3]), params=sampled(
        10 + i, top_k=[0, 3, 40][i % 3], top_p=[1.0, 0.8][i % 2],
        mirostat=2 if i == 4 else 0), max_tokens=6, logprobs=2, post_sampling=i % 2 == 0,
        speculative=False) for i in range(6)]
    e = make_engine(parallel=8)
    want = [(r.tokens, r.logprobs) for r in all_at_once(e, requests)]
    gpu = types.SimpleNamespace(backend=lambda: "gpu")
    monkeypatch.setattr(sample_device, "target", gpu)
    monkeypatch.setattr(runner, "target", gpu)
    e = make_engine(parallel=8)
    ffi_row_buckets(e)
    assert e.sample_shape.whole_batch and e.sample_shape.chain_buckets == (4, 16)
    calls = []   # (compiled rows, rows counted) of each chain call
    count_chain_calls(monkeypatch, calls)
    alone = [run(e, r) for r in requests]
    assert set(calls) == {(4, 1)}   # a row alone at SAMPLE_CHUNK's bucket
    calls.clear()
    together = all_at_once(e, requests)
    assert (16, 6) in calls and {b for b, _ in calls} <= {4, 16}   # 6 rows in one call
    assert {fn for fn, *_ in e.runner.sampler._chains} == {sampler.sample_batch,
                                                           sampler.distribution_batch}
    assert [(r.tokens, r.logprobs) for r in alone] == want
    assert [(r.tokens, r.logprobs) for r in together] == want


def test_dry_rows_past_the_pair_width_give_the_same_tokens(make_engine, monkeypatch):
    """A DRY row with more penalised tokens than DRY_WIDTH travels whole in the dense spill,
    in the compiled shape: the same tokens and logprobs as with room for every pair, and
    rows of both kinds sample together in one step."""
    from kinetic.engine import sampler
    requests = [GenerationRequest(HELLO, SamplingParams(temperature=0.0, dry_multiplier=0.8,
                                                        dry_allowed_length=0), max_tokens=10,
                                  logprobs=2),
                GenerationRequest(ids("abcabcabd"), sampled(3, dry_multiplier=0.5,
                                                            dry_allowed_length=1), max_tokens=10),
                GenerationRequest(ids("xyxyxyxy"), sampled(4, dry_multiplier=1.5), max_tokens=10)]
    wide = [run(make_engine(), r) for r in requests]
    e = make_engine(parallel=4)
    e.sample_shape = dataclasses.replace(e.sample_shape, dry_width=2)
    e.compile()
    before = sampler.sample._cache_size()
    spills, fits = [], []
    real_dry = e.runner.sampler._dry

    def spy(*a):
        dry = real_dry(*a)
        spills.append(bool(dry.spilled))
        fits.append(bool((np.asarray(dry.ids) >= 0).any()))
        return dry
    e.runner.sampler._dry = spy
    narrow = all_at_once(e, requests)
    assert [(r.tokens, r.logprobs) for r in narrow] == [(r.tokens, r.logprobs) for r in wide]
    assert any(s and f for s, f in zip(spills, fits))   # spilled and paired rows in one step
    assert sampler.sample._cache_size() == before


# --- the engine's shape: parallel, step size, KV memory ---------------------------------------

def test_step_size_grows_with_parallel_and_parallel_is_bounded():
    from kinetic.engine.engine_config import EngineConfig
    resolve = lambda **kw: EngineConfig(n_ctx=64, page_size=4, **kw).resolved(mm.CONFIG)  # noqa: E731
    assert [resolve(parallel=n).step_tokens for n in (1, 4, 8, 9, 16, 32, 33, 64)] == [
        16, 16, 16, 36, 64, 64, 66, 128]
    assert resolve(parallel=16, step_tokens=16).step_tokens == 16     # -ub as given
    # a mixture of experts steps at least 128 rows (its prompt steps share each expert),
    # except on kernel "xla", where every step costs all its rows
    moe = dataclasses.replace(mm.CONFIG, n_expert=8, n_expert_used=2, kernel="ffi")
    moe_resolve = lambda **kw: EngineConfig(n_ctx=64, page_size=4, **kw).resolved(moe)  # noqa: E731
    assert [moe_resolve(parallel=n).step_tokens for n in (1, 64)] == [128, 128]
    assert moe_resolve(parallel=1, step_tokens=16).step_tokens == 16
    xla = dataclasses.replace(moe, kernel="xla")
    assert EngineConfig(n_ctx=64, page_size=4, parallel=1).resolved(xla).step_tokens == 16
    assert resolve(step_tokens=2, max_draft=1).parallel <= 2          # auto -np fits -ub
    for bad, words in [(dict(parallel=65), "1 to 64"), (dict(parallel=-1), "1 to 64"),
                       (dict(parallel=16, step_tokens=8), "at least parallel"),
                       (dict(step_tokens=-1), "step_tokens")]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**bad)


def test_a_kv_cache_larger_than_the_memory_available_is_refused_naming_the_sizes(monkeypatch):
    from kinetic.engine import engine_config
    from kinetic.engine.engine_config import EngineConfig, kv_memory_needed
    cfg = EngineConfig(parallel=16, n_ctx=4096, page_size=16).resolved(mm.CONFIG)
    need = kv_memory_needed(mm.CONFIG, cfg)   # 1 layer, 1 head, 2 x 2 bytes a token (f16)
    assert need == 4 * 16 * (16 * 256 + 1)
    monkeypatch.setattr(engine_config, "available_memory", lambda: need - 1)
    with pytest.raises(ValueError, match=r"KV cache for 16 sequences of 4096 tokens \(float16\)"
                       r" needs 0\.26 MiB, more than the 0\.25 MiB of memory available; "
                       r"lower --parallel \(-np\) or --ctx-size \(-c\)$"):
        EngineConfig(parallel=16, n_ctx=4096, page_size=16).resolved(mm.CONFIG)
    monkeypatch.setattr(engine_config, "available_memory", lambda: 500)   # 9 pages: 576 bytes
    with pytest.raises(ValueError, match="the KV cache for 9 pages of 16 tokens"):
        EngineConfig(parallel=16, n_ctx=4096, page_size=16, num_pages=9).resolved(mm.CONFIG)
    monkeypatch.setattr(engine_config, "available_memory", lambda: need)
    assert EngineConfig(parallel=16, n_ctx=4096, page_size=16).resolved(mm.CONFIG) == cfg


def test_the_start_memory_line_names_the_weights_the_cache_and_its_type():
    """kinetic serve's memory line (engine_config.memory_summary): the file's size, the
    resolved cache's bytes and type (llama-server's name), and the resident memory when
    known."""
    from kinetic.engine.engine_config import (EngineConfig, cache_type_name, kv_memory_needed,
                                              memory_summary)
    for dtype, name in [("float32", "f32"), ("float16", "f16"), ("bfloat16", "bf16")]:
        cfg = EngineConfig(parallel=4, n_ctx=4096, page_size=16,
                           kv_dtype=dtype).resolved(mm.CONFIG)
        assert cache_type_name(dtype) == name
        line = memory_summary(mm.CONFIG, cfg, 3 << 20, 500 << 20)
        kv = kv_memory_needed(mm.CONFIG, cfg)   # 1 layer, 1 head: 2 x (4 or 2) bytes a token
        assert kv == (8 if dtype == "float32" else 4) * 16 * (4 * 256 + 1)
        assert line == (f"memory: weights 3.00 MiB mapped from the file; KV cache up to "
                        f"{-(-kv * 100 // (1 << 20)) / 100:.2f} MiB ({name} keys and values, "
                        f"1024 pages of 16 tokens); resident now 500.00 MiB")
    assert memory_summary(mm.CONFIG, cfg, 3 << 20, None).endswith("pages of 16 tokens)")
    # sliding-window layers: whether their passed rows are handed back (--swa-full keeps them)
    sliding = mm.CONFIG.replace(sliding_window=512, sliding_layers=(True,), kernel="ffi")
    line = memory_summary(sliding, cfg, 3 << 20, None)
    assert line.endswith("tokens), of which 1 sliding-window layers of 1 hand back each "
                         "sequence's rows past their 512-token window")
    full = EngineConfig(parallel=4, n_ctx=4096, swa_full=True).resolved(sliding)
    assert memory_summary(sliding, full, 3 << 20, None).endswith("keep every row (--swa-full)")
    line = memory_summary(sliding.replace(kernel="xla"), cfg, 3 << 20, None)
    assert line.endswith("keep every row (the xla kernel's cache is device memory)")


EXIT_MIDSTREAM = """
import atexit, sys, threading

@atexit.register   # registered first, so it runs after kinetic's own exit handler
def after():
    alive = [t for t in threading.enumerate() if t.name == "kinetic-engine" and t.is_alive()]
    print(f"engine threads at exit: {len(alive)}", flush=True)

import kinetic
m = kinetic.load(sys.argv[1], n_ctx=256, speculative=False)
next(iter(m.stream("Once upon a time", max_tokens=200)))
"""


def test_a_script_that_never_closes_its_model_exits_cleanly(tmp_path):
    """A script (or a notebook's kernel) ending with a stream still running and no close():
    the engine is closed at exit, before Python finalizes, rather than its daemon thread
    coming back from a device call to a finalizing interpreter (which aborted the process,
    "FATAL: exception not rethrown", about every other run on SmolLM2)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.tiny_models import write_tiny_model
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", qtype="Q8_0",
                            context_length=512)
    r = subprocess.run([sys.executable, "-c", EXIT_MIDSTREAM, str(path)], capture_output=True,
                       text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
                       env={**os.environ,
                            "KINETIC_COMPILE_CACHE_DIR": str(tmp_path / "compiled")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "engine threads at exit: 0" in r.stdout, r.stdout
