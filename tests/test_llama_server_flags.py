"""llama-server's flags and the routes they switch, as a llama-server script uses them:
the flags' mapping (no model loaded), then the routes over a tiny model in this process
(/v1/models names, /props defaults, --n-predict, --no-slots, slot save/restore/erase,
/apply-template)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from kinetic.api.core import ServerConfig
from kinetic.cli import build_parser
from kinetic.serve_cli import IGNORED_FLAGS, serve_options
from tests.app_client import assert_error_shape, model_app
from tests.tiny_models import DATA, write_tiny_model

N_CTX = 256


@pytest.fixture(autouse=True)
def model_files(tmp_path, monkeypatch):
    """m.gguf and x.gguf in the working directory: serve resolves its model at start, and
    refuses a file that does not exist."""
    monkeypatch.chdir(tmp_path)
    for name in ("m.gguf", "x.gguf"):
        (tmp_path / name).write_bytes(b"")


def options(*argv: str):
    return serve_options(build_parser().parse_args(["serve", "m.gguf", *argv]))


# --- the flags ----------------------------------------------------------------------------

def test_context_counts_as_llama_server_does():
    # with -np N, -c is the total of the N slots; with the automatic -np, each slot's
    assert options("-c", "1024", "-np", "2")[1].engine.n_ctx == 512
    assert options("-c", "1024")[1].engine.n_ctx == 1024
    assert options()[1].engine.n_ctx == 4096


def test_model_can_be_given_with_dash_m():
    args = build_parser().parse_args(["serve", "-m", "x.gguf"])
    assert serve_options(args)[1].path == "x.gguf"
    with pytest.raises(SystemExit, match="which model"):
        serve_options(build_parser().parse_args(["serve"]))
    with pytest.raises(SystemExit, match="once"):
        serve_options(build_parser().parse_args(["serve", "a.gguf", "-m", "b.gguf"]))


def test_sampling_defaults_seed_and_limits():
    config, model = options("--seed", "42", "--temp", "0.5", "--top-k", "7", "-n", "64",
                            "--alias", "tiny-a, tiny-b", "--tags", "t1,t2", "--no-slots")
    assert model.sampling == {"seed": 42, "temperature": 0.5, "top_k": 7}
    assert config.n_predict == 64 and not config.slots_endpoint
    assert config.aliases == ("tiny-a", "tiny-b") and config.tags == ("t1", "t2")
    assert options("--seed", "-1")[1].sampling == {}   # -1: a fresh seed per request


@pytest.mark.parametrize("argv,words", [
    (["--context-shift"], "never shifts"),
    (["--seed", str(1 << 32)], "--seed"),
    (["--top-p", "2"], "top_p"),
    (["--chat-template", "monarch"], "nor a format kinetic knows"),
    (["--chat-template", "{% for m in messages %}"], "cannot be used"),
    (["--chat-template-file", "/no/such/template.jinja"], "No such file"),
    (["--slot-save-path", "/no/such/dir"], "not a directory"),
])
def test_refused_flags_say_why(argv, words):
    with pytest.raises(SystemExit, match=words):
        options(*argv)


@pytest.mark.parametrize("argv", [["-n", "0"], ["-n", "-2"], ["--alias", "a,,b"]])
def test_bad_values_are_errors(argv):
    with pytest.raises(ValueError):
        options(*argv)


def test_every_ignored_flag_is_accepted_and_documented():
    parser = build_parser()
    for names, value, why in IGNORED_FLAGS:
        for name in names:
            serve_options(parser.parse_args(["serve", "m.gguf", name, *(["1"] if value else [])]))
        assert why
    serve = parser._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for names, _, _ in IGNORED_FLAGS:
        assert names[0] in text
    assert text.count("accepted and ignored") >= len(IGNORED_FLAGS)


def test_chat_template_by_name():
    from kinetic.text.builtin_templates import BUILTIN
    assert options("--chat-template", "command-r")[1].chat_template == BUILTIN["command-r"]
    assert options("--chat-template", "chatml")[1].chat_template == "chatml"


def test_chat_template_from_a_file(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert options("--chat-template-file", str(f))[1].chat_template == f.read_text()


# --- the routes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    return write_tiny_model(tmp_path_factory.mktemp("flags") / "tiny-qwen3.gguf", "qwen3",
                            context_length=N_CTX, chat_template=template)


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("slot-saves")


@pytest.fixture(scope="module")
def app(tiny_path, saves):
    config = ServerConfig(aliases=("tiny-a", "tiny-b"), tags=("t1",), n_predict=3,
                          slot_save_path=str(saves), verbose=True)
    with model_app(tiny_path, server_config=config, n_ctx=N_CTX, parallel=2) as client:
        client.app.extensions["kinetic"].model.default_params = \
            client.app.extensions["kinetic"].model.default_params.__class__(seed=42,
                                                                            temperature=0.0)
        yield client


def test_models_show_aliases_and_tags(app):
    status, body = app.get("/v1/models")
    assert status == 200
    m = body["data"][0]
    assert (m["id"], m["aliases"], m["tags"]) == ("tiny-a", ["tiny-a", "tiny-b"], ["t1"])
    props = app.get("/props")[1]   # the tiny file has no general.file_type: ""
    assert props["model_ftype"] == "" and props["is_sleeping"] is False
    assert app.get("/v1/models/tiny-b")[0] == 200
    status, body = app.post("/v1/completions", json.dumps(
        {"prompt": "hi", "max_tokens": 1}).encode())
    assert status == 200 and body["model"] == "tiny-a"


def test_props_show_the_server_defaults(app):
    status, body = app.get("/props")
    assert status == 200
    params = body["default_generation_settings"]["params"]
    assert params["seed"] == 42 and params["n_predict"] == 3
    assert body["default_generation_settings"]["n_ctx"] == N_CTX
    assert body["model_alias"] == "tiny-a" and body["endpoint_slots"] is True
    assert body["ui"] is True


def test_n_predict_is_the_default_not_a_cap(app):
    ban_eos = {"ignore_eos": True, "temperature": 0}
    for body, most in (({"prompt": "hi"}, 3), ({"prompt": "hi", "max_tokens": 5}, 5),
                       ({"prompt": "hi", "max_tokens": 2}, 2)):
        status, answer = app.post("/v1/completions", json.dumps(dict(body, **ban_eos)).encode())
        assert status == 200 and answer["usage"]["completion_tokens"] == most, body


def test_verbose_logs_each_request(app, caplog):
    with caplog.at_level(logging.INFO, logger="kinetic.server"):
        app.get("/health")
    assert any("GET /health -> 200" in r.getMessage() for r in caplog.records)


def test_apply_template_renders_what_a_chat_completion_runs(app):
    messages = [{"role": "user", "content": "hello there"}]
    status, body = app.post("/apply-template", json.dumps({"messages": messages}).encode())
    assert status == 200
    model = app.app.extensions["kinetic"].model
    assert body["prompt"] == model.apply_chat_template(messages)
    status, body = app.post("/apply-template", b'{"messages": "nope"}')
    assert_error_shape(status, body)


def _completion(app, prompt: str) -> dict:
    status, body = app.post("/completion", json.dumps(
        {"prompt": prompt, "n_predict": 2, "temperature": 0}).encode())
    assert status == 200, body
    return body


def test_slot_save_restore_erase(app, saves):
    prompt = "the quick brown fox jumps over the lazy dog " * 6
    first = _completion(app, prompt)
    slot = first["id_slot"]
    status, saved = app.post(f"/slots/{slot}?action=save", b'{"filename": "one.bin"}')
    assert status == 200, saved
    ids = app.app.extensions["kinetic"].model.prompt_ids(prompt)
    assert saved["n_saved"] >= len(ids) and saved["n_written"] == (saves / "one.bin").stat().st_size
    # erase: the prompt's pages leave the cache, so the same prompt runs in full again
    status, erased = app.post(f"/slots/{slot}?action=erase", b"")
    assert status == 200 and erased["n_erased"] >= 16
    assert _completion(app, prompt)["timings"]["cache_n"] == 0
    app.post(f"/slots/{slot}?action=erase", b"")
    # restore: recomputed into the cache, so the prompt's whole pages are found again
    status, restored = app.post("/slots/0?action=restore", b'{"filename": "one.bin"}')
    assert status == 200 and restored["n_restored"] == saved["n_saved"]
    again = _completion(app, prompt)
    assert again["timings"]["cache_n"] >= 16
    assert again["content"] == first["content"]


@pytest.mark.parametrize("path,body,status", [
    ("/slots/0?action=save", b'{"filename": "../x"}', 400),
    ("/slots/0?action=save", b'{"filename": ".hidden"}', 400),
    ("/slots/0?action=save", b'{}', 400),
    ("/slots/0?action=restore", b'{"filename": "missing.bin"}', 400),
    ("/slots/9?action=erase", b"", 400),
    ("/slots/0?action=dance", b"", 400),
])
def test_slot_actions_refuse_bad_requests(app, path, body, status):
    got, answer = app.post(path, body)
    assert got == status
    assert_error_shape(got, answer, path)


def test_restore_refuses_a_file_it_did_not_write(app, saves):
    (saves / "alien.bin").write_bytes(b"\x00GGUF not a slot")
    status, body = app.post("/slots/0?action=restore", b'{"filename": "alien.bin"}')
    assert status == 400 and "not a slot file" in body["error"]["message"]


def _saved_slot(app) -> int:
    return _completion(app, "a prompt to save")["id_slot"]


def test_save_never_writes_through_a_symbolic_link(app, saves, tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    (saves / "link.bin").symlink_to(outside)
    slot = _saved_slot(app)
    status, body = app.post(f"/slots/{slot}?action=save", b'{"filename": "link.bin"}')
    assert status == 400 and "symbolic link" in body["error"]["message"]
    assert_error_shape(status, body)
    status, body = app.post("/slots/0?action=restore", b'{"filename": "link.bin"}')
    assert status == 400 and "symbolic link" in body["error"]["message"]
    assert outside.read_text() == "precious" and (saves / "link.bin").is_symlink()


def test_save_and_restore_refuse_a_folder_a_fifo_and_a_hard_link(app, saves, tmp_path):
    (saves / "folder.bin").mkdir()
    os.mkfifo(saves / "fifo.bin")
    outside = tmp_path / "linked.txt"
    outside.write_text("precious")
    os.link(outside, saves / "hard.bin")
    slot = _saved_slot(app)
    for name in ("folder.bin", "fifo.bin", "hard.bin"):
        for action in ("save", "restore"):   # a FIFO must not block the restore either
            status, body = app.post(f"/slots/{slot}?action={action}",
                                    json.dumps({"filename": name}).encode())
            assert status == 400 and name in body["error"]["message"], (name, action, body)
            assert str(saves) not in body["error"]["message"]
    assert outside.read_text() == "precious"


def test_save_replaces_a_plain_file_whole(app, saves):
    (saves / "again.bin").write_bytes(b"old contents")
    slot = _saved_slot(app)
    status, body = app.post(f"/slots/{slot}?action=save", b'{"filename": "again.bin"}')
    assert status == 200, body
    assert json.loads((saves / "again.bin").read_bytes())["format"] == "kinetic-slot-cache"
    assert not [p for p in saves.iterdir() if p.name.endswith(".tmp")]


def test_restore_refuses_a_deep_file_without_a_recursion_error(app, saves):
    (saves / "deep.bin").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    status, body = app.post("/slots/0?action=restore", b'{"filename": "deep.bin"}')
    assert status == 400 and "not a slot file" in body["error"]["message"]


def test_no_slots_and_no_save_path_answer_501(tiny_path):
    config = ServerConfig(slots_endpoint=False)
    with model_app(tiny_path, server_config=config, n_ctx=N_CTX, parallel=1) as client:
        status, body = client.get("/slots")
        assert status == 501 and body["error"]["type"] == "not_supported_error"
        status, body = client.post("/slots/0?action=save", b'{"filename": "a.bin"}')
        assert status == 501 and "`--slot-save-path`" in body["error"]["message"]
        assert client.get("/props")[1]["endpoint_slots"] is False


# --- resumable streams (X-Conversation-Id) -----------------------------------------------

def _stream(app, path: str, body: dict, headers: dict) -> bytes:
    import asyncio

    async def send():
        resp = await app.client.post(path, json=body, headers=headers)
        return resp.status_code, await resp.get_data()
    status, data = asyncio.run_coroutine_threadsafe(send(), app.loop).result(60)
    assert status == 200, data
    return data


def _request(app, method: str, path: str):
    import asyncio

    async def send():
        resp = await app.client.open(path, method=method)
        return resp.status_code, await resp.get_data()
    return asyncio.run_coroutine_threadsafe(send(), app.loop).result(60)


def test_a_recorded_stream_replays_from_any_byte_and_stops(app):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": True, "temperature": 0}
    live = _stream(app, "/v1/chat/completions", body, {"X-Conversation-Id": "c/1:x"})
    assert live.endswith(b"data: [DONE]\n\n")
    status, replay = _request(app, "GET", "/v1/stream?conv_id=c%2F1%3Ax&from=0")
    assert status == 200 and replay == live
    status, tail = _request(app, "GET", "/v1/stream?conv_id=c%2F1%3Ax&from=3")
    assert status == 200 and tail == live[3:]
    assert _request(app, "DELETE", "/v1/stream?conv_id=c%2F1%3Ax")[0] == 204
    assert _request(app, "GET", "/v1/stream?conv_id=c%2F1%3Ax&from=0")[0] == 404
    assert _request(app, "DELETE", "/v1/stream?conv_id=never")[0] == 204


def test_only_streams_with_an_id_are_recorded(app):
    _stream(app, "/completion", {"prompt": "hi", "n_predict": 2, "stream": True}, {})
    app.post("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 1}).encode())
    assert _request(app, "GET", "/v1/stream?conv_id=&from=0")[0] == 400
    status, body = _request(app, "GET", "/v1/stream?conv_id=c9&from=-1")
    assert status == 400


def test_a_conversation_id_is_bounded(app):
    import asyncio

    async def send():
        resp = await app.client.post("/completion", json={"prompt": "hi", "stream": True},
                                     headers={"X-Conversation-Id": "x" * 300})
        return resp.status_code, await resp.get_data()
    status, data = asyncio.run_coroutine_threadsafe(send(), app.loop).result(60)
    assert_error_shape(status, json.loads(data))


def test_the_store_runs_a_stream_without_its_reader_and_stops_it():
    import asyncio

    from kinetic.api import stream_store

    async def main():
        closed = asyncio.Event()
        release = asyncio.Event()

        async def events():
            try:
                yield "data: 1\n\n"
                await release.wait()     # a generation that goes on after its reader left
                yield "data: 2\n\n"
                await asyncio.Event().wait()
            finally:
                closed.set()

        store = stream_store.StreamStore()
        session = store.record("c", events())
        reader = session.read(0)
        assert await reader.__anext__() == b"data: 1\n\n"
        await reader.aclose()            # the client goes away
        release.set()
        later = session.read(9)          # a reader that resumes after the first event
        assert await later.__anext__() == b"data: 2\n\n"
        await later.aclose()
        assert bytes(session.data) == b"data: 1\n\ndata: 2\n\n" and not closed.is_set()
        assert store.stop("c") and store.get("c") is None
        await asyncio.wait_for(closed.wait(), 5)   # stopping closed the generation
        assert not store.stop("c")
    asyncio.run(main())


def test_the_store_refuses_past_its_running_sessions(monkeypatch):
    import asyncio

    from kinetic.api import stream_store
    monkeypatch.setattr(stream_store, "MAX_SESSIONS", 2)

    async def forever():
        yield "data: x\n\n"
        await asyncio.Event().wait()

    async def main():
        store = stream_store.StreamStore()
        store.record("a", forever())
        store.record("b", forever())
        with pytest.raises(LookupError):
            store.record("c", forever())
        store.stop("a")
        store.record("c", forever())
        for k in ("b", "c"):
            store.stop(k)
    asyncio.run(main())


# --- the web page -------------------------------------------------------------------------

@pytest.mark.parametrize("path,kind", [("/", "text/html"), ("/index.html", "text/html"),
                                       ("/bundle.js", "text/javascript"),
                                       ("/markdown.js", "text/javascript"),
                                       ("/bundle.css", "text/css"),
                                       ("/favicon.ico", "image/x-icon")])
def test_the_web_page_is_served_without_a_key(tiny_path, path, kind):
    import asyncio
    config = ServerConfig(api_keys=("secret",))
    with model_app(tiny_path, server_config=config, n_ctx=N_CTX, parallel=1) as client:
        async def send():
            resp = await client.client.get(path)
            return resp.status_code, resp.mimetype, await resp.get_data()
        status, mimetype, data = asyncio.run_coroutine_threadsafe(send(), client.loop).result(60)
        assert status == 200 and mimetype == kind
        if kind == "text/html":
            assert data.lower().startswith(b"<!doctype html>") and b"bundle.js" in data
            assert b"markdown.js" in data and b"favicon.ico" in data
        if kind == "image/x-icon":   # an ICO holding one 16 x 16 PNG
            assert data[:6] == b"\x00\x00\x01\x00\x01\x00" and data[22:26] == b"\x89PNG"
        assert client.get("/v1/models")[0] == 401   # the API still needs the key


def test_no_webui_turns_the_page_off(tiny_path):
    config = ServerConfig(webui=False)
    with model_app(tiny_path, server_config=config, n_ctx=N_CTX, parallel=1) as client:
        for path in ("/", "/bundle.js"):
            status, body = client.get(path)
            assert status == 404 and "--no-webui" in body["error"]["message"]


def test_fail_on_no_slot_answers_503_only_when_every_slot_is_busy(app):
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    from tests.mock_model import Collector, Gate
    status, body = app.get("/slots?fail_on_no_slot=0")   # idle: the list, whatever the value
    assert status == 200 and len(body) == 2
    engine = app.app.extensions["kinetic"].model.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    first, gate = Collector(), Gate(at=2)
    ids = [engine.start(GenerationRequest([5, 6, 7], params, 60, speculative=False), sink)
           for sink in (first, gate)]
    gate.wait_reached()   # held in the second's second token: the first (60 tokens) runs too
    try:
        status, body = app.get("/slots?fail_on_no_slot=0")
        assert status == 503 and body["error"]["message"] == "no slot available"
        assert app.get("/slots")[0] == 200
    finally:
        for i in ids:
            engine.cancel(i)
        gate.release()
        first.wait()


def test_openai_routes_take_llama_servers_n_predict(app):
    status, body = app.post("/v1/completions", json.dumps(
        {"prompt": "hi", "n_predict": 2, "temperature": 0}).encode())
    assert status == 200 and body["usage"]["completion_tokens"] <= 2
    status, body = app.post("/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "n_predict": 0}).encode())
    assert_error_shape(status, body)
    assert body["error"]["param"] == "n_predict"


def _events(data: bytes) -> list:
    return [json.loads(line[6:]) for line in data.decode().split("\n")
            if line.startswith("data: {")]


def test_openai_answers_carry_llama_servers_timings(app):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}
    status, whole = app.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and whole["timings"]["predicted_n"] == \
        whole["usage"]["completion_tokens"]
    stream = dict(body, stream=True, stream_options={"include_usage": True})
    plain = _events(_stream(app, "/v1/chat/completions", stream, {}))
    assert [("timings" in e) for e in plain] == [False] * (len(plain) - 1) + [True]
    assert plain[-1]["choices"] == [] and plain[-1]["timings"]["predicted_n"] <= 4
    each = _events(_stream(app, "/v1/chat/completions", dict(stream, timings_per_token=True),
                           {}))
    assert "timings" not in each[0] and all("timings" in e for e in each[1:])
    for key in ("prompt_per_second", "predicted_per_second", "predicted_n"):
        assert key in each[-1]["timings"]


def test_logit_bias_keys_may_be_text(app):
    """As llama-server: a text key biases each of its tokens (both shapes of logit_bias)."""
    model = app.app.extensions["kinetic"].model
    free = app.post("/completion", json.dumps({"prompt": "hi", "n_predict": 4,
                                               "temperature": 0, "return_tokens": True}).encode())
    first = free[1]["tokens"][0]
    text = model.tokenizer.decode([first])
    for bias in ([[text, -100]], {text: -100}):
        status, body = app.post("/completion", json.dumps(
            {"prompt": "hi", "n_predict": 4, "temperature": 0, "return_tokens": True,
             "logit_bias": bias}).encode())
        assert status == 200 and first not in body["tokens"][:1], bias
    status, body = app.post("/completion", json.dumps(
        {"prompt": "hi", "logit_bias": [["x" * 5000, -100]]}).encode())
    assert_error_shape(status, body)


def test_kv_unified_shares_one_pool_of_c_tokens():
    engine = options("-c", "256", "-np", "4", "--kv-unified")[1].engine
    assert engine.n_ctx == 256 and engine.num_pages == 256 // 16 + 1
    plain = options("-c", "256", "-np", "4")[1].engine
    assert plain.n_ctx == 64 and plain.num_pages == 0   # 0: every slot its own share


def test_kv_unified_runs_every_request_in_a_pool_smaller_than_their_sum(tiny_path):
    """Four answers that together need more pages than the pool holds all finish: a request
    that finds no room waits for pages, and its answer is the one it gives alone."""
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    from kinetic.llm import open_model
    from tests.mock_model import Collector
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    # -c 96 -np 4 --kv-unified: each slot may hold 96 tokens, 6 pages in all
    shared = open_model(tiny_path, EngineConfig(parallel=4, n_ctx=96,
                                                num_pages=96 // 16 + 1)).engine
    try:
        alone = [list(t for d in shared.generate(GenerationRequest([5 + i], params, 40))
                      for t in d.token_ids) for i in range(4)]
        sinks = [Collector() for _ in range(4)]
        for i, sink in enumerate(sinks):
            shared.start(GenerationRequest([5 + i], params, 40), sink)
        together = [sink.wait().tokens for sink in sinks]
        assert together == alone
    finally:
        shared.close()


def test_erase_drops_a_short_prompts_partly_filled_page(app):
    """A prompt shorter than a page is cached only as a partly filled page: erase drops it."""
    first = _completion(app, "hello there")
    again = _completion(app, "hello there")
    assert again["timings"]["cache_n"] > 0
    status, erased = app.post(f"/slots/{again['id_slot']}?action=erase", b"")
    assert status == 200 and erased["n_erased"] > 0
    after = _completion(app, "hello there")
    assert after["timings"]["cache_n"] == 0 and after["content"] == first["content"]
