"""llama-server's POST /completion on a tiny random-weight Qwen3 in this process
(tests/app_client.py): timings and the prefix cache, streamed events (token ids, timings per
token, prompt progress), completion_probabilities (raw and post-sampling, checked against the
model's own logits), the prompt forms (several prompts, mixed ids and text, JSON objects),
response_fields, --n-predict, stop_type / stopping_word / truncated, and bodies of any
content type. tests/test_llama_server_api.py runs the same route on a real model in a
`kinetic serve` process.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from kinetic.api.dialects.llama_completion import MAX_PROMPTS, pick_fields
from tests.app_client import assert_error_shape, model_app
from tests.tiny_models import DATA, write_tiny_model

N_CTX = 256
PAGE = 16      # EngineConfig.page_size: the prefix cache keeps whole pages
PROMPT = "the quick brown fox jumps over the lazy dog, and then the dog sleeps in the sun"
TIMINGS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]
PIECE_FIELDS = ["index", "content", "tokens", "stop", "id_slot", "tokens_predicted",
                "tokens_evaluated"]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    path = write_tiny_model(tmp_path_factory.mktemp("llama-completion") / "tiny-qwen3.gguf",
                            "qwen3", context_length=N_CTX, chat_template=template)
    with model_app(path, n_ctx=N_CTX, parallel=2) as client:
        yield client


@pytest.fixture(scope="module")
def model(app):
    return app.app.extensions["kinetic"].model


def post(app, body, path: str = "/completion", content_type: str = "application/json"):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return app.post(path, raw, content_type)


def complete(app, **body):
    status, answer = post(app, dict({"prompt": PROMPT, "temperature": 0}, **body))
    assert status == 200, answer
    return answer


def stream(app, **body) -> list[dict]:
    """The events of a streamed /completion (llama-server sends no [DONE])."""
    status, raw = post(app, dict({"prompt": PROMPT, "temperature": 0, "stream": True}, **body))
    assert status == 200, raw
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[len("data: "):]) for e in events]


# --- 1. timings and the prefix cache -------------------------------------------------------

def test_timings_fields_and_cached_prompt(app, model):
    n_prompt = len(model.prompt_ids(PROMPT))
    assert n_prompt > PAGE
    first = complete(app, n_predict=3, ignore_eos=True, cache_prompt=True)
    again = complete(app, n_predict=3, ignore_eos=True, cache_prompt=True)
    for answer in (first, again):
        t = answer["timings"]
        assert list(t) == TIMINGS
        assert t["prompt_n"] + t["cache_n"] == n_prompt == answer["tokens_evaluated"]
        assert t["predicted_n"] == 3 == answer["tokens_predicted"]
        assert all(t[k] >= 0 for k in TIMINGS)
        assert t["prompt_per_second"] == pytest.approx(1e3 * t["prompt_n"] / t["prompt_ms"])
    # the second run finds all the first one ran but its last token (whole pages, and the
    # partly filled page kept in host memory); the last token is always run: its logits are
    # what the step is for
    assert again["timings"]["cache_n"] == n_prompt - 1
    assert again["content"] == first["content"]


def test_timings_per_token_in_every_event(app):
    events = stream(app, n_predict=4, ignore_eos=True, timings_per_token=True)
    *pieces, last = events
    assert pieces and all(list(e["timings"]) == TIMINGS for e in events)
    assert [p["timings"]["predicted_n"] for p in pieces] == [p["tokens_predicted"]
                                                             for p in pieces]
    assert last["timings"]["predicted_n"] == 4
    plain = stream(app, n_predict=2, ignore_eos=True)
    assert all("timings" not in p for p in plain[:-1]) and "timings" in plain[-1]


# --- 2. streamed events ------------------------------------------------------------------

def test_stream_pieces_carry_their_token_ids(app, model):
    whole = complete(app, n_predict=10, ignore_eos=True, return_tokens=True)
    *pieces, last = stream(app, n_predict=10, ignore_eos=True, return_tokens=True)
    assert all(list(p) == PIECE_FIELDS and p["stop"] is False for p in pieces)
    assert all(p["tokens"] for p in pieces)
    assert [t for p in pieces for t in p["tokens"]] == whole["tokens"]
    assert "".join(p["content"] for p in pieces) == whole["content"]
    assert [p["tokens_predicted"] for p in pieces] == list(np.cumsum(
        [len(p["tokens"]) for p in pieces]))
    # the last event is the answer object, its content and tokens already sent
    assert last["stop"] is True and last["content"] == "" and last["tokens"] == []
    assert set(last) == set(whole) - {"completion_probabilities"}
    for key in ("tokens_predicted", "tokens_evaluated", "stop_type", "truncated", "prompt"):
        assert last[key] == whole[key], key
    assert last["generation_settings"]["stream"] is True


def test_return_progress(app, model):
    n_prompt = len(model.prompt_ids(PROMPT + " progress"))
    events = stream(app, prompt=PROMPT + " progress", n_predict=2, ignore_eos=True,
                    return_progress=True)
    progress = [e for e in events if "prompt_progress" in e]
    assert len(progress) == 1 and events[0] is progress[0]
    p = progress[0]
    assert p["content"] == "" and p["tokens"] == [] and p["tokens_predicted"] == 0
    assert list(p["prompt_progress"]) == ["total", "cache", "processed", "time_ms"]
    done = p["prompt_progress"]
    assert done["total"] == done["processed"] == n_prompt
    assert done["cache"] == events[-1]["timings"]["cache_n"]
    assert done["time_ms"] == int(events[-1]["timings"]["prompt_ms"])
    assert not any("prompt_progress" in e for e in stream(app, n_predict=1))


# --- 3. completion_probabilities -----------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_n_probs_are_the_raw_log_probabilities(app, model):
    answer = complete(app, n_predict=3, n_probs=5, ignore_eos=True, return_tokens=True)
    probs = answer["completion_probabilities"]
    assert [p["id"] for p in probs] == answer["tokens"]
    tok = model.tokenizer
    for p in probs:
        assert list(p) == ["id", "token", "bytes", "logprob", "top_logprobs"]
        assert p["token"] == tok.token_piece(p["id"])
        assert bytes(p["bytes"]) == tok.token_bytes(p["id"])
        assert len(p["top_logprobs"]) == 5
        assert [list(e) for e in p["top_logprobs"]] == [["id", "token", "bytes", "logprob"]] * 5
        lps = [e["logprob"] for e in p["top_logprobs"]]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
    # the first token's, from the model's own logits of the prompt
    expect = _log_softmax(model.logits(model.prompt_ids(PROMPT))[-1])
    first = probs[0]
    assert first["logprob"] == pytest.approx(expect[first["id"]], abs=1e-4)
    assert [e["id"] for e in first["top_logprobs"]] == list(np.argsort(-expect, kind="stable")[:5])
    for e in first["top_logprobs"]:
        assert e["logprob"] == pytest.approx(expect[e["id"]], abs=1e-4)


def test_n_probs_streamed_per_piece(app):
    whole = complete(app, n_predict=6, n_probs=2, ignore_eos=True)
    *pieces, last = stream(app, n_predict=6, n_probs=2, ignore_eos=True)
    assert all(len(p["completion_probabilities"]) == len(p["tokens"]) for p in pieces)
    assert [e["id"] for p in pieces for e in p["completion_probabilities"]] == \
        [e["id"] for e in whole["completion_probabilities"]]
    assert "completion_probabilities" not in last


def test_post_sampling_probs_greedy(app):
    answer = complete(app, n_predict=4, n_probs=10, post_sampling_probs=True, ignore_eos=True)
    assert answer["generation_settings"]["post_sampling_probs"] is True
    for p in answer["completion_probabilities"]:
        assert list(p) == ["id", "token", "bytes", "prob", "top_probs"]
        # temperature 0 draws the likeliest token: the only one left, certain
        assert p["prob"] == 1.0
        assert [(e["id"], e["prob"]) for e in p["top_probs"]] == [(p["id"], 1.0)]


def test_post_sampling_probs_follow_the_sampler_chain(app, model):
    """top_k 3, temperature 0.7: the three likeliest tokens, renormalised at that temperature
    (the first token's, computed here from the model's logits)."""
    answer = complete(app, n_predict=3, n_probs=5, post_sampling_probs=True, temperature=0.7,
                      top_k=3, top_p=1.0, min_p=0.0, seed=11, ignore_eos=True)
    for p in answer["completion_probabilities"]:
        top = p["top_probs"]
        assert 1 <= len(top) <= 3 and sum(e["prob"] for e in top) == pytest.approx(1, abs=1e-5)
        assert p["id"] in [e["id"] for e in top]
        assert p["prob"] == pytest.approx(next(e["prob"] for e in top if e["id"] == p["id"]))
    logits = model.logits(model.prompt_ids(PROMPT))[-1].astype(np.float64)
    best = np.argsort(-logits, kind="stable")[:3]
    expect = np.exp(_log_softmax(logits[best] / 0.7))
    first = answer["completion_probabilities"][0]["top_probs"]
    assert [e["id"] for e in first] == list(best)
    assert [e["prob"] for e in first] == pytest.approx(list(expect), abs=1e-4)


# --- 4. prompts ------------------------------------------------------------------------------

def test_several_prompts_answer_a_list(app, model):
    ids = model.prompt_ids(PROMPT)
    answers = complete(app, prompt=[ids, PROMPT, {"prompt_string": PROMPT}], n_predict=4,
                       ignore_eos=True)
    assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
    assert len({a["content"] for a in answers}) == 1
    assert all(a["tokens_evaluated"] == len(ids) for a in answers)
    # one prompt in a list is answered as one object
    single = complete(app, prompt=[PROMPT], n_predict=4, ignore_eos=True)
    assert isinstance(single, dict) and single["content"] == answers[0]["content"]


def test_mixed_ids_and_text_are_one_prompt(app, model):
    tok = model.tokenizer
    head, tail = model.prompt_ids("the quick brown"), tok.encode(" fox", add_special=False)
    answer = complete(app, prompt=[*head, " fox", tail[-1]], n_predict=2, ignore_eos=True)
    assert isinstance(answer, dict)
    assert answer["prompt"] == tok.decode_pieces(head + tail + tail[-1:])
    # text first: tokenized as a prompt of its own (BOS where the model adds one)
    answer = complete(app, prompt=["the quick brown", tail[0]], n_predict=2, ignore_eos=True)
    assert answer["prompt"] == tok.decode_pieces(head + tail[:1])


def test_several_prompts_streamed(app):
    events = stream(app, prompt=[PROMPT, "another prompt"], n_predict=3, ignore_eos=True)
    for index in (0, 1):
        mine = [e for e in events if e["index"] == index]
        assert [e["stop"] for e in mine] == [False] * (len(mine) - 1) + [True]
        assert sum(len(e["tokens"]) for e in mine[:-1]) == mine[-1]["tokens_predicted"] == 3
    assert len(events) == sum(1 for e in events if e["index"] in (0, 1))


@pytest.mark.parametrize("prompt,param,words", [
    ([], "prompt", "empty"),
    ([PROMPT, ""], "prompt[1]", "empty"),
    ([PROMPT, []], "prompt[1]", "empty"),
    ([["a", "b"]], "prompt[0]", "token ids"),
    ([{"text": PROMPT}], "prompt[0]", "prompt_string"),
    ({"prompt_string": 5}, "prompt.prompt_string", ""),
    ({"prompt_string": "hi <__media__>", "multimodal_data": ["iVBORw0KGgo="]}, "prompt",
     "multimodal"),
    ([1, 2, 10**9], "prompt", "vocabulary"),
    ([[1], [10**9]], "prompt[1]", "vocabulary"),
    ([PROMPT, "word " * N_CTX], "prompt[1]", "context"),
    (["hi"] * (MAX_PROMPTS + 1), "prompt", str(MAX_PROMPTS)),
])
def test_bad_prompts(app, prompt, param, words):
    status, answer = post(app, {"prompt": prompt, "n_predict": 1})
    err = assert_error_shape(status, answer, str(prompt)[:80])
    assert status == 400 and err["param"] == param and words in err["message"]


# --- 5. response_fields --------------------------------------------------------------------

def test_response_fields(app, model):
    fields = ["content", "generation_settings/n_predict", "prompt", "timings/cache_n", "nope"]
    answer = complete(app, n_predict=5, ignore_eos=True, response_fields=fields)
    assert list(answer) == fields[:4]
    assert answer["generation_settings/n_predict"] == 5 and answer["content"]
    assert answer["prompt"] == model.tokenizer.decode_pieces(model.prompt_ids(PROMPT))
    # streamed: the pieces as ever, the last event cut to the fields
    *pieces, last = stream(app, n_predict=2, ignore_eos=True, response_fields=["content"])
    assert all(list(p) == PIECE_FIELDS for p in pieces) and last == {"content": ""}
    assert pick_fields({"a": {"b": {"c": 1}}, "d": 2}, ("a/b/c", "a/x", "d/e", "d")) == \
        {"a/b/c": 1, "d": 2}


# --- 6. --n-predict ------------------------------------------------------------------------

def test_server_n_predict_is_the_default_not_a_cap(app):
    state = app.app.extensions["kinetic"]
    config = state.config
    state.config = dataclasses.replace(config, n_predict=4)
    try:
        for asked, expect in ((None, 4), (2, 2), (9, 9)):
            body = {"ignore_eos": True} if asked is None else {"n_predict": asked,
                                                                "ignore_eos": True}
            answer = complete(app, **body)
            assert answer["generation_settings"]["n_predict"] == expect, asked
            assert answer["tokens_predicted"] == expect and answer["stop_type"] == "limit"
            assert answer["truncated"] is False
    finally:
        state.config = config


# --- 7. how the answer ended ---------------------------------------------------------------

def test_stop_word_eos_limit_and_truncated(app, model):
    free = complete(app, n_predict=16, ignore_eos=True, return_tokens=True, n_probs=1)
    assert free["stop_type"] == "limit" and free["stopping_word"] == ""
    assert free["tokens_cached"] == free["tokens_evaluated"] + 16 - 1
    tok = model.tokenizer
    # a stop string: the text of the 6th token, as printable text
    word = tok.decode_pieces(free["tokens"][5:6]).strip() or "zz-none"
    assert word in free["content"], (word, free["content"])
    cut = complete(app, n_predict=16, ignore_eos=True, return_tokens=True, stop=[word],
                   n_probs=1)
    assert cut["content"] == free["content"][:free["content"].index(word)]
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    n = cut["tokens_predicted"]
    assert cut["tokens"] == free["tokens"][:n] and cut["tokens_cached"] == \
        cut["tokens_evaluated"] + n - 1
    # as llama-server: the probabilities of the stop string's tokens are left out
    n_word = len(tok.encode(word, add_special=False))
    assert len(cut["completion_probabilities"]) == max(0, n - n_word)
    streamed = stream(app, n_predict=16, ignore_eos=True, stop=[word])
    assert streamed[-1]["stop_type"] == "word" and streamed[-1]["stopping_word"] == word
    assert "".join(e["content"] for e in streamed) == cut["content"]
    # the end-of-generation token, made certain by a logit bias: not counted
    eos = complete(app, n_predict=8, logit_bias=[[tok.eos_id, 100]])
    assert (eos["stop_type"], eos["stopping_word"], eos["tokens_predicted"]) == ("eos", "", 0)
    assert eos["tokens_cached"] == eos["tokens_evaluated"] and eos["truncated"] is False
    # the context runs out before n_predict: truncated
    prompt = model.tokenizer.encode("word " * (N_CTX - 8), add_special=False)[:N_CTX - 4]
    full = complete(app, prompt=prompt, n_predict=50, ignore_eos=True)
    assert full["truncated"] is True and full["stop_type"] == "limit"
    assert full["tokens_cached"] == N_CTX   # every row of the context, the last token unrun


# --- 8. bodies of any content type --------------------------------------------------------

@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", ""])
def test_body_is_json_whatever_the_content_type(app, content_type):
    body = json.dumps({"prompt": PROMPT, "n_predict": 2, "temperature": 0}).encode()
    for path in ("/completion", "/completions"):
        status, answer = post(app, body, path, content_type)
        assert status == 200 and answer["tokens_predicted"] >= 1, (path, content_type, answer)


def test_float_probabilities_are_json(app):
    """A token the chain dropped has probability 0 (log -inf, which JSON cannot carry): it
    is left out of top_probs, and raw log-probabilities are always finite."""
    answer = complete(app, n_predict=2, n_probs=20, post_sampling_probs=True, temperature=1.0,
                      top_k=2, seed=3, ignore_eos=True)
    assert all(len(p["top_probs"]) <= 2 for p in answer["completion_probabilities"])
    assert all(math.isfinite(e["prob"]) for p in answer["completion_probabilities"]
               for e in p["top_probs"])
