"""32 concurrent requests through a 4-slot engine whose page pool holds barely more than one
full context, so sequences are preempted and cached pages evicted: every request must
still give exactly what it gives alone, and no page may leak.

The mock model (tests/mock_model.py) reads every token of a sequence back through the page
table, so a page lost, shared wrongly or reused while still held changes the tokens.
"""

from __future__ import annotations

import random
import threading

import pytest

from kinetic.engine.request import GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from tests import mock_model as mm
from tests.mock_model import TIMEOUT, Collector, Paused, Result, greedy, run

N_CTX, PAGE = 64, 4            # 16 pages per slot
NUM_PAGES = 20                 # 19 usable pages for 4 slots of up to 16 pages each
SHARED = mm.ids("thequickbrownfoxjump")  # a 20-token prefix (5 pages) some prompts share


def make_requests() -> list[GenerationRequest]:
    rng = random.Random(2024)
    out = []
    for i in range(32):
        if i % 4 == 0:
            prompt = SHARED + [rng.randrange(mm.V) for _ in range(rng.randint(1, 8))]
        else:
            prompt = [rng.randrange(mm.V) for _ in range(rng.choice([1, 2, 5, 9, 16, 23, 30, 41]))]
        params = (SamplingParams(temperature=1.0, seed=1000 + i) if i % 2
                  else SamplingParams(temperature=0.0))
        out.append(GenerationRequest(
            prompt, params=params, max_tokens=rng.choice([1, 3, 8, 20, 40, None]),
            stop=("zu",) if i % 7 == 3 else (), logprobs=2 if i % 3 == 0 else None,
            speculative=i % 5 != 0))
    return out


@pytest.fixture(scope="module")
def alone() -> list[Result]:
    """Each request run alone, one after another, on an engine with every page it needs."""
    requests = make_requests()
    reference = mm.make_engine(parallel=1, n_ctx=N_CTX, page_size=PAGE, host_cache_mb=0)
    try:
        out = [run(reference, r) for r in requests]
    finally:
        reference.close()
    for r, a in zip(requests, out):  # the hand formula agrees where it applies
        if r.params.temperature == 0 and not r.stop:
            assert (a.tokens, a.finish_reason) == greedy(r.prompt, r.max_tokens, N_CTX)
    # several need 10+ of the 19 pages: two of them together cannot fit
    assert sum(len(r.prompt) + len(a.tokens) > 40 for r, a in zip(requests, out)) >= 6
    return out


@pytest.mark.parametrize("host_cache_mb", [0, 64], ids=["evict", "host-tier"])
def test_many_concurrent_requests_give_what_they_give_alone(alone, host_cache_mb):
    requests = make_requests()
    engine = mm.make_engine(parallel=4, n_ctx=N_CTX, page_size=PAGE, num_pages=NUM_PAGES,
                            host_cache_mb=host_cache_mb)
    try:
        results: list = [None] * len(requests)
        queued = threading.Barrier(9, timeout=TIMEOUT)  # the eight threads and this one

        def submit_then_wait(indices):  # all these reach the engine in one batch
            sinks = {i: Collector() for i in indices}
            for i in indices:
                engine.start(requests[i], sinks[i])
            queued.wait()
            for i in indices:
                results[i] = sinks[i].wait()

        def generate_one_by_one(indices):  # these arrive while the batch runs
            queued.wait()
            for i in indices:
                results[i] = run(engine, requests[i])

        threads = [threading.Thread(target=submit_then_wait, args=(range(k, 24, 6),))
                   for k in range(6)]
        threads += [threading.Thread(target=generate_one_by_one, args=(range(k, 32, 2),))
                    for k in (24, 25)]
        with Paused(engine):  # the engine holds still until the first 24 are all queued
            for t in threads:
                t.start()
            queued.wait()
        for t in threads:
            t.join(4 * TIMEOUT)
            assert not t.is_alive(), "a request never finished"

        for i, (r, a) in enumerate(zip(results, alone)):
            assert r.tokens == a.tokens, f"request {i}"
            assert r.text == a.text and r.finish_reason == a.finish_reason, f"request {i}"
            assert r.logprobs == a.logprobs, f"request {i}"
            assert r.usage.completion_tokens == len(a.tokens), f"request {i}"
            assert r.usage.prompt_tokens == len(requests[i].prompt)
        assert engine.scheduler.num_preemptions > 0
        moved = engine.counters()["pages_to_host"], engine.counters()["pages_from_host"]
        assert (moved[0] > 0 and moved[1] > 0) if host_cache_mb else moved == (0, 0)
        with Paused(engine) as p:  # every other page is free or evictable, refcount 0
            p.assert_only_this_runs()
    finally:
        engine.close()


def test_sixteen_streams_with_long_and_short_prompts_give_what_they_give_alone():
    """--parallel 16 at the automatic step size (32 rows): two long prompts and fourteen
    short ones, all queued together, each answer exactly what it is alone at 16-row steps."""
    rng = random.Random(16)
    requests = []
    for i in range(16):
        n = 300 if i in (0, 7) else rng.randint(1, 12)
        params = (SamplingParams(temperature=1.0, seed=50 + i) if i % 2
                  else SamplingParams(temperature=0.0))
        requests.append(GenerationRequest([rng.randrange(mm.V) for _ in range(n)],
                                          params=params, max_tokens=rng.choice([4, 16, 40]),
                                          logprobs=1 if i % 3 == 0 else None))
    reference = mm.make_engine(parallel=1, n_ctx=512, page_size=16, host_cache_mb=0)
    try:
        alone = [run(reference, r) for r in requests]
    finally:
        reference.close()
    engine = mm.make_engine(parallel=16, n_ctx=512, page_size=16, step_tokens=0)
    try:
        assert engine.config.step_tokens == 64 and engine.config.num_pages == 16 * 32 + 1
        sinks = [Collector() for _ in requests]
        with Paused(engine):   # all 16 reach the engine in one turn
            for r, sink in zip(requests, sinks):
                engine.start(r, sink)
        for i, (sink, a) in enumerate(zip(sinks, alone)):
            got = sink.wait()
            assert (got.tokens, got.logprobs, got.finish_reason) == (
                a.tokens, a.logprobs, a.finish_reason), f"request {i}"
    finally:
        engine.close()
