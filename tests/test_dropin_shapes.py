"""Where kinetic answers as llama-server does, byte for byte in shape, so that clients and
web apps written for llama-server work unchanged; and where kinetic keeps it apart.

- CORS: a preflight (OPTIONS) is answered 200 with llama-server's headers and no API key;
  the request that follows still meets the Origin rule (403 from another site's page), and a
  page of this computer can read every answer (Access-Control-Allow-Origin).
- Streamed chat: a first chunk with the role and content null, then only chunks with text,
  an empty delta with the finish reason, the usage chunk; log-probabilities of held-back text
  (part of a UTF-8 character) wait for it, and add up to the whole answer's.
- A prompt longer than the context: 400 `exceed_context_size_error` with n_prompt_tokens and
  n_ctx in the error object, on every generating route.
- Form-encoded bodies: the llama-server routes take them; the OpenAI routes answer 415.
- A missing key: 401 `authentication_error` on both dialects' routes.

In-process (tests/app_client.py) over the tiny random-weight Qwen3 model.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import contextmanager

import pytest

from tests.app_client import N_CTX, assert_error_shape, in_process_app

MSG = [{"role": "user", "content": "hi"}]
JSON = {"Content-Type": "application/json"}
LOCAL = "http://localhost:5173"
FOREIGN = "http://evil.example"
EMOJI = "\U0001F368"   # 4 UTF-8 bytes: F0 9F 8D A8


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("dropin")) as a:
        yield a


@contextmanager
def server_config(app, **changes):
    """The app's ServerConfig with `changes`, for the duration."""
    state = app.app.extensions["kinetic"]
    before = state.config
    state.config = dataclasses.replace(before, **changes)
    try:
        yield
    finally:
        state.config = before


def post(app, path: str, body: dict, headers: dict | None = None):
    return app.request("POST", path, json.dumps(body).encode(), dict(JSON, **(headers or {})))


def events(raw: bytes) -> list:
    """An SSE body's JSON events, checked to end with data: [DONE]."""
    parts = raw.decode().split("\n\n")
    assert parts[-2:] == ["data: [DONE]", ""], parts[-3:]
    assert all(p.startswith("data: ") for p in parts[:-1])
    return [json.loads(p[len("data: "):]) for p in parts[:-2]]


# --- CORS ---------------------------------------------------------------------------------

@pytest.mark.parametrize("origin", [LOCAL, FOREIGN, "null"])
def test_preflight_is_answered_as_llama_server_answers_it(app, origin):
    with server_config(app, api_keys=("sk-k",)):   # browsers send no key on a preflight
        status, head, body = app.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
    assert status == 200 and body == b""
    assert head["Access-Control-Allow-Origin"] == origin
    assert head["Access-Control-Allow-Credentials"] == "true"
    assert head["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"
    assert head["Access-Control-Allow-Headers"] == "*"
    assert "Origin" in head["Vary"]


def test_preflight_allows_the_headers_it_asks_for(app):
    # "*" would not cover Authorization: a local page could not send its key
    status, head, _ = app.request("OPTIONS", "/completion", headers={
        "Origin": LOCAL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 200
    assert head["Access-Control-Allow-Headers"] == "authorization,content-type"


def test_preflight_of_any_path_runs_nothing(app):
    for path in ("/no-such-route", "/v1/models", "/health"):
        status, head, body = app.request("OPTIONS", path, headers={"Origin": LOCAL})
        assert (status, body) == (200, b""), path
        assert head["Access-Control-Allow-Origin"] == LOCAL
    status, head, _ = app.request("OPTIONS", "/v1/models")   # not a browser
    assert status == 200 and "Access-Control-Allow-Origin" not in head


@pytest.mark.parametrize("origin", [FOREIGN, "null", "https://localhost.evil.example"])
def test_the_request_after_a_preflight_is_still_refused_from_another_site(app, origin):
    status, head, answer = post(app, "/v1/chat/completions", {"messages": MSG, "max_tokens": 1},
                                {"Origin": origin})
    assert status == 403 and assert_error_shape(status, answer)["type"] == "permission_error"
    assert "Access-Control-Allow-Origin" not in head
    status, head, _ = app.request("GET", "/v1/models", headers={"Origin": origin})
    assert status == 403 and "Access-Control-Allow-Origin" not in head


def test_local_pages_can_read_every_answer(app):
    for origin in (LOCAL, "http://127.0.0.1:3000", "http://[::1]:8080"):
        status, head, _ = app.request("GET", "/v1/models", headers={"Origin": origin})
        assert status == 200
        assert head["Access-Control-Allow-Origin"] == origin
        assert head["Access-Control-Allow-Credentials"] == "true"
        assert "Origin" in head["Vary"]
    # errors and streams too, or the page cannot tell what went wrong
    status, head, _ = app.request("GET", "/v1/nothing", headers={"Origin": LOCAL})
    assert status == 404 and head["Access-Control-Allow-Origin"] == LOCAL
    status, head, raw = post(app, "/v1/chat/completions", {
        "messages": MSG, "max_tokens": 2, "stream": True}, {"Origin": LOCAL})
    assert status == 200 and head["Access-Control-Allow-Origin"] == LOCAL
    events(raw)
    # no Origin (not a browser): no CORS headers
    status, head, _ = app.request("GET", "/v1/models")
    assert status == 200 and "Access-Control-Allow-Origin" not in head


@pytest.mark.parametrize("path", ["/slots", "/props", "/metrics", "/api/ps", "/v1/models",
                                  "/health"])
def test_a_foreign_host_name_is_refused_on_loopback(app, path):
    # DNS rebinding: a page whose name now resolves to 127.0.0.1 sends no Origin (same-origin)
    # but its own name as Host
    status, head, answer = app.request("GET", path, headers={"Host": "attacker.example"})
    assert status == 403
    if path.startswith("/api/"):   # Ollama's own error shape
        assert "attacker.example" in answer["error"]
    else:
        assert assert_error_shape(status, answer)["type"] == "permission_error"
    for host in ("localhost:8080", "127.0.0.1", "127.3.4.5:80", "[::1]:8080", "app.localhost",
                 "LOCALHOST."):
        assert app.request("GET", path, headers={"Host": host})[0] == 200, host


def test_allowed_hosts_an_api_key_or_a_public_address_lift_the_host_rule(app):
    foreign = {"Host": "box.lan:8080"}
    assert app.request("GET", "/v1/models", headers=foreign)[0] == 403
    with server_config(app, allowed_hosts=("box.lan",)):
        assert app.request("GET", "/v1/models", headers=foreign)[0] == 200
        assert app.request("GET", "/v1/models", headers={"Host": "other.lan"})[0] == 403
    with server_config(app, allowed_hosts=("*",)):
        assert app.request("GET", "/v1/models", headers=foreign)[0] == 200
    with server_config(app, api_keys=("k",)):   # the key guards every route but /health
        assert app.request("GET", "/v1/models", headers=dict(foreign, **{
            "Authorization": "Bearer k"}))[0] == 200
    with server_config(app, host="0.0.0.0"):    # reached under names it cannot know
        assert app.request("GET", "/v1/models", headers=foreign)[0] == 200


@pytest.mark.parametrize("header,name", [
    ("localhost:8080", "localhost"), ("[::1]:80", "::1"), ("Example.COM.", "example.com"),
    ("a:b", None), ("[::1", None), ("[::1]x", None), (":80", None)])
def test_host_names_are_read_without_port_or_brackets(header, name):
    from kinetic.api.access import host_name
    assert host_name(header) == name


# --- streamed chat framing ----------------------------------------------------------------

def byte_token_bias(app) -> dict[str, int]:
    """logit_bias that makes the model spell EMOJI one byte token at a time (with a grammar
    that allows only EMOJI), so that three of every four tokens add no text yet."""
    model = app.app.extensions["kinetic"].model
    tok = model.tokenizer
    ids = {tok.token_bytes(t)[0]: t for t in range(model.config.vocab_size)
           if len(tok.token_bytes(t)) == 1}
    return {str(ids[b]): 100 for b in EMOJI.encode()}


def emoji_request(app, **more) -> dict:
    return dict({"messages": MSG, "max_tokens": 9, "temperature": 0,
                 "grammar": f'root ::= "{EMOJI * 3}"', "logit_bias": byte_token_bias(app),
                 "chat_template_kwargs": {"enable_thinking": False}}, **more)


@pytest.mark.parametrize("logprobs", [False, True], ids=["plain", "logprobs"])
def test_chat_stream_is_framed_as_llama_server_frames_it(app, logprobs):
    body = emoji_request(app, logprobs=logprobs)
    status, _, whole = post(app, "/v1/chat/completions", body)
    assert status == 200
    status, _, raw = post(app, "/v1/chat/completions", dict(
        body, stream=True, stream_options={"include_usage": True}))
    assert status == 200
    first, *middle, finish, usage = events(raw)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert first["choices"][0]["finish_reason"] is None
    assert middle, "the answer came in no chunk"
    for chunk in middle:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None
        assert set(choice["delta"]) == {"content"} and choice["delta"]["content"], choice
    assert finish["choices"][0]["delta"] == {}
    assert finish["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert usage["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [usage["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
    message = whole["choices"][0]["message"]
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == message["content"]
    assert message["content"].startswith(EMOJI * 2)
    streamed = [e for c in middle + [finish] if c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]
    if logprobs:
        # 9 tokens in fewer chunks: the entries of held-back bytes waited for their text
        assert len(middle) < 9
        assert streamed == whole["choices"][0]["logprobs"]["content"]
        assert len(streamed) == whole["usage"]["completion_tokens"] == 9
    else:
        assert streamed == [] and whole["choices"][0]["logprobs"] is None


def test_completion_stream_sends_no_empty_text(app):
    body = {"prompt": "hi", "max_tokens": 9, "temperature": 0, "logprobs": 1,
            "grammar": f'root ::= "{EMOJI * 3}"', "logit_bias": byte_token_bias(app)}
    status, _, whole = post(app, "/v1/completions", body)
    assert status == 200
    status, _, raw = post(app, "/v1/completions", dict(body, stream=True))
    *middle, finish = events(raw)
    assert all(c["choices"][0]["text"] and c["choices"][0]["finish_reason"] is None
               for c in middle)
    assert finish["choices"][0]["text"] == ""
    assert "".join(c["choices"][0]["text"] for c in middle) == whole["choices"][0]["text"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in middle + [finish]:
        for key, values in (c["choices"][0]["logprobs"] or {}).items():
            merged[key] += values
    assert merged == whole["choices"][0]["logprobs"] and len(merged["tokens"]) == 9


# --- a prompt longer than the context -----------------------------------------------------

LONG_TEXT = " ".join(["word"] * (N_CTX + 20))


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]},
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}],
                              "stream": True}, "messages"),
    ("/v1/completions", {"prompt": LONG_TEXT}, "prompt"),
    ("/completion", {"prompt": LONG_TEXT}, "prompt"),
    ("/completions", {"prompt": LONG_TEXT, "stream": True}, "prompt"),
    ("/v1/prefill", {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages"),
])
def test_prompt_over_the_context_in_llama_server_shape(app, path, body, param):
    status, head, answer = post(app, path, body)
    assert status == 400 and head["Content-Type"].startswith("application/json")
    err = assert_error_shape(status, answer, path)
    assert err["type"] == "exceed_context_size_error"
    assert err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX
    assert "exceeds the available context size" in err["message"]
    assert err["param"] == param and err["code"] == "context_length_exceeded"


def test_context_error_counts_the_prompt_exactly(app):
    for n in (N_CTX, N_CTX + 7):
        status, _, answer = post(app, "/completion", {"prompt": [1] * n, "n_predict": 1})
        err = assert_error_shape(status, answer)
        assert (err["n_prompt_tokens"], err["n_ctx"]) == (n, N_CTX)
        assert f"({n} tokens)" in err["message"] and f"({N_CTX} tokens)" in err["message"]
    # one token of room is enough
    status, _, _ = post(app, "/completion", {"prompt": [1] * (N_CTX - 1), "n_predict": 1})
    assert status == 200


# --- form-encoded bodies ------------------------------------------------------------------

FORM = {"Content-Type": "application/x-www-form-urlencoded"}   # what curl -d sends


def test_form_encoded_bodies(app):
    """llama-server's routes read the body as JSON whatever its type; the OpenAI routes keep
    docs/server.md's 415 (docs/compat.md says why)."""
    for path, body in (("/completion", {"prompt": "hi", "n_predict": 1}),
                       ("/completions", {"prompt": "hi", "n_predict": 1}),
                       ("/tokenize", {"content": "hi"})):
        status, _, answer = app.request("POST", path, json.dumps(body).encode(), FORM)
        assert status == 200, (path, answer)
    for path, body in (("/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
                       ("/chat/completions", {"messages": MSG, "max_tokens": 1}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 1})):
        status, _, answer = app.request("POST", path, json.dumps(body).encode(), FORM)
        err = assert_error_shape(status, answer, path)
        assert status == 415 and "application/json" in err["message"]


# --- the API key --------------------------------------------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/completions", {"prompt": "hi", "n_predict": 1}),
    ("/completion", {"prompt": "hi", "n_predict": 1}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 1}),
])
def test_a_missing_or_wrong_key_is_an_authentication_error(app, path, body):
    with server_config(app, api_keys=("sk-k",)):
        for auth in ({}, {"Authorization": "Bearer sk-wrong"}):
            status, head, answer = post(app, path, body, auth)
            err = assert_error_shape(status, answer, path)
            assert status == 401 and err["type"] == "authentication_error"
            assert head["WWW-Authenticate"] == "Bearer"
        assert post(app, path, body, {"Authorization": "Bearer sk-k"})[0] == 200
        assert post(app, path, body, {"X-Api-Key": "sk-k"})[0] == 200
