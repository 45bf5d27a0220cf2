"""The prefix cache reuses a finished request's partly filled last page, not only whole
pages: an identical prompt sent again reuses all but its last token, as llama-server's slot
cache does, and the answer and its log-probabilities stay the same bits as without any
cache (the rows of a page are the same values whoever computed them)."""

from __future__ import annotations

import pytest

from kinetic.engine.engine_config import EngineConfig
from kinetic.engine.request import GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from kinetic.llm import open_model
from tests.tiny_models import write_tiny_model

N_CTX = 256


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("partial") / "t.gguf", "qwen3",
                            context_length=N_CTX)


def _engine(path, **config):
    return open_model(path, EngineConfig(parallel=2, n_ctx=N_CTX, **config)).engine


def _answer(engine, prompt, n=5, seed=None):
    params = SamplingParams(temperature=0.0 if seed is None else 0.9, seed=seed)
    deltas = list(engine.generate(GenerationRequest(prompt, params, n, logprobs=3)))
    tokens = [t for d in deltas for t in d.token_ids]
    lps = [(lp.token, lp.logprob, tuple(lp.top)) for d in deltas for lp in d.logprobs]
    return tokens, lps, deltas[-1].usage.cached_tokens


PROMPTS = [list(range(5, 12)),                       # less than a page
           list(range(5, 12)) + [40, 41, 42],        # the same start, longer
           list(range(5, 30)),                       # a page and a part
           list(range(5, 30)) + [7]]


@pytest.mark.parametrize("seed", [None, 11])
def test_partial_pages_are_reused_and_change_nothing(path, seed):
    cached = _engine(path)
    plain = _engine(path, host_cache_mb=0)   # no host tier: whole pages only
    try:
        first = _answer(cached, PROMPTS[0], seed=seed)
        again = _answer(cached, PROMPTS[0], seed=seed)
        assert first[2] == 0 and again[2] == len(PROMPTS[0]) - 1
        for prompt in PROMPTS:
            want = _answer(plain, prompt, seed=seed)
            got = _answer(cached, prompt, seed=seed)
            assert got[:2] == want[:2], prompt       # tokens and logprobs, bit for bit
        # sent again, a prompt reuses all but its last token, past whole pages too
        assert _answer(cached, PROMPTS[1], seed=seed)[2] == len(PROMPTS[1]) - 1
        assert _answer(cached, PROMPTS[3], seed=seed)[2] == len(PROMPTS[3]) - 1
    finally:
        cached.close()
        plain.close()


def test_no_host_tier_no_partial_reuse(path):
    engine = _engine(path, host_cache_mb=0)
    try:
        _answer(engine, PROMPTS[0])
        assert _answer(engine, PROMPTS[0])[2] == 0
    finally:
        engine.close()
