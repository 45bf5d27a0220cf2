"""Prompt rows given as embeddings (GenerationRequest.images: a vision projector's output)
through the engine, on a tiny random-weight model, bitwise:

- rows whose embeddings are their own tokens' embeddings answer as the tokens do (the rows
  really replace the tokens' inputs, and nothing else changes);
- an image's answer is the same alone, beside other requests, and again from the prefix
  cache; another image at the same place is not served from the first one's pages;
- bad image rows are refused before any work.
"""

from __future__ import annotations

import hashlib

import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.engine.engine import Engine
from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.request import GenerationRequest, ImageRows
from kinetic.engine.sampling_params import SamplingParams
from kinetic.model.layers import embed
from kinetic.model.loader import load_model
from kinetic.text.tokenizer import Tokenizer
from tests.test_invariance import alongside, run
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("img") / "tiny.gguf", "llama",
                            qtype="Q8_0", output_scale=4.0, context_length=1024)
    model = load_model(str(path))
    tok = Tokenizer.from_metadata(model.file.metadata)
    engine = Engine(model, tok, EngineConfig(n_ctx=512, parallel=4), images=True)
    yield tok, engine, model
    engine.close()


PROMPT = "Here is a picture of the sea at dawn, with three boats. What do you see in it?"


def request(ids, images=(), **kw):
    return GenerationRequest(ids, SamplingParams(temperature=0.0), max_tokens=10, logprobs=3,
                             images=tuple(images), **kw)


def rows(n: int, d: int, seed: int) -> ImageRows:
    emb = np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32) * 0.5
    return emb, hashlib.sha256(emb.tobytes()).digest()


def test_rows_that_are_their_tokens_embeddings_answer_as_the_tokens(setup):
    tok, engine, model = setup
    ids = tok.encode(PROMPT, add_special=True)
    own = np.asarray(embed(jnp.asarray(ids[3:15]), model.weights["token_embd"]))
    image = ImageRows(3, own, b"own" * 11)
    placeholders = ids[:3] + [0] * 12 + ids[15:]
    want = run(engine, request(ids))
    got = run(engine, request(placeholders, [image]))
    assert got[:2] == want[:2]


def test_an_images_answer_never_depends_on_load_or_the_cache(setup):
    tok, engine, model = setup
    D = model.config.d_model
    ids = tok.encode(PROMPT, add_special=True)
    emb, digest = rows(24, D, 1)
    prompt = ids[:8] + [0] * 24 + ids[8:]
    req = request(prompt, [ImageRows(8, emb, digest)])
    alone = run(engine, req)
    assert alone[2] == 0
    again = run(engine, req)
    assert again[2] > 8 and again[:2] == alone[:2]       # served from its own pages
    others = [GenerationRequest(tok.encode(t), SamplingParams(temperature=0.7, seed=i),
                                max_tokens=6 + 3 * i)
              for i, t in enumerate(["The days of the week", "Count: one two three",
                                     "A long text about rivers and their sources " * 3])]
    fresh = Engine(model, tok, EngineConfig(n_ctx=512, parallel=4), images=True)
    try:
        busy = alongside(fresh, others, lambda: run(fresh, req))
    finally:
        fresh.close()
    assert busy[:2] == alone[:2]
    # another image at the same place: only the pages before it are shared
    emb2, digest2 = rows(24, D, 2)
    other = run(engine, request(prompt, [ImageRows(8, emb2, digest2)]))
    assert other[2] <= 8 and other[:2] != alone[:2]


def test_bad_image_rows_are_refused(setup):
    tok, engine, model = setup
    ids = tok.encode(PROMPT, add_special=True)
    with pytest.raises(ValueError, match="width"):
        engine.start(request(ids, [ImageRows(2, np.zeros((3, 7), np.float32), b"x")]),
                     lambda d: None)
    with pytest.raises(ValueError, match="in the prompt"):
        request(ids, [ImageRows(len(ids) - 1, np.zeros((3, model.config.d_model)), b"x")])
    plain = Engine(model, tok, EngineConfig(n_ctx=512, parallel=1))
    try:
        with pytest.raises(ValueError, match="no vision projector"):
            plain.start(request(ids, [ImageRows(2, np.zeros((3, 64), np.float32), b"x")]),
                        lambda d: None)
    finally:
        plain.close()


def test_a_chunk_never_ends_inside_an_image_that_attends_both_ways():
    """Gemma 3's image rows read the keys of the rows after them: the scheduler computes such
    an image in one step, cutting the chunk before it rather than inside it."""
    from kinetic.engine.scheduler import Scheduler
    from kinetic.engine.sequence import SchedulerConfig, Sequence
    sched = Scheduler(SchedulerConfig(step_tokens=16, num_slots=1, page_size=16, num_pages=9,
                                      pages_per_slot=8, chunk_tokens=16))
    seq = Sequence(1, list(range(1, 41)), max_tokens=1)
    seq.blocks = [(10, 22)]
    sched.add(seq)
    starts = []
    for _ in range(4):
        plan = sched.schedule()
        if not len(plan):
            break
        starts.append((int(plan.positions[0]), len(plan)))
        sched.complete(plan, {1: 5} if plan.chunks[0].sampled else {})
    assert starts[:3] == [(0, 10), (10, 16), (26, 14)]


def test_a_both_ways_image_gets_its_rows_beside_another_prompt():
    """Two prompts share a step's rows; one whose next rows are a both-ways image larger than
    its share still gets the whole image in one step, rather than waiting for ever."""
    from kinetic.engine.scheduler import Scheduler
    from kinetic.engine.sequence import SchedulerConfig, Sequence
    sched = Scheduler(SchedulerConfig(step_tokens=16, num_slots=2, page_size=16, num_pages=17,
                                      pages_per_slot=8, chunk_tokens=16))
    image = Sequence(1, list(range(1, 30)), max_tokens=1)
    image.blocks = [(0, 12)]
    sched.add(image)
    sched.add(Sequence(2, list(range(100, 160)), max_tokens=1))
    plan = sched.schedule()
    rows = {c.seq_id: (c.start, c.num_rows) for c in plan.chunks}
    assert rows[1] == (0, 12)
