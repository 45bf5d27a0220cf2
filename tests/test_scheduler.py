"""Scheduler: exact rows, pages, preemption and token streams, driven by a fake model.

The fake model keeps a fake KV cache holding token ids: every row writes its token at its
write_index, and a sampled row reads its sequence's whole context back through the page table
(so a wrong page, a shared page overwritten, or a missing row shows up as a wrong token).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kinetic.engine.prefills import Prefilled
from kinetic.engine.scheduler import Scheduler
from kinetic.engine.sequence import (ContextOverflow, SchedulerConfig, Sequence, SlotStats, Status,
                                     StepPlan)


def plus_one(ctx: list[int]) -> int:
    return (ctx[-1] + 1) % 100


def mix(ctx: list[int]) -> int:
    """Depends on every token of the context and on its length."""
    return (sum((i + 1) * t for i, t in enumerate(ctx)) + len(ctx)) % 100


class FakeModel:
    def __init__(self, cfg: SchedulerConfig, rule=plus_one):
        self.cfg, self.rule = cfg, rule
        self.cache = np.full(cfg.num_pages * cfg.page_size, -1)

    def context(self, plan, row: int) -> list[int]:
        ps, slot, pos = self.cfg.page_size, plan.slots[row], plan.positions[row]
        idx = [plan.page_table[slot, p // ps] * ps + p % ps for p in range(pos + 1)]
        ctx = self.cache[idx].tolist()
        assert -1 not in ctx, f"row {row} reads a cache cell never written"
        return ctx

    def step(self, plan) -> dict[int, int | list[int]]:
        """Write every row, then sample: one token per sequence, or for a draft the
        accepted drafts plus the target's next token."""
        assert len(plan) <= self.cfg.step_tokens
        assert len(set(plan.write_index.tolist())) == len(plan), "two rows write one cell"
        assert all(w >= self.cfg.page_size for w in plan.write_index), "a row writes page 0"
        self.cache[plan.write_index] = plan.tokens
        out = {}
        for sid, rows in plan.sample_rows.items():
            targets = [self.rule(self.context(plan, r)) for r in rows]
            drafts = plan.tokens[rows[1:]].tolist()
            m = 0
            while m < len(drafts) and drafts[m] == targets[m]:
                m += 1
            out[sid] = targets[0] if len(rows) == 1 else targets[:m + 1]
        return out


def expected(prompt: list[int], n: int, rule=plus_one) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(rule(toks))
    return toks


def step(sched: Scheduler, model: FakeModel, done: dict | None = None):
    plan = sched.schedule()
    sched.check_invariants()
    for seq in sched.complete(plan, model.step(plan)):
        if done is not None:
            done[seq.seq_id] = seq
    sched.check_invariants()
    return plan


def random_drafts(sched: Scheduler, rng: random.Random) -> None:
    """Give about a third of the caught-up running sequences a draft: a right start of 0 to
    4 tokens (mix's), then a token that is most likely wrong."""
    for seq in sched.running:
        if seq.num_computed == len(seq.tokens) - 1 and rng.random() < 0.3:
            truth = expected(seq.tokens, 4, mix)[len(seq.tokens):]
            sched.set_draft(seq.seq_id, truth[:rng.randrange(5)] + [rng.randrange(100)])


def run(sched: Scheduler, model: FakeModel, max_steps: int = 2000) -> dict[int, Sequence]:
    done: dict[int, Sequence] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return done
        step(sched, model, done)
    raise AssertionError("no progress")


def assert_all_pages_returned(sched: Scheduler) -> None:
    pm = sched.pages
    assert pm.free_count + len(pm.evictable) == sched.config.num_pages - 1
    assert all(pm.refcount(p) == 0 for p in range(pm.num_pages))
    pm.check_invariants(held={})


def test_config_is_validated():
    with pytest.raises(ValueError, match="step_tokens"):
        SchedulerConfig(step_tokens=0)
    with pytest.raises(ValueError, match="num_slots"):
        SchedulerConfig(step_tokens=8, num_slots=9, num_pages=9 * 128 + 1)
    with pytest.raises(ValueError, match="pages_per_slot"):
        SchedulerConfig(num_pages=8, pages_per_slot=8)  # only 7 usable pages
    with pytest.raises(ValueError, match="max_tokens"):
        Sequence(0, [1], max_tokens=0)
    with pytest.raises(ValueError, match="empty"):
        Sequence(0, [])


def test_prompt_longer_than_context_is_refused_at_add():
    cfg = SchedulerConfig(step_tokens=8, page_size=4, num_pages=5, pages_per_slot=4)
    sched = Scheduler(cfg)
    with pytest.raises(ContextOverflow, match="17 tokens.*context of 16"):
        sched.add(Sequence(0, list(range(17))))
    assert sched.queue_length == 0 and not sched.has_work
    sched.add(Sequence(1, list(range(16))))  # exactly the context: one token, then "length"
    done = run(sched, FakeModel(cfg))
    assert done[1].tokens == list(range(17)) and done[1].finish_reason == "length"
    assert_all_pages_returned(sched)


def test_a_chunked_prompt_then_decode_rows_exactly():
    cfg = SchedulerConfig(step_tokens=8, num_slots=2, page_size=4, num_pages=9,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(7, [50, 51, 52, 53, 54, 55, 56, 57, 58, 59], max_tokens=3))
    p = step(sched, model)
    assert p.seq_ids == [7] * 8 and p.positions.tolist() == list(range(8))
    assert p.write_index.tolist() == list(range(4, 12))  # pages 1 and 2
    assert p.sample_rows == {} and p.page_table[0].tolist() == [1, 2, 0, 0]
    p = step(sched, model)
    assert p.tokens.tolist() == [58, 59] and p.write_index.tolist() == [12, 13]
    assert p.sample_rows == {7: [1]} and p.page_table[0].tolist() == [1, 2, 3, 0]
    p = step(sched, model)
    assert p.tokens.tolist() == [60] and p.positions.tolist() == [10]
    seq = sched.sequences[7]
    assert seq.tokens[-1] == 61 and seq.num_computed == 11
    p = step(sched, model)
    assert p.tokens.tolist() == [61] and 7 not in sched.sequences
    assert seq.tokens == list(range(50, 63)) and seq.finish_reason == "length"
    # 12 tokens computed: all 3 pages registered; released tail first
    assert sched.pages.evictable == [3, 2, 1]
    assert_all_pages_returned(sched)


def test_decode_rows_come_before_prompt_chunks_and_chunks_are_capped():
    cfg = SchedulerConfig(step_tokens=8, num_slots=2, page_size=4, num_pages=9,
                          pages_per_slot=4, chunk_tokens=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in range(3):
        sched.add(Sequence(i, [10 * i + j for j in range(6)], max_tokens=2))
    p = step(sched, model)
    assert p.seq_ids == [0] * 4 + [1] * 4 and sched.queue_length == 1
    p = step(sched, model)
    assert p.seq_ids == [0, 0, 1, 1] and p.sample_rows == {0: [1], 1: [3]}
    p = step(sched, model)  # decode rows, then neither done: seq 2 still waits for a slot
    assert p.seq_ids == [0, 1] and p.tokens.tolist() == [6, 16]
    assert p.positions.tolist() == [6, 6]
    p = step(sched, model)  # 0 and 1 finished last step: 2 admitted
    assert p.seq_ids == [2] * 4
    done = run(sched, model)
    assert done[2].tokens == expected(list(range(20, 26)), 2)
    assert_all_pages_returned(sched)


def test_prefix_pages_are_shared_with_refcounts():
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=4, num_pages=9,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, list(range(10)), max_tokens=4))
    step(sched, model)
    a = sched.sequences[0]
    assert a.pages == [1, 2, 3] and a.num_registered == 2
    sched.add(Sequence(1, list(range(8)) + [90, 91, 92], max_tokens=2))
    p = step(sched, model)
    b = sched.sequences[1]
    assert b.num_cached == 8 and b.pages == [1, 2, 4]
    assert [sched.pages.refcount(q) for q in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert p.seq_ids == [0, 1, 1, 1] and p.positions.tolist() == [10, 8, 9, 10]
    assert p.write_index.tolist() == [3 * 4 + 2, 16, 17, 18]  # b writes only its page 4
    assert sched.slot_stats() == [SlotStats(0, True, 0, 10, 0, 2),
                                  SlotStats(1, True, 1, 11, 8, 1)]
    done = run(sched, model)
    assert done[1].tokens == expected(list(range(8)) + [90, 91, 92], 2)
    assert done[0].tokens == expected(list(range(10)), 4)
    assert_all_pages_returned(sched)


def test_a_fully_cached_prompt_still_computes_its_last_token():
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=4, num_pages=9,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, list(range(8)), max_tokens=1))
    run(sched, model)
    assert sched.pages.evictable == [2, 1]
    sched.add(Sequence(1, list(range(8)), max_tokens=1))
    p = step(sched, model)
    # page 2 would be a full hit, but its last token must run: one page cached, not two
    assert p.positions.tolist() == [4, 5, 6, 7] and p.write_index.tolist() == list(range(12, 16))
    assert p.sample_rows == {1: [3]}
    # page 3 holds the same tokens as cached page 2, which stays the cached copy
    assert sched.pages.key(3) is None and sched.pages.evictable == [2, 1]
    assert sched.pages.free_count == 6


def test_partial_pages_are_not_shared():
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=4, num_pages=9,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, list(range(6)), max_tokens=5))
    step(sched, model)  # 6 computed: page 1 full, page 2 partial
    sched.add(Sequence(1, list(range(6)), max_tokens=5))
    p = step(sched, model)
    assert sched.sequences[1].num_cached == 4 and sched.sequences[1].pages == [1, 3]
    assert p.seq_ids == [0, 1, 1] and p.write_index.tolist() == [2 * 4 + 2, 12, 13]
    done = run(sched, model)
    assert done[0].tokens == done[1].tokens == expected(list(range(6)), 5)
    assert_all_pages_returned(sched)


def test_preemption_takes_the_newest_and_resumes_it_first():
    # 6 usable pages of 2 tokens, 3 slots; 0 takes its 7-token prompt 2 rows at a time
    cfg = SchedulerConfig(step_tokens=8, num_slots=3, page_size=2, num_pages=7,
                          pages_per_slot=4, chunk_tokens=2)
    sched, model, done = Scheduler(cfg), FakeModel(cfg), {}
    sched.add(Sequence(0, [1, 2, 3, 4, 5, 6, 7], max_tokens=1))
    sched.add(Sequence(1, [20, 21], max_tokens=6))
    sched.add(Sequence(2, [30, 31], max_tokens=6))
    sched.add(Sequence(3, [40, 41], max_tokens=2))
    step(sched, model, done)
    p = step(sched, model, done)
    assert p.seq_ids == [0, 0, 1, 2] and sched.pages.available == 0
    p = step(sched, model, done)  # 0 needs a page: 2, the newest, is preempted
    assert p.preempted == [2] and p.seq_ids == [0, 0, 1]
    assert [s.seq_id for s in sched.waiting] == [2, 3]
    assert sched.sequences[2].status is Status.PREEMPTED
    p = step(sched, model, done)  # 1 needs a page for position 4 and is the newest left
    assert p.preempted == [1] and p.seq_ids == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2, 3]  # older first, new arrivals last
    assert sched.num_preemptions == 2
    # 0 finished: resumed in order; 1 (5 tokens) finds its two full pages still cached and
    # recomputes only its newest token, 2's one full page was evicted for 0
    p = step(sched, model, done)
    assert [(c.seq_id, c.start) for c in p.chunks] == [(1, 4), (2, 0), (3, 0)]
    done.update(run(sched, model))
    assert done[0].tokens == expected([1, 2, 3, 4, 5, 6, 7], 1)
    assert done[1].tokens == expected([20, 21], 6)
    assert done[2].tokens == expected([30, 31], 6)
    assert done[3].tokens == expected([40, 41], 2)
    assert_all_pages_returned(sched)


def test_fifo_admission_and_preempted_sequences_stay_ahead_of_later_arrivals():
    cfg = SchedulerConfig(step_tokens=4, num_slots=1, page_size=2, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in range(5):
        sched.add(Sequence(i, [i, i], max_tokens=1))
    order = []
    while sched.has_work:
        order += [c.seq_id for c in step(sched, model).chunks]
    assert order == [0, 1, 2, 3, 4]
    # two slots, 4 usable pages: 1 is admitted with the last page, and preempted at once
    # when the older 0 needs it; it then stays ahead of the newer 2
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=2, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, [1, 2, 3, 4, 5, 6], max_tokens=2))
    sched.add(Sequence(1, [1, 1, 1, 1, 1, 1, 1], max_tokens=1))
    sched.add(Sequence(2, [9], max_tokens=1))
    p = step(sched, model)
    assert p.seq_ids == [0] * 6 + [1] * 2 and sched.pages.available == 0
    p = step(sched, model)
    assert p.preempted == [1] and [c.seq_id for c in p.chunks] == [0]
    assert [s.seq_id for s in sched.waiting] == [1, 2]
    order = []
    done = {}
    while sched.has_work:
        order += [c.seq_id for c in step(sched, model, done).chunks if c.start == 0]
    assert order == [1, 2] and done[1].tokens == [1] * 7 + [2]
    assert_all_pages_returned(sched)


def test_draft_rows_are_verified_and_rejected_rows_rewritten():
    cfg = SchedulerConfig(step_tokens=8, num_slots=1, page_size=4, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, [1, 2, 3], max_tokens=8))
    step(sched, model)
    sched.set_draft(0, [5, 6, 9])
    p = step(sched, model)
    assert p.tokens.tolist() == [4, 5, 6, 9] and p.positions.tolist() == [3, 4, 5, 6]
    assert p.sample_rows == {0: [0, 1, 2, 3]}
    seq = sched.sequences[0]
    assert seq.tokens == [1, 2, 3, 4, 5, 6, 7] and seq.num_computed == 6
    p = step(sched, model)  # position 6 held the rejected 9: it is written again
    assert p.tokens.tolist() == [7] and p.write_index.tolist() == [2 * 4 + 2]
    sched.set_draft(0, [9, 10, 11, 12, 13])  # clamped to max_tokens: 5 decoded, 3 to go
    p = step(sched, model)
    assert p.tokens.tolist() == [8, 9, 10] and seq.finish_reason == "length"
    assert seq.tokens == expected([1, 2, 3], 8)
    with pytest.raises(ValueError, match="accepted prefix"):
        sched.add(Sequence(1, [1, 2], max_tokens=4))
        step(sched, model)
        sched.set_draft(1, [3, 4])
        sched.complete(sched.schedule(), {1: [4, 4]})


def test_finish_and_cancel_release_at_once():
    cfg = SchedulerConfig(step_tokens=8, num_slots=1, page_size=4, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    sched.add(Sequence(0, list(range(5))))
    sched.add(Sequence(1, [7]))
    step(sched, model)
    plan = sched.schedule()
    assert sched.finish(0, "stop").finish_reason == "stop"
    assert sched.slot_stats() == [SlotStats(0, False, None, 0, 0, 0)]
    assert sched.pages.free_count == 3 and sched.pages.evictable == [1]
    assert sched.complete(plan, model.step(plan)) == []  # the finished one is skipped
    assert sched.cancel(1).status is Status.FINISHED and not sched.has_work
    assert_all_pages_returned(sched)


def test_stress_32_sequences_of_3_groups_through_4_slots_and_a_small_pool():
    rng = random.Random(1234)
    cfg = SchedulerConfig(step_tokens=16, num_slots=4, page_size=4, num_pages=25,
                          pages_per_slot=12, chunk_tokens=8)
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    heads = [[rng.randrange(100) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    seqs = []
    for i in range(32):
        prompt = rng.choice(heads)[:rng.randrange(1, 20)] + [rng.randrange(100)
                                                            for _ in range(rng.randrange(0, 12))]
        group = rng.choice(["a", "a", "b", None])   # who asked (None: a group of its own)
        seqs.append(Sequence(i, prompt, max_tokens=rng.randrange(1, 24), group=group))
    stopped = {i: rng.randrange(1, 6) for i in range(0, 32, 5)}  # the engine's EOG here
    done: dict[int, Sequence] = {}
    pending, drafted = list(seqs), 0
    for _ in range(3000):
        while pending and (len(pending) > 24 or rng.random() < 0.3):
            sched.add(pending.pop(0))
        if not (pending or sched.has_work):
            break
        random_drafts(sched, rng)
        drafted += sum(c.num_draft for c in step(sched, model, done).chunks)
        for i, n in stopped.items():
            if i in sched.sequences and sched.sequences[i].n_decoded >= n:
                done[i] = sched.finish(i, "stop")
    assert len(done) == 32 and not sched._groups
    for seq in seqs:
        assert seq.n_decoded <= seq.max_tokens
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
        want = stopped.get(seq.seq_id)
        if seq.finish_reason == "stop":
            assert want is not None and seq.n_decoded >= want
        else:
            assert seq.finish_reason == "length"
            assert seq.n_decoded == seq.max_tokens or len(seq.tokens) == cfg.max_context + 1
    # the run exercised what it claims to test
    assert sched.num_preemptions > 0 and sum(s.num_cached for s in seqs) > 0 and drafted > 0
    assert_all_pages_returned(sched)


def test_scheduler_and_page_manager_do_not_import_jax():
    import subprocess
    import sys
    modules = ("scheduler", "sequence", "fairness", "prefix_reuse", "prefills", "kv_cache")
    code = ("import sys; " + "".join(f"import kinetic.engine.{name}; " for name in modules)
            + "assert 'jax' not in sys.modules and 'jaxlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- fairness under mixed long and short requests, counted in steps -----------------------

def wide_config(**kw) -> SchedulerConfig:
    """16-row steps, 4 slots of 4096 tokens each, every slot's full context in the pool."""
    cfg = dict(step_tokens=16, num_slots=4, page_size=16, pages_per_slot=256,
               num_pages=4 * 256 + 1, chunk_tokens=512)
    return SchedulerConfig(**{**cfg, **kw})


class Clock:
    """Steps a scheduler, checking every plan and recording, per sequence, the step that
    sampled its first token and the steps that gave it rows."""

    def __init__(self, sched: Scheduler, model: FakeModel):
        self.sched, self.model, self.steps = sched, model, 0
        self.first: dict[int, int] = {}         # seq id -> step of its first token
        self.rows: dict[int, list[int]] = {}    # seq id -> its rows in each step it ran
        self.done: dict[int, Sequence] = {}

    def step(self) -> StepPlan:
        ready = {s.seq_id for s in self.sched.running if len(s.tokens) - s.num_computed == 1}
        plan = step(self.sched, self.model, self.done)
        self.steps += 1
        got = {c.seq_id: c.num_rows for c in plan.chunks}
        # every stream that was caught up decodes in every step (nothing was preempted here)
        if not plan.preempted:
            assert ready <= set(got), (self.steps, ready - set(got))
        for sid, n in got.items():
            self.rows.setdefault(sid, []).append(n)
        for seq in list(self.sched.sequences.values()) + list(self.done.values()):
            if seq.n_decoded and seq.seq_id not in self.first:
                self.first[seq.seq_id] = self.steps
        return plan

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                return
            self.step()
        raise AssertionError("no progress")


def chat(i: int, n: int = 20, max_tokens: int = 30) -> Sequence:
    return Sequence(i, [(7 * i + j) % 100 for j in range(n)], max_tokens=max_tokens)


def long_prompt(n: int) -> list[int]:
    return [(3 * j + 1) % 100 for j in range(n)]


@pytest.mark.parametrize("n_long", [1000, 3000])
def test_short_requests_behind_a_long_prompt_get_their_first_token_in_bounded_steps(n_long):
    # a 3000-token prompt and three 20-token chats arrive together, the long one first: the
    # step's 16 rows are shared by the four prompts (4 each), so each chat has its first
    # token after ceil(20 / 4) = 5 steps, whatever the long prompt's length
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    sched.add(Sequence(0, long_prompt(n_long), max_tokens=4))
    for i in (1, 2, 3):
        sched.add(chat(i))
    clock = Clock(sched, model)
    clock.run()
    assert [clock.first[i] for i in (1, 2, 3)] == [5, 5, 5]
    # the long prompt advanced in every step until its first token, and then the three
    # chats' decode rows took 3 of each step's 16 rows: 13 went to it
    assert len(clock.rows[0]) >= clock.first[0] and all(clock.rows[0])
    assert clock.rows[0][:5] == [4] * 5 and clock.rows[0][5] == 13
    assert clock.first[0] <= 5 + -(-(n_long - 20) // 13)
    for seq in clock.done.values():   # every answer is exactly the one it gets alone
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


def test_short_requests_arriving_while_a_long_prompt_is_computed_are_not_held_behind_it():
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    sched.add(Sequence(0, long_prompt(3000), max_tokens=2))
    clock = Clock(sched, model)
    for _ in range(10):
        clock.step()
    assert clock.rows[0] == [16] * 10   # alone, it takes every row
    for i in (1, 2, 3):
        sched.add(chat(i, max_tokens=50))
    for _ in range(5):
        clock.step()
    assert all(clock.first[i] == 15 for i in (1, 2, 3))   # ceil(20 / 4) steps after arriving
    # while the long prompt runs on, the chats decode in every step (Clock checks it) and it
    # takes the rest: 16 - 3 rows a step
    for _ in range(20):
        clock.step()
    assert clock.rows[0][-20:] == [13] * 20
    assert all(len(clock.rows[i]) == 25 for i in (1, 2, 3))
    clock.run()
    assert len(clock.done) == 4
    for seq in clock.done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


def test_drafts_take_only_rows_no_prompt_needs():
    # three streams decode with 4-token drafts (3 x 5 rows of 16) when a 30-token chat
    # arrives: the chat gets the 13 rows beside the three decode rows, the drafts wait
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in (0, 1, 2):
        sched.add(chat(i, n=8, max_tokens=200))
    clock = Clock(sched, model)
    clock.step()
    clock.step()   # 24 prompt rows in two steps

    def draft_all():
        for seq in sched.running:
            if len(seq.tokens) - seq.num_computed == 1:
                sched.set_draft(seq.seq_id, expected(seq.tokens, 4)[len(seq.tokens):])

    draft_all()
    p = clock.step()
    assert [c.num_draft for c in p.chunks] == [4, 4, 4]
    sched.add(chat(3, n=30, max_tokens=5))
    for _ in range(3):
        draft_all()
        p = clock.step()
        assert sum(c.num_draft for c in p.chunks) == (0 if _ < 2 else 16 - 3 - 4)   # 13 + 13 + 4 prompt rows
    assert clock.first[3] == 6   # ceil(30 / 13) = 3 steps after it arrived
    draft_all()
    p = clock.step()   # the chat decodes now too: 4 decode rows, 12 draft rows
    assert len(p) == 16 and sum(c.num_draft for c in p.chunks) == 12
    clock.run()
    for seq in clock.done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded)
    assert_all_pages_returned(sched)


def test_no_request_starves_under_a_steady_stream_of_short_ones():
    # a new chat every step for 600 steps, at 4 slots: the long prompt keeps at least its
    # equal share of the prompt rows (16 - 3 decode rows, split at most 4 ways: 3), so it
    # finishes; the chats are admitted in arrival order, each as soon as a slot frees
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    sched.add(Sequence(0, long_prompt(1500), max_tokens=3))
    clock = Clock(sched, model)
    admitted = []
    for i in range(1, 601):
        sched.add(chat(i, n=10, max_tokens=4))
        clock.step()
        admitted += [s.seq_id for s in sched.running if s.seq_id not in admitted]
        if 0 not in clock.first:
            assert clock.rows[0][-1] >= 3 and len(clock.rows[0]) == clock.steps
    assert 0 in clock.first and clock.first[0] <= -(-1500 // 3)
    clock.run()
    assert admitted == sorted(admitted) and len(clock.done) == 601   # FIFO, and all finish
    for seq in clock.done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


def test_sixteen_streams_decode_every_step_and_a_new_prompt_takes_the_rest():
    # --parallel 16 with 32-row steps (EngineConfig's automatic step_tokens): 15 streams
    # decode and a new request's prompt gets the other 17 rows of each step
    cfg = wide_config(step_tokens=32, num_slots=16, pages_per_slot=64, num_pages=16 * 64 + 1)
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    for i in range(16):
        sched.add(chat(i, n=16, max_tokens=40 if i else 1))
    clock = Clock(sched, model)
    while 0 not in clock.done:
        clock.step()
    sched.add(Sequence(99, long_prompt(340), max_tokens=2))
    start = clock.steps
    while 99 not in clock.first:
        p = clock.step()
        assert len(p) == 32
    assert clock.first[99] - start == 340 // 17
    clock.run()
    for seq in clock.done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


def test_a_prefix_being_computed_is_waited_for_not_computed_twice():
    # two requests with the same 320-token system prompt arrive together with a short chat:
    # the second waits for the first to compute the shared pages and then takes them from
    # the cache; the chat, sharing nothing, goes past it and gets its rows at once
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    system = long_prompt(320)
    sched.add(Sequence(0, system + [1, 2, 3], max_tokens=3))
    sched.add(Sequence(1, system + [4, 5, 6, 7], max_tokens=3))
    sched.add(chat(2))
    clock = Clock(sched, model)
    # 1 waits, 2 goes past it: 0 and 2 share the rows, 8 each, until 2's last 4
    for want in ([(0, 8), (2, 8)], [(0, 8), (2, 8)], [(0, 12), (2, 4)]):
        assert [(c.seq_id, c.num_rows) for c in clock.step().chunks] == want
    assert clock.first[2] == 3 and sched.sequences[1].status is Status.WAITING
    clock.run()
    assert clock.done[1].num_cached == 320 and sum(clock.rows[1]) == 4 + 2
    assert sum(clock.rows[0]) == 323 + 2   # its prompt once, then two decode rows
    for seq in clock.done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


# --- prefills (/v1/prefill): whole pages into the cache, with the rows requests leave -------

def chunks_of(plan: StepPlan, skip: int | None = None) -> list[tuple[int, int, int, int]]:
    return [(c.seq_id, c.start, c.num_rows, c.num_draft) for c in plan.chunks
            if c.seq_id != skip]


def test_a_prefill_runs_its_whole_pages_samples_nothing_and_its_request_takes_them():
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    prompt = long_prompt(70)   # 4 whole pages of 16 and 6 tokens more, which are not run
    seq = sched.add_prefill(0, prompt)
    assert seq.tokens == prompt[:64] and seq.prefill
    assert sched.queue_length == 0 and not sched.running   # not a request
    plans = []
    while sched.has_work:
        plans.append(step(sched, model))
    assert [chunks_of(p) for p in plans] == [[(0, 16 * i, 16, 0)] for i in range(4)]
    assert all(not p.sample_rows for p in plans)
    assert sched.take_prefilled() == [Prefilled(0, 64, 64)] and sched.take_prefilled() == []
    assert sched.cached_tokens(prompt) == 64
    # the request of that conversation runs only what is new, and its answer is exact
    sched.add(Sequence(1, prompt + [5, 6], max_tokens=3))
    assert chunks_of(step(sched, model)) == [(1, 64, 8, 0)]
    done = run(sched, model)
    assert done[1].num_cached == 64 and done[1].tokens == expected(prompt + [5, 6], 3, mix)
    # shorter than a page: ended at once; all cached already: ended in its first step, no row
    assert sched.add_prefill(2, prompt[:15]) is None
    assert sched.take_prefilled() == [Prefilled(2, 0, 0)]
    sched.add_prefill(3, prompt[:66])
    assert len(step(sched, model)) == 0 and not sched.has_work
    assert sched.take_prefilled() == [Prefilled(3, 64, 0)]
    assert_all_pages_returned(sched)


def twins(setup):
    """Two schedulers given the same requests by setup(sched); the test adds a prefill to
    the first one only."""
    cfg = wide_config()
    out = []
    for _ in range(2):
        sched = Scheduler(cfg)
        setup(sched)
        out.append(Clock(sched, FakeModel(cfg, rule=mix)))
    return out


def test_a_prefill_takes_only_the_rows_streams_leave_and_changes_none_of_theirs():
    def three_chats(sched):
        for i in (1, 2, 3):
            sched.add(chat(i, n=8, max_tokens=40))
    with_prefill, without = twins(three_chats)
    for clock in (with_prefill, without):
        clock.step()
        clock.step()   # the three 8-token prompts: they decode from now on
    with_prefill.sched.add_prefill(9, long_prompt(200))   # 12 pages: 192 tokens
    while 9 in with_prefill.sched.sequences:
        a, b = with_prefill.step(), without.step()
        assert chunks_of(a, skip=9) == chunks_of(b)   # the same rows for every request
    assert with_prefill.rows[9] == [13] * 14 + [10]   # 16 - 3 decode rows a step
    assert with_prefill.sched.take_prefilled() == [Prefilled(9, 192, 192)]
    with_prefill.run()
    without.run()
    assert {i: s.tokens for i, s in with_prefill.done.items()} == {
        i: s.tokens for i, s in without.done.items()}
    assert_all_pages_returned(with_prefill.sched)


def test_a_request_ends_every_prefill_in_the_step_it_arrives_and_is_not_delayed():
    conversation = long_prompt(300)
    with_prefill, without = twins(lambda sched: None)
    with_prefill.sched.add_prefill(0, conversation)
    for _ in range(3):
        with_prefill.step()   # 48 of its 288 tokens
    other = [(5 * j + 2) % 100 for j in range(40)]
    with_prefill.sched.add_prefill(1, other)   # another conversation: it does not end 0
    for clock in (with_prefill, without):
        clock.sched.add(Sequence(2, conversation[:50] + [7, 7], max_tokens=4))
    first = with_prefill.step()
    # both prefills ended before this step was planned, with what they had cached
    assert with_prefill.sched.take_prefilled() == [Prefilled(0, 48, 48), Prefilled(1, 0, 0)]
    assert chunks_of(first) == [(2, 48, 4, 0)]   # the conversation's request took the pages
    without.run()
    with_prefill.run()
    assert with_prefill.done[2].tokens == without.done[2].tokens
    assert with_prefill.first[2] - 3 == 1 and without.first[2] == 4   # ceil(52 / 16) cold
    assert_all_pages_returned(with_prefill.sched)


def test_a_prefill_waits_for_a_free_slot_and_never_takes_one_a_request_waits_for():
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=16, num_pages=2 * 8 + 1,
                          pages_per_slot=8)
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    sched.add(chat(1, n=20, max_tokens=30))
    sched.add(chat(2, n=21, max_tokens=3))
    step(sched, model)
    sched.add_prefill(9, long_prompt(100))
    plan = step(sched, model)   # both slots run requests: the prefill waits, rows or not
    assert 9 not in {c.seq_id for c in plan.chunks} and sched.sequences[9] in sched.prefills
    while 2 in sched.sequences:
        step(sched, model)
    plan = step(sched, model)   # 2 finished: the prefill takes its slot and 15 rows
    assert chunks_of(plan) == [(1, 22, 1, 0), (9, 0, 15, 0)]
    sched.add(Sequence(3, long_prompt(5), max_tokens=3))   # a request comes for that slot
    plan = step(sched, model)
    assert 9 not in sched.sequences and sched.take_prefilled() == [Prefilled(9, 0, 15)]
    assert [c.seq_id for c in plan.chunks] == [1, 3]
    done = run(sched, model)
    for seq in done.values():
        assert seq.tokens == expected(seq.prompt, seq.n_decoded, mix)
    assert_all_pages_returned(sched)


def test_a_newer_prefill_of_the_conversation_ends_the_older_and_runs_only_what_is_new():
    cfg = wide_config()
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    conversation = long_prompt(300)
    sched.add_prefill(0, conversation[:40])
    run(sched, model)
    sched.add_prefill(1, conversation[:75])
    run(sched, model)
    assert sched.take_prefilled() == [Prefilled(0, 32, 32), Prefilled(1, 64, 32)]
    sched.add_prefill(2, conversation[:200])
    step(sched, model)   # 16 of its new rows
    sched.add_prefill(3, conversation[:210])   # grown: 2 ends now, 3 starts from its pages
    assert sched.take_prefilled() == [Prefilled(2, 80, 16)]
    sched.add_prefill(4, [1, 2, 3] * 20)   # another conversation: it waits, ending nothing
    run(sched, model)
    assert sched.take_prefilled() == [Prefilled(3, 208, 128), Prefilled(4, 48, 48)]
    assert_all_pages_returned(sched)


def test_a_running_request_that_needs_pages_takes_them_from_a_prefill_not_by_preemption():
    # 8 usable pages; a 100-token prompt read 4 rows a step (chunk_tokens) beside a prefill
    # read as fast: when the prompt needs its fifth page the prefill holds the other four,
    # so the prefill ends (its full pages stay cached) and the prompt keeps its pace
    cfg = SchedulerConfig(step_tokens=16, num_slots=2, page_size=16, num_pages=9,
                          pages_per_slot=8, chunk_tokens=4)
    sched, model = Scheduler(cfg), FakeModel(cfg, rule=mix)
    clock = Clock(sched, model)
    sched.add(Sequence(1, long_prompt(100), max_tokens=2))
    clock.step()
    sched.add_prefill(9, [(7 * j + 3) % 100 for j in range(112)])
    while 9 in sched.sequences:
        clock.step()
    assert clock.steps == 17 and clock.rows[9] == [4] * 15   # 60 rows: 3 whole pages
    assert sched.take_prefilled() == [Prefilled(9, 48, 60)]
    clock.run()
    assert sched.num_preemptions == 0 and clock.rows[1][:25] == [4] * 25
    assert clock.first[1] == 25   # as it would alone
    assert clock.done[1].tokens == expected(long_prompt(100), 2, mix)
    assert_all_pages_returned(sched)
