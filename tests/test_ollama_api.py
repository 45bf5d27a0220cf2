"""Ollama's API (kinetic/api/dialects/ollama.py) in this process, driven by the official `ollama`
client through an httpx transport into the app: a tiny random-weight Qwen3 (Qwen3's template:
tools and thinking) for chat and generate, a tiny BERT for embed. Every route; streamed equal
to whole; options honoured (num_predict, seed, stop); format as "json" and as a schema; think;
logprobs; the refusals and the errors in Ollama's shape; the Origin rule; bodies of any content
type; --ollama's port. Tool calls from a real model, and the client over real HTTP, are
tests/test_ollama_server.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import socket
from contextlib import redirect_stderr
from pathlib import Path

import jsonschema
import numpy as np
import ollama
import pytest

from kinetic.api.core import ServerConfig, ServerState
from kinetic.model.gguf_file import GGUFFile
from kinetic.text.vocab import VOCAB_ONLY_KEYS
from tests.app_client import (N_CTX, AppClient, Transport, assert_ollama_error, in_process_app,
                              model_app)
from tests.embedding_models import write_bert

HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("ollama")) as a:
        yield a


@pytest.fixture(scope="module")
def client(app) -> ollama.Client:
    return ollama.Client(host="http://localhost", transport=Transport(app))


def post(app: AppClient, path: str, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, head, data = app.raw("POST", path, raw, headers or {})
    lines = [json.loads(line) for line in data.splitlines() if line.strip()]
    return status, head, lines[0] if len(lines) == 1 else lines


def model_file(app: AppClient) -> Path:
    return Path(app.app.extensions["kinetic"].model.loaded.file.path)


# --- the model routes ----------------------------------------------------------------------

def test_version(app):
    status, answer = app.get("/api/version")
    assert status == 200 and answer["version"].count(".") == 2, answer


def test_list_and_ps_name_the_one_model(app, client):
    path = model_file(app)
    (listed,) = client.list().models
    assert listed.model == "tiny-qwen3:latest"
    assert listed.size == path.stat().st_size
    assert listed.digest == hashlib.sha256(path.read_bytes()).hexdigest()
    assert listed.details.format == "gguf" and listed.details.family == "qwen3"
    assert listed.details.families == ["qwen3"]
    assert listed.details.quantization_level == "F32"
    assert listed.details.parameter_size.endswith("M")
    (running,) = client.ps().models
    assert running.model == listed.model and running.digest == listed.digest
    assert running.context_length == N_CTX and running.size_vram == 0
    assert running.size > 0 and running.expires_at.year > 2100


def test_show_reads_the_gguf(app, client):
    shown = client.show("anything")
    model = app.app.extensions["kinetic"].model
    assert shown.template == model.template_text and "<think>" in shown.template
    assert shown.capabilities == ["completion", "tools", "thinking"]
    assert shown.details.family == "qwen3"
    info = shown.modelinfo
    assert info["general.architecture"] == "qwen3"
    assert info["qwen3.context_length"] == model.loaded.file.metadata["qwen3.context_length"]
    assert info["general.parameter_count"] > 10**6
    assert info["tokenizer.ggml.tokens"] is None     # arrays only with verbose, as Ollama
    status, answer = app.post("/api/show", json.dumps({"model": "x", "verbose": True}).encode())
    assert status == 200 and len(answer["model_info"]["tokenizer.ggml.tokens"]) > 1000


def test_show_reads_again_the_arrays_the_model_let_go(app):
    """The loaded model keeps no merge lines, scores or token types (kinetic.llm.open_model
    drops them from its GGUFFile once the tokenizer is made, which keeps the merges as ranks
    and shares the file's token list), yet /api/show gives every key in the file's order,
    those arrays as the file has them with verbose and null without."""
    model = app.app.extensions["kinetic"].model
    gguf, vocab = model.loaded.file, model.tokenizer._v
    whole = GGUFFile(gguf.path).metadata
    merges = whole["tokenizer.ggml.merges"]
    assert len(merges) > 1000
    for key in VOCAB_ONLY_KEYS:
        assert key not in gguf.metadata
    assert vocab.ranks and not any(isinstance(v, list) and len(v) == len(merges)
                                   for v in (*vars(vocab).values(), *gguf.metadata.values()))
    assert vocab.tokens is gguf.metadata["tokenizer.ggml.tokens"]   # one list, not two

    keys = [k for k in whole if k != "tokenizer.chat_template"] + ["general.parameter_count"]
    status, answer = app.post("/api/show", json.dumps({"model": "x", "verbose": True}).encode())
    info = answer["model_info"]
    assert status == 200 and list(info) == keys
    assert info["tokenizer.ggml.merges"] == merges
    assert info["tokenizer.ggml.token_type"] == whole["tokenizer.ggml.token_type"].tolist()
    assert info["tokenizer.ggml.tokens"] == whole["tokenizer.ggml.tokens"]
    status, answer = app.post("/api/show", json.dumps({"model": "x"}).encode())
    info = answer["model_info"]
    assert status == 200 and list(info) == keys and info["tokenizer.ggml.merges"] is None
    assert "tokenizer.ggml.merges" not in gguf.metadata   # read for the answer, not kept


# --- chat and generate ---------------------------------------------------------------------

def test_chat_streamed_equals_whole(client):
    whole = client.chat("m", messages=HI, options=GREEDY, think=False)
    parts = list(client.chat("m", messages=HI, options=GREEDY, think=False, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert whole.message.role == "assistant" and whole.message.content
    last = parts[-1]
    for answer in (whole, last):
        assert answer.done and answer.done_reason == "length"
        assert answer.eval_count == GREEDY["num_predict"]
        assert answer.prompt_eval_count == whole.prompt_eval_count > 0
        assert answer.total_duration >= answer.eval_duration >= 0
        assert answer.prompt_eval_duration >= 0 and answer.load_duration == 0
        assert answer.model == "m" and answer.created_at


def test_generate_streamed_equals_whole_templated_and_raw(client):
    for raw in (False, True):
        whole = client.generate("m", "Once upon a time", raw=raw, options=GREEDY, think=False)
        parts = list(client.generate("m", "Once upon a time", raw=raw, options=GREEDY,
                                     think=False, stream=True))
        assert "".join(p.response for p in parts) == whole.response and whole.response
        assert parts[-1].done and parts[-1].eval_count == whole.eval_count == 6
    templated = client.generate("m", "Once upon a time", options=GREEDY, think=False)
    bare = client.generate("m", "Once upon a time", raw=True, options=GREEDY)
    # the template wraps the prompt in a user turn; raw sends it as it is
    assert templated.prompt_eval_count > bare.prompt_eval_count


def test_generate_system_is_part_of_the_prompt(client):
    plain = client.generate("m", "hi", options=GREEDY, think=False)
    with_system = client.generate("m", "hi", system="You are terse.", options=GREEDY,
                                  think=False)
    assert with_system.prompt_eval_count > plain.prompt_eval_count


def test_num_predict_caps_eval_count(client):
    for n in (1, 3):
        answer = client.chat("m", messages=HI, options={"num_predict": n, "temperature": 0})
        assert answer.eval_count == n and answer.done_reason == "length"


def test_seed_repeats_a_sampled_answer(client):
    opts = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 7,
            "num_predict": 8}
    first = client.generate("m", "hello", raw=True, options=opts)
    again = client.generate("m", "hello", raw=True, options=opts)
    assert first.response == again.response and first.eval_count == 8


def test_stop_stops(client):
    full = client.generate("m", "Once upon a time", raw=True,
                           options={"temperature": 0, "num_predict": 12}).response
    # a stop string from the middle of the answer: the answer ends just before it
    cut = next(i for i in range(2, len(full) - 1) if full[i:i + 2].strip())
    stop = full[cut:cut + 2]
    first = full.index(stop)
    answer = client.generate("m", "Once upon a time", raw=True,
                             options={"temperature": 0, "num_predict": 12, "stop": [stop]})
    assert answer.response == full[:first] and answer.done_reason == "stop"


def test_format_schema_and_json_validate(client):
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
              "required": ["color"], "additionalProperties": False}
    answer = client.chat("m", messages=HI, format=schema, think=False,
                         options={"temperature": 0, "num_predict": 60})
    assert answer.done_reason == "stop", answer
    jsonschema.validate(json.loads(answer.message.content), schema)
    streamed = "".join(p.message.content for p in client.chat(
        "m", messages=HI, format=schema, think=False, stream=True,
        options={"temperature": 0, "num_predict": 60}))
    assert streamed == answer.message.content
    # "json": the answer starts as a JSON object (random weights may not close it in time)
    answer = client.generate("m", "hi", format="json", think=False,
                             options={"temperature": 0, "num_predict": 4})
    assert answer.response.lstrip().startswith("{")


def test_think_switches_the_templates_thinking(client):
    """Qwen3's template: enable_thinking false writes an empty think block into the prompt."""
    on = client.generate("m", "hi", think=True, options=GREEDY)
    off = client.generate("m", "hi", think=False, options=GREEDY)
    high = client.generate("m", "hi", think="high", options=GREEDY)
    assert off.prompt_eval_count > on.prompt_eval_count == high.prompt_eval_count
    assert "thinking" in client.show("m").capabilities


def test_thinking_comes_back_apart_from_the_answer(client, monkeypatch):
    """Random weights write nonsense, so a GBNF grammar (not an Ollama field: slipped into the
    parsed fields) writes a reply that thinks first; Ollama's answer carries the thinking in
    message.thinking (generate: thinking), streamed and whole alike."""
    from kinetic.api.dialects import ollama as routes
    reply = 'root ::= "<think>\\nThe user says hi.\\n</think>\\n\\nHello there!"'
    fields = routes.sampling_fields
    monkeypatch.setattr(routes, "sampling_fields", lambda body: dict(fields(body), grammar=reply))
    opts = {"temperature": 0, "num_predict": 60}
    whole = client.chat("m", messages=HI, think=True, options=opts)
    assert whole.message.thinking == "The user says hi."
    assert whole.message.content == "Hello there!" and whole.done_reason == "stop"
    parts = list(client.chat("m", messages=HI, think=True, options=opts, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == whole.message.content
    answer = client.generate("m", "Hi!", think=True, options=opts)
    assert (answer.thinking, answer.response) == ("The user says hi.", "Hello there!")


def test_logprobs(app):
    body = {"model": "m", "prompt": "hi", "raw": True, "stream": False, "logprobs": True,
            "top_logprobs": 2, "options": GREEDY}
    status, _, whole = post(app, "/api/generate", body)
    assert status == 200 and len(whole["logprobs"]) == 6, whole
    for entry in whole["logprobs"]:
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"]
    status, _, lines = post(app, "/api/generate", dict(body, stream=True))
    streamed = [e for line in lines for e in line.get("logprobs", [])]
    assert streamed == whole["logprobs"]


def test_nothing_to_generate_is_a_load_answer(client):
    assert client.chat("m", messages=[]).done_reason == "load"
    answer = client.generate("m", "")
    assert answer.done and answer.done_reason == "load" and answer.response == ""
    assert client.generate("m", "", keep_alive=0).done_reason == "unload"


def test_ignored_options_are_accepted(client):
    opts = dict(GREEDY, num_ctx=8192, num_thread=3, num_gpu=99, use_mmap=False,
                some_option_kinetic_does_not_know=1)
    assert client.chat("m", messages=HI, options=opts, keep_alive="5m").eval_count == 6


def test_tool_results_are_read_back(client):
    """A tool call in the history (arguments as an object) and the tool's result, named by
    tool_name, reach the template: the prompt grows by them."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    history = HI + [{"role": "assistant", "content": "",
                     "tool_calls": [{"function": {"name": "get_weather",
                                                  "arguments": {"city": "Paris"}}}]},
                    {"role": "tool", "tool_name": "get_weather", "content": "22 C and sunny"}]
    short = client.chat("m", messages=HI, tools=tools, options=GREEDY, think=False)
    long = client.chat("m", messages=history, tools=tools, options=GREEDY, think=False)
    assert long.prompt_eval_count > short.prompt_eval_count


# --- refusals and errors -------------------------------------------------------------------

@pytest.mark.parametrize("path,body,words", [
    ("/api/generate", {"prompt": "hi"}, "model is required"),
    ("/api/chat", {"model": "", "messages": HI}, "model is required"),
    ("/api/generate", {"model": "m", "prompt": "hi", "suffix": "end"}, "suffix"),
    ("/api/generate", {"model": "m", "prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"model": "m", "prompt": "hi", "context": [1, 2, 3]}, "context"),
    ("/api/generate", {"model": "m", "prompt": "hi", "images": ["aGk="]}, "vision model"),
    ("/api/chat", {"model": "m", "messages": [{"role": "user", "content": "hi",
                                                "images": ["aGk="]}]}, "messages[0].images"),
    ("/api/chat", {"model": "m", "messages": HI, "options": {"temperature": "hot"}},
     "options.temperature"),
    ("/api/chat", {"model": "m", "messages": HI, "options": {"num_predict": 0}},
     "options.num_predict"),
    ("/api/chat", {"model": "m", "messages": HI, "options": [1]}, "options must be an object"),
    ("/api/chat", {"model": "m", "messages": HI, "format": "yaml"}, "format"),
    ("/api/chat", {"model": "m", "messages": HI, "format": {"type": "strnig"}}, "format"),
    ("/api/chat", {"model": "m", "messages": HI, "think": "very"}, "think must be"),
    ("/api/chat", {"model": "m", "messages": "hi"}, "messages"),
    ("/api/chat", {"model": "m", "messages": [{"content": "hi"}]}, "role"),
    ("/api/chat", {"model": "m", "messages": HI, "stream": "yes"}, "stream"),
    ("/api/generate", {"model": "m", "prompt": 5}, "prompt must be a string"),
    ("/api/embed", {"model": "m", "input": "hi"}, "does not support embeddings"),
    ("/api/embeddings", {"model": "m", "prompt": "hi"}, "does not support embeddings"),
    ("/api/chat", b"{", "not valid JSON"),
    ("/api/generate", {"model": "m", "prompt": " ".join(["word"] * (N_CTX + 20)),
                       "truncate": False}, "context size"),
    ("/api/generate", {"model": "m", "prompt": "hi", "options": {"num_ctx": 0}},
     "options.num_ctx"),
    ("/api/generate", {"model": "m", "prompt": "hi", "options": {"num_ctx": 1.5}},
     "options.num_ctx"),
    ("/api/generate", {"model": "m", "prompt": "hi", "options": {"num_keep": -1}},
     "options.num_keep"),
    ("/api/generate", {"model": "m", "prompt": "hi", "truncate": "no"}, "truncate"),
])
def test_refusals_are_400_in_ollamas_shape(app, path, body, words):
    status, _, answer = post(app, path, body)
    message = assert_ollama_error(status, answer, f"{path} {body!r:.200}")
    assert status == 400 and words in message, message


def test_num_ctx_is_this_requests_context(app, client):
    """options.num_ctx bounds one request's context within the server's: a prompt past it is
    cut to its first num_keep tokens and its newest ones (Ollama's truncation, by default),
    leaving room for num_predict, and the answer stops at that context."""
    words = " ".join(f"w{i}" for i in range(60))
    whole = client.generate("m", words, raw=True, options=GREEDY)
    assert whole.prompt_eval_count > 40
    cut = client.generate("m", words, raw=True, options=dict(GREEDY, num_ctx=32))
    assert cut.prompt_eval_count == 32 - 6 and cut.eval_count == 6
    assert N_CTX > 64   # the server's own context holds the whole prompt
    short = client.generate("m", words, raw=True, options=dict(GREEDY, num_ctx=32, num_keep=0))
    assert short.prompt_eval_count == 26
    # num_predict past half the context: the cut leaves half for the answer, which stops at
    # the context ("length")
    long = client.generate("m", words, raw=True, options={"temperature": 0, "num_predict": 100,
                                                           "num_ctx": 24})
    assert long.prompt_eval_count == 12 and long.eval_count == 12
    assert long.done_reason == "length"
    status, _, answer = post(app, "/api/generate", {"model": "m", "prompt": words, "raw": True,
                                                    "options": dict(GREEDY, num_ctx=32),
                                                    "truncate": False, "stream": False})
    assert status == 400 and "context" in assert_ollama_error(status, answer, "truncate")


def test_the_cut_keeps_the_first_and_the_newest_tokens():
    from kinetic.api.dialects.ollama import fit_context
    prompt = list(range(100))
    got, limit = fit_context({"options": {"num_ctx": 20}}, prompt, 5, 1000, "prompt")
    assert got == [0, 1, 2, 3] + list(range(89, 100)) and limit == 5
    got, limit = fit_context({"options": {"num_ctx": 20, "num_keep": 0}}, prompt, None, 1000,
                             "prompt")
    assert got == list(range(90, 100)) and limit == 10
    got, limit = fit_context({}, list(range(10)), None, 1000, "prompt")   # fits: as it is
    assert got == list(range(10)) and limit == 990
    got, limit = fit_context({"options": {"num_ctx": 5000}}, prompt, 7, 1000, "prompt")
    assert got == prompt and limit == 7   # the server's context bounds num_ctx


def test_client_raises_response_error(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate("m", "hi", suffix="end")
    assert e.value.status_code == 400 and "suffix" in e.value.error


def test_router_errors_are_in_ollamas_shape(app):
    status, _, answer = app.request("GET", "/api/chat")
    assert status == 405 and "POST" in assert_ollama_error(status, answer)
    status, _, answer = app.request("POST", "/api/pull", b'{"model": "x"}')
    assert status == 404 and assert_ollama_error(status, answer)
    # the OpenAI routes keep theirs
    status, _, answer = app.request("GET", "/v1/chat/completions")
    assert status == 405 and set(answer["error"]) >= {"message", "type"}


def test_loading_is_503_in_ollamas_shape():
    from kinetic.api.app import create_app
    client = AppClient(create_app(ServerState(ServerConfig(), "none")))
    try:
        status, _, answer = client.request("POST", "/api/chat", b'{"model": "m"}')
        assert status == 503 and answer == {"error": "Loading model"}
    finally:
        client.close()


def test_any_content_type_is_read_as_json(app):
    body = json.dumps({"model": "m", "prompt": "hi", "stream": False, "options": GREEDY})
    for kind in ("application/x-www-form-urlencoded", "text/plain", ""):
        status, _, answer = post(app, "/api/generate", body.encode(), {"Content-Type": kind})
        assert status == 200 and answer["done"], (kind, answer)


def test_other_sites_pages_are_refused(app):
    body = {"model": "m", "prompt": "hi", "stream": False, "options": GREEDY}
    status, _, answer = post(app, "/api/generate", body, {"Origin": "https://evil.example"})
    assert status == 403 and "evil.example" in assert_ollama_error(status, answer)
    status, head, answer = post(app, "/api/generate", body, {"Origin": "http://localhost:3000"})
    assert status == 200 and head["Access-Control-Allow-Origin"] == "http://localhost:3000"


def test_streamed_answers_are_ndjson(app):
    status, head, data = app.raw("POST", "/api/chat", json.dumps(
        {"model": "m", "messages": HI, "options": GREEDY}).encode())
    assert status == 200 and head["Content-Type"] == "application/x-ndjson"
    lines = data.decode().splitlines()
    assert len(lines) >= 2 and all(json.loads(line)["model"] == "m" for line in lines)


# --- embeddings ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = write_bert(tmp_path_factory.mktemp("ollama-embed") / "tiny-bert.gguf",
                      pooling="mean")
    with model_app(path) as a:
        yield a, ollama.Client(host="http://localhost", transport=Transport(a))


def test_embed_is_normalized_and_matches_the_model(bert):
    app, client = bert
    model = app.app.extensions["kinetic"].model
    answer = client.embed("bert", input=["a cat", "a dog"])
    got = np.array(answer.embeddings, np.float32)
    want = np.asarray(model.embed(["a cat", "a dog"]), np.float32)
    assert got.shape == want.shape and np.allclose(got, want, atol=1e-6)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert answer.prompt_eval_count == sum(len(model.input_ids(t)) for t in ("a cat", "a dog"))
    assert client.embed("bert", input="a cat").embeddings[0] == answer.embeddings[0]
    cut = np.array(client.embed("bert", input="a cat", dimensions=8).embeddings[0])
    assert cut.shape == (8,) and np.isclose(np.linalg.norm(cut), 1, atol=1e-5)
    assert np.allclose(cut, want[0, :8] / np.linalg.norm(want[0, :8]), atol=1e-5)
    assert client.embed("bert", input=[]).embeddings == []


def test_old_embeddings_route_is_the_pooled_vector(bert):
    app, client = bert
    model = app.app.extensions["kinetic"].model
    got = np.array(client.embeddings("bert", prompt="a cat").embedding, np.float32)
    want = np.asarray(model.embed("a cat", normalize_kind=-1), np.float32).reshape(-1)
    assert np.allclose(got, want, atol=1e-5)
    assert client.embeddings("bert", prompt="").embedding == []


def test_embed_refusals(bert):
    app, _ = bert
    long = " ".join(["word"] * 2000)
    for body, words in (({"model": "b", "input": long, "truncate": False}, "too large"),
                        ({"model": "b", "input": "hi", "dimensions": 100000}, "dimensions"),
                        ({"model": "b", "input": 5}, "input"),
                        ({"model": "b", "messages": HI}, "does not support chat")):
        path = "/api/chat" if "messages" in body else "/api/embed"
        status, _, answer = post(app, path, body)
        assert status == 400 and words in assert_ollama_error(status, answer), answer
    status, _, answer = post(app, "/api/embed", {"model": "b", "input": long})
    assert status == 200 and len(answer["embeddings"]) == 1   # truncated, as Ollama does


# --- --ollama's port -----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ollama_listens_on_its_port_too(monkeypatch):
    from hypercorn.config import Config
    from kinetic.api import listener as server
    monkeypatch.setattr(server, "OLLAMA_PORT", _free_port())
    sockets = server._listen(Config(), "127.0.0.1", ServerConfig(port=0, ollama=True))
    try:
        ports = [s.getsockname()[1] for s in sockets.insecure_sockets]
        assert len(ports) == 2 and ports[1] == server.OLLAMA_PORT
    finally:
        for s in sockets.insecure_sockets:
            s.close()
    only = server._listen(Config(), "127.0.0.1",
                          ServerConfig(port=server.OLLAMA_PORT, ollama=True))
    assert [s.getsockname()[1] for s in only.insecure_sockets] == [server.OLLAMA_PORT]
    for s in only.insecure_sockets:
        s.close()


def test_a_taken_ollama_port_is_one_line(monkeypatch):
    from hypercorn.config import Config
    from kinetic.api import listener as server
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(server, "OLLAMA_PORT", taken.getsockname()[1])
        err = io.StringIO()
        with redirect_stderr(err):
            assert server._listen(Config(), "127.0.0.1",
                                  ServerConfig(port=0, ollama=True)) is None
    (line,) = err.getvalue().splitlines()
    assert line.startswith("kinetic: cannot listen on 127.0.0.1:") and "Ollama's port" in line
