"""Nothing heavy on the event loop (kinetic/api/offload.py): every route that tokenizes (a
prompt, logit_bias keys written as text, /tokenize, embedding inputs) or renders the chat
template does it in a worker thread; a prompt whose length alone proves that it cannot fit
the context is refused without being tokenized at all, and one that passes that test is
tokenized in pieces and refused once they fill the context; a job whose client went away is
abandoned.

In-process (tests/app_client.py) over the tiny random-weight Qwen3 model (qwen2 vocabulary:
its longest token stands for 128 bytes), and a tiny Qwen3 embedding and reranking model.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import threading
from contextlib import contextmanager

import pytest

from kinetic.api import offload as offload_mod
from kinetic.api.offload import Abandoned, check_abandoned, offload, prompt_tokens
from kinetic.text.chat_template import ChatTemplate
from kinetic.text.tokenizer import Tokenizer
from tests.app_client import N_CTX, assert_error_shape, in_process_app, model_app
from tests.embedding_models import write_qwen3_embedding

MSG = [{"role": "user", "content": "hi there"}]
BIAS = {"hello": 1, " world": -2, "15": 3}   # text keys are tokenized with the model's tokenizer
LONGEST = 128                                 # bytes of the qwen2 vocabulary's longest token


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("offload")) as a:
        yield a


def post(app, path: str, body: dict):
    return app.post(path, json.dumps(body).encode())


@contextmanager
def watched(monkeypatch):
    """Records each tokenizing (Tokenizer._encode_parts: encode, encode_chunks) and chat
    template rendering as (what, the text's length, whether it ran on a thread with a
    running event loop)."""
    calls: list[tuple[str, int, bool]] = []

    def on_loop() -> bool:
        return asyncio._get_running_loop() is not None

    parts, render = Tokenizer._encode_parts, ChatTemplate.render

    def encode_parts(self, text, *args, **kwargs):
        calls.append(("tokenize", len(text), on_loop()))
        return parts(self, text, *args, **kwargs)

    def rendering(self, *args, **kwargs):
        text = render(self, *args, **kwargs)
        calls.append(("render", len(text), on_loop()))
        return text

    monkeypatch.setattr(Tokenizer, "_encode_parts", encode_parts)
    monkeypatch.setattr(ChatTemplate, "render", rendering)
    yield calls


GENERATING = [
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "logit_bias": BIAS}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1, "logit_bias": BIAS,
                              "stream": True}),
    ("/v1/completions", {"prompt": "hi there", "max_tokens": 1, "logit_bias": BIAS}),
    ("/completion", {"prompt": ["hi", 15, "there"], "n_predict": 1, "logit_bias": BIAS}),
    ("/completion", {"prompt": ["one", "two"], "n_predict": 1, "logit_bias": BIAS}),
    ("/v1/prefill", {"messages": MSG, "logit_bias": BIAS}),
    ("/apply-template", {"messages": MSG, "logit_bias": BIAS}),
    ("/tokenize", {"content": "hi there", "with_pieces": True}),
    ("/api/chat", {"model": "m", "messages": MSG, "stream": False,
                   "options": {"num_predict": 1}}),
    ("/api/generate", {"model": "m", "prompt": "hi there", "stream": False,
                       "options": {"num_predict": 1}}),
    ("/api/generate", {"model": "m", "prompt": "hi there", "raw": True, "stream": False,
                       "options": {"num_predict": 1}}),
]


@pytest.mark.parametrize("path,body", GENERATING,
                         ids=[f"{i}-{p}" for i, (p, _) in enumerate(GENERATING)])
def test_tokenizing_and_rendering_run_off_the_event_loop(app, monkeypatch, path, body):
    with watched(monkeypatch) as calls:
        status, answer = post(app, path, body)
    assert status == 200, answer
    assert any(what == "tokenize" for what, _, _ in calls), calls   # the watch sees them
    assert not [c for c in calls if c[2]], f"on the event loop: {calls}"


def test_logit_bias_text_keys_are_tokenized_off_the_event_loop(app, monkeypatch):
    # 1000 keys of text: the body's parsing tokenizes each one
    bias = {f"word{i} " * 20: 1 for i in range(1000)}
    with watched(monkeypatch) as calls:
        status, answer = post(app, "/v1/chat/completions",
                              {"messages": MSG, "max_tokens": 1, "logit_bias": bias})
    assert status == 400 and answer["error"]["param"] == "logit_bias"   # too many tokens
    assert sum(1 for what, n, _ in calls if what == "tokenize" and n > 100) > 50
    assert not [c for c in calls if c[2]]


# --- the context 400 before tokenizing -------------------------------------------------------

def long_prompt_bodies(text: str) -> list[tuple[str, dict, str]]:
    msgs = [{"role": "user", "content": text}]
    return [
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 1}, "messages"),
        ("/v1/completions", {"prompt": text, "max_tokens": 1}, "prompt"),
        ("/completion", {"prompt": text, "n_predict": 1}, "prompt"),
        ("/completion", {"prompt": [1, 2, text], "n_predict": 1}, "prompt"),
        ("/v1/prefill", {"messages": msgs}, "messages"),
        ("/api/chat", {"model": "m", "messages": msgs, "stream": False}, None),
        ("/api/generate", {"model": "m", "prompt": text, "stream": False}, None),
        ("/api/generate", {"model": "m", "prompt": text, "raw": True, "stream": False}, None),
    ]


def assert_context_error(path: str, status: int, answer, param: str | None) -> str:
    if path.startswith("/api/"):
        assert status == 400 and "exceeds the available context size" in answer["error"]
        return answer["error"]
    err = assert_error_shape(status, answer, path)
    assert err["type"] == "exceed_context_size_error", err
    assert err["code"] == "context_length_exceeded" and err["param"] == param
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] >= N_CTX
    return err["message"]


# bytes / 128 > N_CTX: at least N_CTX + 1 tokens, whatever the text
OVER_BY_LENGTH = "lorem ipsum dolor sit amet " * (N_CTX * LONGEST // 27 + 10)


@pytest.mark.parametrize("path,body,param", long_prompt_bodies(OVER_BY_LENGTH),
                         ids=[f"{i}-{p}" for i, (p, _, _) in
                              enumerate(long_prompt_bodies(OVER_BY_LENGTH))])
def test_a_prompt_too_long_by_its_bytes_is_never_tokenized(app, monkeypatch, path, body,
                                                           param):
    assert len(OVER_BY_LENGTH.encode()) > N_CTX * LONGEST
    with watched(monkeypatch) as calls:
        status, answer = post(app, path, body)
    message = assert_context_error(path, status, answer, param)
    assert "at least" in message
    assert not [c for c in calls if c[0] == "tokenize"], calls
    assert not [c for c in calls if c[2]], calls


# passes the length test (bytes / 128 < N_CTX) but has some 3,000 tokens: refused once the
# pieces counted so far fill the context, the rest never tokenized
OVER_BY_COUNT = "word " * (N_CTX * LONGEST // 5 - 200)


@pytest.mark.parametrize("path,body,param", long_prompt_bodies(OVER_BY_COUNT),
                         ids=[f"{i}-{p}" for i, (p, _, _) in
                              enumerate(long_prompt_bodies(OVER_BY_COUNT))])
def test_a_long_prompt_is_refused_part_way_through(app, monkeypatch, path, body, param):
    pieces = {"taken": 0, "all": 0}
    tok = app.app.extensions["kinetic"].model.tokenizer
    pieces["all"] = sum(1 for _ in tok.encode_chunks(OVER_BY_COUNT))
    assert tok.min_tokens(OVER_BY_COUNT, True) < N_CTX and pieces["all"] > 4
    chunks = Tokenizer.encode_chunks

    def counted(self, *args, **kwargs):
        for ids in chunks(self, *args, **kwargs):
            pieces["taken"] += 1
            yield ids

    monkeypatch.setattr(Tokenizer, "encode_chunks", counted)
    status, answer = post(app, path, body)
    assert_context_error(path, status, answer, param)
    assert 0 < pieces["taken"] < pieces["all"] - 2, pieces


def test_a_prompt_that_just_fills_the_context_is_counted_exactly(app):
    # the count is known whole once the last piece is in: the exact 400, not a lower bound
    tok = app.app.extensions["kinetic"].model.tokenizer
    for n in (N_CTX - 1, N_CTX, N_CTX + 1):
        text = "hi" + " hi" * (n - 1)
        assert len(tok.encode(text, True, True)) == n   # a token a word
        status, answer = post(app, "/completion", {"prompt": text, "n_predict": 1})
        if n < N_CTX:
            assert status == 200, answer
            continue
        err = assert_error_shape(status, answer)
        assert err["n_prompt_tokens"] == n and f"({n} tokens)" in err["message"]


def test_tokenize_has_no_context_limit(app):
    text = "word " * (N_CTX * 3)
    tok = app.app.extensions["kinetic"].model.tokenizer
    status, answer = post(app, "/tokenize", {"content": text})
    assert status == 200 and answer["tokens"] == tok.encode(text, False, True)
    assert len(answer["tokens"]) > N_CTX


def test_detokenize_answers_off_the_loop_the_same(app):
    status, answer = post(app, "/detokenize", {"tokens": [1, 2, 3]})
    tok = app.app.extensions["kinetic"].model.tokenizer
    assert status == 200 and answer == {"content": tok.decode_pieces([1, 2, 3])}
    status, answer = post(app, "/detokenize", {"tokens": [1, 10**9]})
    assert status == 400 and answer["error"]["param"] == "tokens"


# --- embedding and rerank inputs ------------------------------------------------------------

ENC_CTX = 128


@pytest.fixture(scope="module", params=["last", "rank"])
def encoder(request, tmp_path_factory):
    path = write_qwen3_embedding(tmp_path_factory.mktemp("enc") / f"{request.param}.gguf",
                                 pooling=request.param, context_length=ENC_CTX)
    with model_app(path, n_ctx=ENC_CTX) as a:
        yield request.param, a


def test_encoder_inputs_off_the_loop_and_refused_by_length(encoder, monkeypatch):
    kind, app = encoder
    long = "lorem ipsum " * (ENC_CTX * LONGEST // 12 + 10)
    if kind == "rank":
        served = [("/v1/rerank", {"query": "q", "documents": ["a b", "c"]})]
        refused = [("/v1/rerank", {"query": "q", "documents": ["a", long]}, "documents")]
    else:
        served = [("/v1/embeddings", {"input": ["a b", "c"]}),
                  ("/embedding", {"content": "a b"}),
                  ("/api/embed", {"model": "m", "input": "a b"}),
                  ("/api/embeddings", {"model": "m", "prompt": "a b"})]
        refused = [("/v1/embeddings", {"input": ["a", long]}, "input"),
                   ("/embedding", {"content": [long]}, "content"),
                   ("/api/embed", {"model": "m", "input": long, "truncate": False}, None)]
    for path, body in served:
        with watched(monkeypatch) as calls:
            status, answer = post(app, path, body)
        assert status == 200, (path, answer)
        assert calls and not [c for c in calls if c[2]], (path, calls)
    for path, body, param in refused:
        with watched(monkeypatch) as calls:
            status, answer = post(app, path, body)
        assert status == 400, (path, answer)
        message = answer["error"] if path.startswith("/api/") else answer["error"]["message"]
        assert "is too large: at least" in message, message
        if param is not None:
            assert answer["error"]["param"] == param
            assert answer["error"]["code"] == "context_length_exceeded"
        assert not [c for c in calls if c[0] == "tokenize" and c[1] > 1000], (path, calls)
    # truncated instead: served
    body = ({"query": "q", "documents": [long], "truncate": True} if kind == "rank"
            else {"input": long, "truncate": True})
    status, answer = post(app, "/v1/rerank" if kind == "rank" else "/v1/embeddings", body)
    assert status == 200, answer


# --- abandoning ---------------------------------------------------------------------------

def test_an_abandoned_job_stops_at_its_next_piece(app):
    tok = app.app.extensions["kinetic"].model.tokenizer
    abandon = threading.Event()
    ctx = contextvars.copy_context()
    ctx.run(offload_mod._abandon.set, abandon)
    text = "word " * 5000
    assert ctx.run(prompt_tokens, tok, text, None, "content") == tok.encode(text, True, True)
    abandon.set()
    with pytest.raises(Abandoned):
        ctx.run(prompt_tokens, tok, text, None, "content")


def test_cancelling_the_route_abandons_its_job():
    started, finished = threading.Event(), threading.Event()
    seen = {}

    def job():
        started.set()
        offload_mod._abandon.get().wait(60)   # until the route is cancelled
        try:
            check_abandoned()
        except Abandoned:
            seen["abandoned"] = True
        finally:
            finished.set()

    async def route():
        task = asyncio.ensure_future(offload(job))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(route())
    assert finished.wait(60) and seen == {"abandoned": True}


def test_errors_raised_in_a_job_come_back_as_they_are():
    from kinetic.api.errors import APIError

    def job():
        raise APIError(400, "no", param="x")

    async def route():
        with pytest.raises(APIError) as e:
            await offload(job)
        return e.value

    err = asyncio.run(route())
    assert (err.status, err.message, err.param) == (400, "no", "x")


def test_the_tokens_answer_is_written_as_dumps_writes_it():
    from kinetic.api.core import dumps
    from kinetic.api.dialects.llama_server import _tokens_json
    for items in ([], [7], list(range(10)), [{"id": 1, "piece": 'é"\n'}] * 5):
        for per in (1, 3, 1 << 16):
            assert _tokens_json(items, per) == dumps({"tokens": items}), (items, per)
