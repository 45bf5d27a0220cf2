"""Black-box tests of `kinetic serve` (OpenAI API) on SmolLM2: one real server process for
the module, driven by the official `openai` package and by raw HTTP.

The server runs with an API key, so the auth rules are checked on the same process; the
limits that need other settings (timeouts, connection limit, signals) are in
tests/test_server_limits.py.
"""

from __future__ import annotations

import json
import re
import threading
import time

import openai
import pytest

from tests.conftest import real_model_file
from tests.serve_process import raw_request, read_until, serving, split_response

pytestmark = pytest.mark.real_model

KEY = "sk-test-kinetic"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 512
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
QUESTION = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("smollm2"), "-c", str(2 * N_CTX), "-np", "2",
                 "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    """The model's tokenizer and chat template, read here to count prompt tokens."""
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.chat_template import ChatTemplate
    from kinetic.text.tokenizer import Tokenizer
    meta = GGUFFile(real_model_file("smollm2")).metadata
    return Tokenizer.from_metadata(meta), ChatTemplate.from_metadata(meta)


def chat_prompt_tokens(tokenizer, messages) -> int:
    tok, template = tokenizer
    return len(tok.encode(template.render(messages), add_special=True, parse_special=True))


# --- health and models --------------------------------------------------------------------

def test_health_needs_no_key_and_counts_slots(server):
    for path in ("/health", "/v1/health"):
        status, _, body = server.request("GET", path)
        assert status == 200
        assert body["status"] == "ok"
        assert body["slots_idle"] + body["slots_processing"] == 2


def test_models(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_ID]
    m = models.data[0]
    assert m.object == "model" and m.owned_by == "kinetic"
    assert m.model_extra["context_length"] == N_CTX
    assert client.models.retrieve(MODEL_ID).id == MODEL_ID
    status, _, body = server.request("GET", "/models", headers=AUTH)
    assert status == 200 and body["data"][0]["id"] == MODEL_ID
    status, _, body = server.request("GET", "/v1/models/other", headers=AUTH)
    assert status == 404 and body["error"]["type"] == "not_found_error"


# --- chat completions ---------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_chat_streamed_equals_whole(client, tokenizer, sampling):
    whole = client.chat.completions.create(model="anything", messages=QUESTION, max_tokens=8,
                                           **sampling)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = whole.usage
    assert u.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    assert u.completion_tokens <= 8 and (choice.finish_reason == "stop" or u.completion_tokens == 8)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(client.chat.completions.create(
        model="anything", messages=QUESTION, max_tokens=8, stream=True,
        stream_options={"include_usage": True}, **sampling))
    assert {c.id for c in chunks} == {chunks[0].id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last, usage = chunks
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == choice.message.content
    assert all(c.choices[0].finish_reason is None for c in body)
    assert last.choices[0].finish_reason == choice.finish_reason
    assert usage.choices == []
    assert usage.usage.prompt_tokens == u.prompt_tokens
    assert usage.usage.completion_tokens == u.completion_tokens
    # the same prompt ran just before: its full pages come from the prefix cache
    assert usage.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_logprobs(client):
    kw = dict(model="m", messages=QUESTION, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == whole.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # greedy takes the likeliest token of the raw logits
        assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace").startswith(e.token)
    assert b"".join(bytes(e.bytes) for e in entries).decode() == whole.choices[0].message.content

    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in streamed] == \
        [(e.token, e.logprob, [t.logprob for t in e.top_logprobs]) for e in entries]


def test_chat_fields_are_honoured(client):
    base = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8,
                                          temperature=0)
    text = base.choices[0].message.content
    assert len(text) > 4
    stop = text[2:4]
    stopped = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=8,
                                             temperature=0, stop=[stop])
    assert stopped.choices[0].message.content == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    short = client.chat.completions.create(model="m", messages=QUESTION, temperature=0,
                                           max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
    assert text.startswith(short.choices[0].message.content)


def test_concurrent_requests_get_their_own_answers(client):
    alone = client.chat.completions.create(model="m", messages=QUESTION, max_tokens=6,
                                           temperature=1.0, seed=5).choices[0].message.content
    answers = [None, None]

    def ask(i: int) -> None:
        answers[i] = client.chat.completions.create(
            model="m", messages=QUESTION, max_tokens=6, temperature=1.0,
            seed=5).choices[0].message.content
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [alone, alone]


# --- completions --------------------------------------------------------------------------

def test_n_choices_are_each_what_their_seed_gives_alone(client, tokenizer):
    """n = 3: three choices of one prompt (more than the server's 2 slots: the third waits),
    choice i what n = 1 gives with the seed + i; the prompt counted once in the usage, the
    completions summed; streamed, each index's pieces make its whole choice."""
    ask = dict(model="m", messages=QUESTION, max_tokens=8, temperature=0.9, seed=42)
    whole = client.chat.completions.create(n=3, **ask)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**dict(ask, seed=42 + i)).choices[0]
             for i in range(3)]
    assert [(c.message.content, c.finish_reason) for c in whole.choices] == \
        [(c.message.content, c.finish_reason) for c in alone]
    assert len({c.message.content for c in alone}) > 1   # the seeds do differ
    u = whole.usage
    assert u.prompt_tokens == chat_prompt_tokens(tokenizer, QUESTION)
    assert u.completion_tokens == sum(
        client.chat.completions.create(**dict(ask, seed=42 + i)).usage.completion_tokens
        for i in range(3))
    chunks = list(client.chat.completions.create(
        n=3, stream=True, stream_options={"include_usage": True}, **ask))
    texts = ["", "", ""]
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert sum(1 for ch in chunks for c in ch.choices if c.finish_reason) == 3


def test_n_completions_greedy_are_the_same(client):
    out = client.completions.create(model="m", prompt="Once upon a time", max_tokens=6,
                                    temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text == out.choices[1].text and out.choices[0].text


def test_completions_legacy_logprobs(client, tokenizer):
    prompt = "The capital of France is"
    kw = dict(model="m", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kw)
    assert whole.object == "text_completion"
    choice = whole.choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert len(lp.tokens) == len(lp.token_logprobs) == whole.usage.completion_tokens
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and top[token] == logprob  # greedy: the likeliest
    tok, _ = tokenizer
    assert whole.usage.prompt_tokens == len(tok.encode(prompt, add_special=True,
                                                       parse_special=True))

    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert streamed == lp.tokens and offsets == lp.text_offset


def test_completions_logit_bias_bans_a_token(client, tokenizer):
    tok, _ = tokenizer
    prompt = "The capital of France is"
    first = client.completions.create(model="m", prompt=prompt, max_tokens=1,
                                      temperature=0).choices[0].text
    ids = tok.encode(first, add_special=False)
    assert len(ids) == 1
    banned = client.completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                       logit_bias={str(ids[0]): -100}).choices[0].text
    assert banned != first


def test_paths_without_v1(server):
    status, _, body = server.request("POST", "/chat/completions", headers=AUTH, body={
        "messages": QUESTION, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["object"] == "chat.completion"
    # /completions without /v1 is llama-server's (tests/test_llama_server_api.py)
    status, _, body = server.request("POST", "/completions", headers=AUTH, body={
        "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["content"] and body["stop"] is True


def test_raw_stream_framing(server):
    """The SSE body as bytes: data lines only, usage chunk, then data: [DONE]."""
    status, headers, body = server.request("POST", "/v1/chat/completions", headers=AUTH, body={
        "messages": QUESTION, "max_tokens": 3, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


# --- prefill (Zero Wait) -------------------------------------------------------------------

def test_prefill_then_its_chat_reuses_what_it_ran(server, client):
    """The bitwise comparison with a fresh server is tests/test_prefill.py's; here the route
    on the real process: the key rule, the answer, the chat's cached tokens."""
    text = ("Here are my notes from the garden: the tomatoes ripened late this year, the "
            "beans did well, and the lettuce bolted in the July heat. What should I plant")
    body = {"messages": [{"role": "user", "content": text}]}
    assert server.request("POST", "/v1/prefill", body=body)[0] == 401
    status, _, answer = server.request("POST", "/v1/prefill", headers=AUTH, body=body)
    assert status == 200 and answer["object"] == "prefill", answer
    assert answer["cached_tokens"] >= 48 and answer["cached_tokens"] % 16 == 0
    done = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": text + " next spring?"}],
        max_tokens=4, temperature=0)
    assert done.usage.prompt_tokens_details.cached_tokens == answer["cached_tokens"]


# --- errors -------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MSG = {"messages": QUESTION}

BAD_REQUESTS = [
    (CHAT, {"messages": "hello"}, "messages", ""),
    (CHAT, {"messages": []}, "messages", ""),
    (CHAT, dict(MSG, temperature="hot"), "temperature", ""),
    (CHAT, dict(MSG, temperature=101), "temperature", ""),
    (CHAT, dict(MSG, temperature=-0.5), "temperature", ""),
    (CHAT, dict(MSG, logprobs=True, top_logprobs=21), "top_logprobs", ""),
    (CHAT, dict(MSG, top_logprobs=2), "top_logprobs", ""),
    (CHAT, dict(MSG, presence_penalty=2.5), "presence_penalty", ""),
    (CHAT, dict(MSG, frequency_penalty=-3), "frequency_penalty", ""),
    (CHAT, dict(MSG, max_tokens=0), "max_tokens", ""),
    (CHAT, dict(MSG, max_tokens=10**9), "max_tokens", ""),
    (CHAT, dict(MSG, max_completion_tokens="ten"), "max_completion_tokens", ""),
    (CHAT, dict(MSG, top_k=1.5), "top_k", ""),
    (CHAT, dict(MSG, top_p=2), "top_p", ""),
    (CHAT, dict(MSG, seed=-2), "seed", ""),
    (CHAT, dict(MSG, mirostat=3), "mirostat", ""),
    (CHAT, dict(MSG, stream="yes"), "stream", ""),
    (CHAT, dict(MSG, stop=[f"s{i}" for i in range(17)]), "stop", ""),
    (CHAT, dict(MSG, stop=5), "stop", ""),
    (CHAT, dict(MSG, logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", ""),
    (CHAT, dict(MSG, logit_bias={"": 1}), "logit_bias", ""),   # a text key, but empty
    (CHAT, dict(MSG, logit_bias={"5": 101}), "logit_bias", ""),
    (CHAT, dict(MSG, chat_template_kwargs=[1]), "chat_template_kwargs", ""),
    (CHAT, dict(MSG, n=17), "n", ""),
    (CHAT, dict(MSG, grammar='root ::= "yes" )'), "grammar", "line 1"),
    (CHAT, dict(MSG, grammar='root ::= "yes"\nx ::= [a-'), "grammar", "line 2"),
    (CHAT, dict(MSG, grammar='root ::= other'), "grammar", "other"),
    (CHAT, dict(MSG, grammar='root ::= ("a"{10000}){10000}'), "grammar", "too large"),
    (CHAT, dict(MSG, grammar=5), "grammar", ""),
    (CHAT, dict(MSG, response_format={"type": "xml"}), "response_format", ""),
    (CHAT, dict(MSG, response_format={"type": "json_schema"}), "response_format", ""),
    (CHAT, dict(MSG, response_format={"type": "json_schema", "json_schema": {
        "schema": {"type": "string", "pattern": "(?=a)b"}}}), "response_format", "pattern"),
    (CHAT, dict(MSG, response_format={"type": "json_object"}, grammar='root ::= "a"'),
     "response_format", "not grammar and response_format"),
    (CHAT, dict(MSG, tools={"name": "f"}), "tools", ""),
    (CHAT, dict(MSG, tools=[{"type": "function", "function": {}}]), "tools[0].function.name",
     ""),
    (CHAT, dict(MSG, tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="sometimes"), "tool_choice", ""),
    (CHAT, dict(MSG, tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "not among the tools"),
    (CHAT, dict(MSG, tool_choice="required"), "tool_choice", "needs tools"),
    (CHAT, dict(MSG, tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice", "cannot be combined with response_format"),
    (CHAT, dict(MSG, tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="required", grammar='root ::= "a"'),
     "tool_choice", "cannot be combined with grammar"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
     "messages[0].content[1]", "--mmproj"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "string or a list of content parts"),
    ("/v1/completions", {"prompt": 5}, "prompt", ""),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", ""),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs", ""),
    ("/v1/completions", {"prompt": [999999]}, "prompt", "vocabulary"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (_, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_field(server, path, body, param, words):
    status, _, answer = server.request("POST", path, headers=AUTH, body=body)
    assert status == 400, answer
    err = answer["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"] and err["message"]


def test_openai_client_sees_the_error_fields(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, temperature=150)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    assert "between 0 and 100" in e.value.message


def test_prompt_longer_than_context(server):
    long = " ".join(["word"] * (N_CTX + 10))
    status, _, body = server.request("POST", CHAT, headers=AUTH, body={
        "messages": [{"role": "user", "content": long}], "max_tokens": 2})
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"
    assert body["error"]["param"] == "messages" and str(N_CTX) in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/completions", headers=AUTH,
                                     body={"prompt": long, "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt"


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/rerank", "/v1/reranking", "/rerank"])
def test_endpoint_the_model_does_not_serve_names_the_right_one(server, path):
    status, _, body = server.request("POST", path, headers=AUTH, body={"input": "a cat"})
    assert status == 400
    assert "/v1/chat/completions" in body["error"]["message"]


def test_http_errors_in_openai_shape(server):
    status, _, body = server.request("GET", "/v1/nothing-here", headers=AUTH)
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, headers, body = server.request("GET", CHAT, headers=AUTH)
    assert status == 405 and "POST" in headers["allow"]
    assert body["error"]["type"] == "invalid_request_error"
    status, _, body = server.request("PUT", "/v1/models", headers=AUTH)
    assert status == 405
    status, _, body = server.request("POST", CHAT, headers=dict(AUTH, **{
        "Content-Type": "text/plain"}), body=json.dumps(MSG))
    assert status == 415 and "application/json" in body["error"]["message"]
    status, _, body = server.request("POST", CHAT, headers=AUTH, body=json.dumps(MSG))
    assert status == 415  # no Content-Type at all
    for bad in ('{"messages": [', "[1, 2]", '{"messages": NaN}', "\xff"):
        status, _, body = server.request("POST", CHAT, headers=dict(AUTH, **{
            "Content-Type": "application/json"}), body=bad.encode("latin1"))
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad


def test_body_size_is_bounded(server):
    with server.connect() as sock:
        sock.sendall(raw_request("POST", CHAT, dict(AUTH, **{
            "Content-Type": "application/json", "Content-Length": str(64 << 20)})))
        status, headers, body = split_response(read_until(sock, b"}}"))
    assert status == 413 and headers.get("connection") == "close"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


# --- security -----------------------------------------------------------------------------

def test_api_key_rules(server):
    for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("GET", "/models"),
                         ("GET", "/v1/unknown")):
        status, headers, body = server.request(method, path, body=MSG if method == "POST" else None)
        assert status == 401, path
        assert body["error"]["type"] == "authentication_error"
        assert headers["www-authenticate"] == "Bearer"
    assert server.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})[0] == 401
    assert server.request("GET", "/v1/models", headers={"Authorization": KEY})[0] == 401
    assert server.request("GET", "/v1/models", headers={"X-Api-Key": KEY})[0] == 200
    assert server.request("GET", "/v1/models", headers={"X-Api-Key": KEY + "x"})[0] == 401
    assert server.request("GET", "/v1/models", headers={"authorization": f"bearer {KEY}"})[0] == 200


def test_openai_client_with_a_wrong_key(server):
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_browser_origins_of_other_sites_are_refused(server):
    for origin in ("http://evil.example", "null", "https://localhost.evil.example",
                   "http://127.evil.example"):
        status, _, body = server.request("GET", "/v1/models", headers=dict(AUTH, Origin=origin))
        assert status == 403 and body["error"]["type"] == "permission_error", origin
    status, _, _ = server.request("POST", CHAT, body=MSG, headers=dict(
        AUTH, Origin="http://evil.example"))
    assert status == 403
    status, _, _ = server.request("GET", "/health", headers={"Origin": "http://evil.example"})
    assert status == 403
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "http://[::1]:8080"):
        status, _, _ = server.request("GET", "/v1/models", headers=dict(AUTH, Origin=origin))
        assert status == 200, origin


# --- a client that goes away --------------------------------------------------------------

@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_disconnect_mid_answer_frees_the_slot(server, stream):
    """Drop a long answer once it is being generated: the server cancels the request (its
    log says which, after how many tokens) and the slot is idle again."""
    cancelled = re.compile(r"(chatcmpl-[0-9a-f]+) cancelled after (\d+) tokens")
    seen = len(cancelled.findall(server.output()))
    max_tokens = N_CTX - 64
    body = json.dumps({"messages": QUESTION, "max_tokens": max_tokens, "temperature": 1.0,
                       "seed": 3, "ignore_eos": True, "stream": stream}).encode()
    sock = server.connect()
    sock.sendall(raw_request("POST", CHAT, dict(AUTH, **{
        "Content-Type": "application/json", "Content-Length": str(len(body))}), body))
    end = time.monotonic() + 120
    request_id = None
    if stream:  # past the role chunk (whose content is ""): a generated token's chunk
        first = read_until(sock, b'"delta":{"content":')
        request_id = re.search(rb'"id":"(chatcmpl-[0-9a-f]+)"', first).group(1).decode()
        assert server.request("GET", "/health")[2]["slots_processing"] >= 1
    else:
        while server.request("GET", "/health")[2]["slots_processing"] == 0:
            assert time.monotonic() < end, server.output()
            time.sleep(0.1)
    sock.close()

    while len(found := cancelled.findall(server.output())) == seen:
        assert time.monotonic() < end, server.output()
        time.sleep(0.2)
    (got_id, n_tokens), = found[seen:]
    assert request_id in (None, got_id)
    assert int(n_tokens) < max_tokens
    while server.request("GET", "/health")[2]["slots_processing"] != 0:
        assert time.monotonic() < end
        time.sleep(0.2)


def test_closed_connections_stop_counting(server):
    """More sequential connections than the limit (64): each one ends when its client
    closes it, so none is refused."""
    statuses = {server.request("GET", "/health")[0] for _ in range(80)}
    assert statuses == {200}


def test_header_names_are_written_as_llama_server_writes_them(server):
    """Title case on the wire (HTTP does not care; scripts that put headers in a plain dict
    look them up as llama-server spells them)."""
    with server.connect() as sock:
        sock.sendall(raw_request("OPTIONS", "/completion", {
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"}))
        head = read_until(sock, b"\r\n\r\n").decode("latin1")
    assert head.startswith("HTTP/1.1 200")
    for name in ("Access-Control-Allow-Origin", "Access-Control-Allow-Methods",
                 "Access-Control-Allow-Credentials", "Content-Type"):
        assert f"\r\n{name}: " in head, head
