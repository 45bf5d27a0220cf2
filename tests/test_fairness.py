"""Fairness: one request's many prompts must not hold up everyone else's.

The scheduler admits waiting sequences round-robin across groups (one group per HTTP
request), so a one-prompt request behind a 256-prompt one takes the next free slot; the
embedding routes run a request's inputs a piece (one encoder step) at a time, round-robin
across requests, so a small request waits for at most one piece of a big one. Exact orders
and step counts here, never timings (groups under preemption, drafts and finishes:
tests/test_scheduler.py's stress test).
"""

from __future__ import annotations

import asyncio
import threading

from kinetic.engine.scheduler import Scheduler
from kinetic.engine.sequence import SchedulerConfig, Sequence
from tests.test_scheduler import FakeModel, assert_all_pages_returned, expected, step


def admissions(sched: Scheduler, model: FakeModel, steps: int, done=None) -> list[list[int]]:
    """The sequences each of the next `steps` steps admits (their first chunk starts at 0)."""
    return [[c.seq_id for c in step(sched, model, done).chunks if c.start == 0]
            for _ in range(steps)]


def big_request(sched: Scheduler, n: int, group: str = "big", first_id: int = 0) -> None:
    """n prompts of one request (one group); prompt i decodes 2 + i % 4 tokens, so that the
    slots free at different steps."""
    for i in range(n):
        sched.add(Sequence(first_id + i, [i % 90 + 1, 5, 7], max_tokens=2 + i % 4,
                           group=group))


def test_a_one_prompt_request_behind_256_prompts_takes_the_next_free_slot():
    cfg = SchedulerConfig(step_tokens=16, num_slots=4, page_size=4, num_pages=17,
                          pages_per_slot=4)
    sched, model, done = Scheduler(cfg), FakeModel(cfg), {}
    big_request(sched, 256)
    assert admissions(sched, model, 1, done) == [[0, 1, 2, 3]]
    sched.add(Sequence(1000, [9, 9], max_tokens=2, group="small"))
    # step 2: 0 (2 tokens) ends; step 3 admits the small request into its slot, not prompt 4,
    # and its answer is whole 3 steps after it came (first come, first served: 223 steps,
    # after 252 more of the 256: the test below)
    assert admissions(sched, model, 3, done) == [[], [1000], [4]]
    assert done[1000].tokens == expected([9, 9], 2)
    while sched.has_work:
        step(sched, model, done)
    assert len(done) == 257
    assert all(done[i].tokens == expected([i % 90 + 1, 5, 7], 2 + i % 4) for i in range(256))
    assert_all_pages_returned(sched)


def test_the_same_workload_first_come_first_served_holds_the_small_one_back():
    # the test above with every prompt a group of its own: arrival order, as before groups
    cfg = SchedulerConfig(step_tokens=16, num_slots=4, page_size=4, num_pages=17,
                          pages_per_slot=4)
    sched, model, done = Scheduler(cfg), FakeModel(cfg), {}
    for i in range(256):
        sched.add(Sequence(i, [i % 90 + 1, 5, 7], max_tokens=2 + i % 4))
    step(sched, model, done)
    sched.add(Sequence(1000, [9, 9], max_tokens=2))
    steps = 0
    while 1000 not in done:
        step(sched, model, done)
        steps += 1
    assert steps == 223 and len(done) == 255   # 254 of the big one's answers first


def test_groups_take_turns_for_one_slot():
    cfg = SchedulerConfig(step_tokens=4, num_slots=1, page_size=4, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in range(4):
        sched.add(Sequence(i, [1, 2], max_tokens=1, group="a"))
    for i in range(10, 13):
        sched.add(Sequence(i, [3, 4], max_tokens=1, group="b"))
    sched.add(Sequence(20, [5], max_tokens=1))   # a group of its own
    order = [s for a in admissions(sched, model, 8) for s in a]
    assert order == [0, 10, 20, 1, 11, 2, 12, 3] and not sched.has_work


def test_a_stream_of_one_prompt_requests_leaves_the_big_one_a_turn_every_round():
    cfg = SchedulerConfig(step_tokens=4, num_slots=1, page_size=4, num_pages=5,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in range(8):
        sched.add(Sequence(i, [i + 1, 5], max_tokens=1, group="big"))
    order = []
    for k in range(16):   # one more one-prompt request before every step: more than it serves
        sched.add(Sequence(100 + k, [k + 1], max_tokens=1, group=f"r{k}"))
        order += [c.seq_id for c in step(sched, model).chunks if c.start == 0]
    # every round, each group that waits has a turn: the big one after the newcomers that
    # came since its last turn (it goes first on a tie: it has waited longest)
    assert order == [0, 100, 101, 1, 102, 103, 104, 2, 105, 106, 107, 108, 3, 109, 110, 111]


def test_with_one_sequence_a_group_admission_keeps_arrival_order():
    cfg = SchedulerConfig(step_tokens=4, num_slots=2, page_size=2, num_pages=9,
                          pages_per_slot=4)
    sched, model = Scheduler(cfg), FakeModel(cfg)
    for i in range(7):
        sched.add(Sequence(i, [i + 1, i + 2], max_tokens=1 + i % 2))
    order = []
    while sched.has_work:
        order += [c.seq_id for c in step(sched, model).chunks if c.start == 0]
    assert order == list(range(7))


# --- embeddings: a piece at a time, round-robin ---------------------------------------------

def run_requests(requests: dict[str, int], blocked: str) -> list[str]:
    """Run requests (name -> number of pieces) through one `Turns`, in the dict's order; the
    first piece of `blocked` holds its turn until every other request waits in line. Returns
    the order the pieces ran in, as "name:piece"."""
    from kinetic.api.embeddings import Turns, in_turns

    turns, order, release = Turns(), [], threading.Event()

    def run(texts: list) -> list:
        name, k = texts[0]
        if (name, k) == (blocked, 0):
            release.wait(60)   # (only reached when the test is broken)
        order.append(f"{name}:{k}")
        return [t for t in texts]

    async def main() -> None:
        tasks = []
        for name, n in requests.items():
            texts = [(name, k) for k in range(n)]
            tasks.append(asyncio.create_task(in_turns(turns, [[k] for k in range(n)], texts,
                                                      run)))
            await asyncio.sleep(0)   # (a yield, no wait) it takes the turn or joins the line
        assert turns.waiting == len(requests) - 1
        release.set()
        results = await asyncio.gather(*tasks)
        assert [len(r) for r in results] == list(requests.values())

    asyncio.run(main())
    return order


def test_a_small_embedding_request_waits_for_one_piece_of_a_big_one():
    assert run_requests({"big": 5, "small": 1}, "big") == [
        "big:0", "small:0", "big:1", "big:2", "big:3", "big:4"]


def test_embedding_requests_take_turns_piece_by_piece():
    assert run_requests({"a": 4, "b": 3, "c": 1}, "a") == [
        "a:0", "b:0", "c:0", "a:1", "b:1", "a:2", "b:2", "a:3"]


def test_a_cancelled_embedding_request_leaves_the_line():
    from kinetic.api.embeddings import Turns

    async def main() -> list[str]:
        turns, order = Turns(), []

        async def piece(name: str, hold: asyncio.Event | None = None) -> None:
            async with turns.turn():
                order.append(name)
                if hold is not None:
                    await hold.wait()

        hold = asyncio.Event()
        first = asyncio.create_task(piece("first", hold))
        await asyncio.sleep(0)
        gone, last = asyncio.create_task(piece("gone")), asyncio.create_task(piece("last"))
        await asyncio.sleep(0)
        assert turns.waiting == 2
        gone.cancel()
        hold.set()
        await asyncio.gather(first, last)
        # and one cancelled while holding the turn hands it on
        holder = asyncio.create_task(piece("holder", asyncio.Event()))
        await asyncio.sleep(0)
        after = asyncio.create_task(piece("after"))
        await asyncio.sleep(0)
        holder.cancel()
        await after
        return order

    assert asyncio.run(main()) == ["first", "last", "holder", "after"]


def test_embeddings_a_piece_at_a_time_are_the_bits_of_each_text_alone(tmp_path):
    """Through /v1/embeddings: 256 texts of mixed lengths (several encoder steps, so several
    pieces), each vector equal bit for bit to the text's vector alone."""
    import json

    import numpy as np

    import kinetic
    from tests.app_client import model_app
    from tests.embedding_models import write_bert

    path = write_bert(tmp_path / "tiny-bert.gguf", pooling="mean", dtype="f16")
    m = kinetic.load(path)
    rng = np.random.default_rng(36)
    words = "cat dog sky river the of and quick brown fox jumps over lazy 42".split()
    texts = [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(256)]
    assert len(m.encoder.batches([m.input_ids(t) for t in texts])) > 4
    with model_app(path) as app:
        status, body = app.post("/v1/embeddings", json.dumps({"input": texts}).encode())
    assert status == 200, body
    got = np.array([d["embedding"] for d in body["data"]], np.float32)
    for i in (0, 1, 100, 255):
        assert got[i].tobytes() == m.embed(texts[i])[0].tobytes()


def test_the_prompts_of_one_completion_request_share_a_group_of_their_own(tmp_path):
    """Through /completion: the generations of one multi-prompt request carry one group, a
    single-prompt request another; the answers are those of each prompt alone."""
    import json

    import kinetic
    from kinetic.api.app import create_app
    from kinetic.api.core import ServerConfig, ServerState
    from tests.app_client import N_CTX, AppClient
    from tests.tiny_models import write_tiny_model

    model = kinetic.load(write_tiny_model(tmp_path / "tiny.gguf", "qwen3",
                                          context_length=N_CTX), n_ctx=N_CTX, parallel=2)
    groups = []
    start = model.engine.start

    def recording_start(request, *args, **kwargs):
        groups.append(request.group)
        return start(request, *args, **kwargs)

    model.engine.start = recording_start
    state = ServerState(ServerConfig(), "tiny")
    state.set_ready(model)
    app = AppClient(create_app(state))
    try:
        def complete(prompt):
            status, body = app.post("/completion", json.dumps(
                {"prompt": prompt, "n_predict": 3, "temperature": 0,
                 "return_tokens": True}).encode())
            assert status == 200, body
            return body
        many = complete(["one two", "three", "four five six"])
        assert len(groups) == 3 and groups[0] is not None
        assert groups[1] is groups[0] and groups[2] is groups[0]
        alone = [complete(p) for p in ["one two", "three", "four five six"]]
        assert len(groups) == 6 and len({id(g) for g in groups[3:]} | {id(groups[0])}) == 4
        assert [a["tokens"] for a in many] == [a["tokens"] for a in alone]
    finally:
        app.close()
        model.close()
