"""Sliding-window layers keep only their window (kinetic/engine/sliding_window.py).

The scheduler side runs against test_scheduler's fake model with a second cache standing for
the sliding-window layers: every row writes its token there too, a sampled row checks that
the cells of its last `window` positions there hold its sequence's tokens, and the pages
the scheduler lists are wiped there (as the runner hands their memory back), so a page handed
back too early, or a prefix resumed without its window, shows up as a wrong cell. The runner
side: the C++ call hands the memory back (mincore) and leaves the partial pages at the ends.
"""

from __future__ import annotations

import ctypes
import mmap
import random

import numpy as np
import pytest

from kinetic.engine.kv_cache import HAND_BACK_REACH, PageManager
from kinetic.engine.scheduler import Scheduler
from kinetic.engine.sequence import SchedulerConfig, Sequence
from tests.test_scheduler import (FakeModel, assert_all_pages_returned, expected, mix,
                                  random_drafts)

GONE = -2   # a wiped cell of the sliding-window cache


class WindowModel(FakeModel):
    def __init__(self, cfg: SchedulerConfig, rule=mix):
        super().__init__(cfg, rule)
        self.window_cache = np.full_like(self.cache, -1)
        self.released = 0

    def context(self, plan, row: int) -> list[int]:
        ctx = super().context(plan, row)
        ps, slot, pos = self.cfg.page_size, plan.slots[row], plan.positions[row]
        for p in range(max(0, pos - self.cfg.window + 1), pos + 1):
            cell = self.window_cache[plan.page_table[slot, p // ps] * ps + p % ps]
            assert cell == ctx[p], f"row {row} (position {pos}) finds {cell} at {p}, not {ctx[p]}"
        return ctx

    def step(self, plan):
        self.window_cache[plan.write_index] = plan.tokens
        return super().step(plan)

    def release(self, runs: list[tuple[int, int]]) -> None:
        ps = self.cfg.page_size
        for first, count in runs:
            assert first > 0
            cells = self.window_cache[first * ps:(first + count) * ps]
            self.released += int((cells.reshape(count, ps) != GONE).any(axis=1).sum())
            cells[:] = GONE


def step(sched: Scheduler, model: WindowModel, done: dict | None = None, batch: int = 1):
    """One step; then the listed pages are handed back, `batch` at a time (Turn.turn)."""
    plan = sched.schedule()
    sched.check_invariants()
    for seq in sched.complete(plan, model.step(plan)):
        if done is not None:
            done[seq.seq_id] = seq
    model.release(sched.take_window_releases(batch))
    sched.check_invariants()
    return plan


def run(sched: Scheduler, model: WindowModel) -> dict[int, Sequence]:
    done: dict[int, Sequence] = {}
    for _ in range(3000):
        if not sched.has_work:
            return done
        step(sched, model, done)
    raise AssertionError("no progress")


def config(**kw) -> SchedulerConfig:
    base = dict(step_tokens=16, num_slots=2, page_size=4, num_pages=81, pages_per_slot=40,
                chunk_tokens=8, window=10)
    return SchedulerConfig(**{**base, **kw})


def test_a_long_answer_keeps_only_its_window_its_prompt_end_and_its_tail():
    cfg = config()
    sched, model = Scheduler(cfg), WindowModel(cfg)
    prompt = list(range(30))
    sched.add(Sequence(0, prompt, max_tokens=100))
    done = run(sched, model)
    seq = done[0]
    assert seq.tokens == expected(prompt, 100, mix)
    # 129 positions computed; a continuation resumes at 128, whose window reaches back to
    # 119 (page 29): pages 0..28 go, but 4..6, which a regenerated answer resuming at the
    # prompt's last page boundary (28) reads. One sequence: page j is page id 1 + j.
    gone = set(np.flatnonzero((model.window_cache.reshape(-1, 4) == GONE).all(axis=1)))
    assert gone == {1 + j for j in range(29) if j not in (4, 5, 6)}
    assert model.released == len(gone)
    # what was handed back still serves as prefix for the global layers only: a continued
    # conversation resumes at the end, a regenerated answer at the prompt's end
    sched.add(Sequence(1, seq.tokens + [7, 7], max_tokens=3))
    sched.add(Sequence(2, prompt, max_tokens=3))
    sched.add(Sequence(3, seq.tokens[:80] + [5], max_tokens=3))   # a window handed back
    done = run(sched, model)
    assert done[1].num_cached == 128 and done[2].num_cached == 28
    assert done[3].num_cached == 28   # pages 17..19 (its window at 80) are gone, and so on
                                      # back to the prompt's end
    for i in (1, 2, 3):
        assert done[i].tokens == expected(done[i].prompt, 3, mix)
    assert_all_pages_returned(sched)


def test_pages_another_sequence_holds_and_found_prefixes_are_not_handed_back():
    cfg = config()
    sched, model = Scheduler(cfg), WindowModel(cfg)
    head = list(range(40))
    sched.add(Sequence(0, head, max_tokens=2))
    run(sched, model)
    first = model.released
    # two answers that start from the cached head: neither hands its pages back
    sched.add(Sequence(1, head + [1, 2], max_tokens=60))
    sched.add(Sequence(2, head + [3, 4], max_tokens=60))
    done = run(sched, model)
    assert done[1].num_cached == done[2].num_cached == 40
    ps = cfg.page_size
    head_pages = {1 + j for j in range(10)}
    wiped = {p for p in range(cfg.num_pages)
             if (model.window_cache[p * ps:(p + 1) * ps] == GONE).all()}
    assert model.released > first and len(wiped - head_pages) > 20
    assert wiped & head_pages == {1 + j for j in range(10) if j < 6}   # sequence 0's own
    for i in (1, 2):
        assert done[i].tokens == expected(done[i].prompt, 60, mix)
    assert_all_pages_returned(sched)


def test_window_zero_keeps_every_row_and_matches_as_before():
    # (the model still checks a 10-position window)
    sched, model = Scheduler(config(window=0)), WindowModel(config())
    prompt = list(range(30))
    sched.add(Sequence(0, prompt, max_tokens=100))
    run(sched, model)
    sched.add(Sequence(1, prompt + expected(prompt, 100, mix)[30:80] + [5], max_tokens=3))
    done = run(sched, model)
    assert model.released == 0 and done[1].num_cached == 80
    assert done[1].tokens == expected(done[1].prompt, 3, mix)


@pytest.mark.parametrize("batch", [1, 6])
def test_stress_with_preemption_drafts_and_shared_heads(batch):
    """batch 6: pages wait listed across steps, some freed and allocated again meanwhile
    (their next owner's rows must not be handed back)."""
    rng = random.Random(99)
    cfg = config(num_slots=4, num_pages=31, pages_per_slot=16, window=7)
    sched, model = Scheduler(cfg), WindowModel(cfg)
    heads = [[rng.randrange(100) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    seqs = [Sequence(i, rng.choice(heads)[:rng.randrange(1, 24)] +
                     [rng.randrange(100) for _ in range(rng.randrange(0, 10))],
                     max_tokens=rng.randrange(1, 40)) for i in range(40)]
    done: dict[int, Sequence] = {}
    pending, drafted = list(seqs), 0
    for _ in range(4000):
        while pending and (len(pending) > 30 or rng.random() < 0.3):
            sched.add(pending.pop(0))
        if not (pending or sched.has_work):
            break
        random_drafts(sched, rng)
        drafted += sum(c.num_draft for c in step(sched, model, done, batch).chunks)
    assert len(done) == 40
    for seq in seqs:
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert sched.num_preemptions > 0 and drafted > 0 and model.released > 0
    assert sum(s.num_cached for s in seqs) > 0
    assert_all_pages_returned(sched)


def test_hand_back_runs_take_handed_back_neighbours_until_they_are_allocated_again():
    pm = PageManager(40, 4)

    def hand_back(pages):
        for page in pages:
            pm.pass_window(page)
        assert pm.to_hand_back == len(set(pages))
        return pm.hand_back()
    pages = pm.allocate(30)   # 1..30
    assert hand_back([5]) == [(5, 1)]
    assert hand_back([7]) == [(7, 1)]
    assert hand_back([6]) == [(5, 3)]   # both neighbours went back before
    assert hand_back([12, 13, 20]) == [(12, 2), (20, 1)]
    assert hand_back(list(range(14, 20))) == [(12, 9)]   # 12..20
    # at most HAND_BACK_REACH neighbours on a side
    assert hand_back([21]) == [(21 - HAND_BACK_REACH, HAND_BACK_REACH + 1)]
    pm.pass_window(25)
    pm.release(pages)
    again = pm.allocate(29)   # the released pages come back (the last released first)
    assert 6 in again and 25 in again and pm.to_hand_back == 0   # 25's owner writes it
    assert hand_back([7]) == [(7, 1)]   # 5 and 6 were allocated again


def _resident(address: int, nbytes: int) -> list[bool]:
    """Which memory pages of a range are resident (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    vec = (ctypes.c_ubyte * (nbytes // page))()
    assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), vec) == 0
    return [bool(v & 1) for v in vec]


def test_release_pages_hands_back_whole_pages_and_keeps_the_ends():
    kernels = pytest.importorskip("kinetic.kernels")
    if not kernels.available():
        pytest.skip("the C++ kernel is not built here")
    page = mmap.PAGESIZE
    buf = mmap.mmap(-1, 8 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # as malloc gives
    a = np.frombuffer(buf, np.uint8)
    a[:] = 7
    address = a.ctypes.data
    assert all(_resident(address, 8 * page))
    # from the middle of page 1 to the middle of page 5: pages 2, 3 and 4 go back
    assert kernels.release_pages(address + page + 100, 4 * page) == 3 * page
    assert _resident(address, 8 * page) == [True, True, False, False, False, True, True, True]
    assert (a[:2 * page] == 7).all() and (a[5 * page:] == 7).all()
    assert (a[2 * page:5 * page] == 0).all()
    assert kernels.release_pages(address + 10, page) == 0   # no whole page inside
    assert kernels.release_pages(address, 0) == 0
    del a
    buf.close()


# --- the engine, on a tiny Gemma 3 (layers 0 and 2 slide over 8 positions) -----------------

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from kinetic.model.loader import load_model
    from tests.test_invariance import engines_over
    from tests.tiny_models import write_tiny_model
    path = write_tiny_model(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf", "gemma3",
                            n_layer=4, sliding_window=8, qtype="Q8_0", output_scale=2.0,
                            context_length=1024)
    yield from engines_over(load_model(str(path)))


def _greedy(ids: list[int], n: int):
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    return GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=n, logprobs=2)


def _zero_pages(layer) -> set[int]:
    """Pages of a layer's cache (k, v) whose rows all read zero."""
    k, v = (np.asarray(a).reshape(a.shape[0], -1) for a in layer)
    return set(np.flatnonzero(~k.any(axis=1) & ~v.any(axis=1)).tolist())


def test_an_engine_hands_back_passed_rows_and_answers_as_with_swa_full(gemma, monkeypatch):
    """A 300-token answer after a prompt of several steps: the sliding-window layers' pages
    it passed read zero (their memory handed back), the global layers' do not, and every
    answer, cold, continued, regenerated, or resumed where the window is gone, is the
    --swa-full engine's, bit for bit."""
    from kinetic.engine import sliding_window
    from tests.test_invariance import run
    monkeypatch.setattr(sliding_window, "WINDOW_BATCH", 4)   # the sequence has 28 pages
    tok, engine, model = gemma
    assert model.config.sliding_layers == (True, False, True, False)
    full, kept = engine("swa-full", parallel=2, swa_full=True), engine("window", parallel=2)
    assert full.scheduler.config.window == 0 and kept.scheduler.config.window == 8
    # long enough for several prompt steps, which sample nothing, to be queued at once
    prompt = tok.encode("Once upon a time, in a land of many rivers, there lived a fox who "
                        "counted the stars every night. " * 6, add_special=True)
    assert len(prompt) + 300 < 512   # the engines' context
    first = run(kept, _greedy(prompt, 300))
    assert first == run(full, _greedy(prompt, 300))
    cache, n = kept.runner.cache, kept.runner.config.num_pages
    written = set(range(1, n)) - _zero_pages(cache[1]) - _zero_pages(cache[3])   # global
    passed = written & _zero_pages(cache[0]) & _zero_pages(cache[2])
    # len(prompt) + 299 positions computed, 16 a page: the pages before the last boundary's
    # window go back, but the one before the prompt's end. A cache page is 1 KiB a layer
    # here, a memory page 4 KiB, so a memory page shared with a page kept (page 0, the
    # prompt's end, the last ones) stays: 10 of the 28 pages read zero
    pages = -(-(len(prompt) + 299) // 16)
    assert len(written) == pages and len(passed) >= 8
    cache = full.runner.cache
    written = set(range(1, n)) - _zero_pages(cache[1])
    assert len(written) == pages and not written & _zero_pages(cache[0])
    whole = prompt + first[0]
    for ids in (whole + tok.encode(" and then"),   # a continued conversation
                prompt,                            # a regenerated answer
                whole[:300]):                      # a prefix whose window went
        got, want = run(kept, _greedy(ids, 12)), run(full, _greedy(ids, 12))
        assert got[:2] == want[:2]
        assert got[2] > 0 and got[2] <= want[2]
    # the continuation resumes at the end, the middle one only from the prompt's end
    assert run(kept, _greedy(whole + [5], 2))[2] == run(full, _greedy(whole + [5], 2))[2]
    assert run(kept, _greedy(whole[:300] + [6], 2))[2] < run(full, _greedy(whole[:300] + [6],
                                                                            2))[2]
