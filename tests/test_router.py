"""Router mode (kinetic/router/): `kinetic serve --models-dir DIR --models-max 1` as a real
process over tiny models, each loaded in a worker process when a request names it.

Checked: the list and its statuses, routing by the body's `model` (and Ollama's `:latest`),
answers that are what the same model served alone gives, the least recently used model
unloaded past --models-max (its process gone), a model that fails to load failing only its
own requests, /models/load and /unload, Ollama's tags / ps / pull (a fake hub) / copy / delete
through the official client, the web page's model picker in a browser, and errors in each
API's shape."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ollama
import pytest

from tests import browser
from tests.browser import needs_browser
from tests.serve_process import free_port
from tests.test_pull import FakeHub
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["-c", "256", "-np", "1", "--draft-max", "0"]


class Router:
    def __init__(self, models_dir: Path, cache: Path, hub_url: str, *flags: str):
        self.port = free_port()
        self.log = models_dir.parent / "router.log"
        env = {**os.environ, "KINETIC_CACHE": str(cache), "HF_ENDPOINT": hub_url}
        for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            env.pop(var, None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kinetic.cli", "serve", "--models-dir", str(models_dir),
                 "--port", str(self.port), *flags], stdout=out, stderr=subprocess.STDOUT,
                cwd=ROOT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(self.log.read_text())

    def request(self, method: str, path: str, body=None) -> tuple[int, object]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw

    def statuses(self) -> dict[str, str]:
        return {m["id"]: m["status"]["value"] for m in self.request("GET", "/models")[1]["data"]}

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def hub():
    h = FakeHub()
    h.thread.start()
    yield h
    h.server.shutdown()
    h.server.server_close()


@pytest.fixture(scope="module")
def router(tmp_path_factory, hub):
    base = tmp_path_factory.mktemp("router")
    models = base / "models"
    models.mkdir()
    write_tiny_model(models / "alpha.gguf", "llama", qtype="Q4_0")
    write_tiny_model(models / "beta.gguf", "qwen2", qtype="Q8_0", seed=1)
    (models / "broken.gguf").write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 64)
    (models / "mmproj-alpha.gguf").write_bytes(b"GGUF")   # a projector: not a model
    r = Router(models, base / "cache", hub.url, "--models-max", "1", *FLAGS)
    yield r
    r.close()


CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}


def test_the_list_names_every_model_of_the_folder(router):
    assert router.statuses() == {"alpha": "unloaded", "beta": "unloaded",
                                 "broken": "unloaded"}
    status, body = router.request("POST", "/v1/chat/completions", CHAT)   # no model
    assert status == 400 and body["error"]["param"] == "model"
    assert "alpha" in body["error"]["message"]
    status, body = router.request("POST", "/v1/chat/completions", dict(CHAT, model="gamma"))
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_a_request_loads_its_model_and_gets_what_the_model_alone_gives(router):
    import kinetic
    status, body = router.request("POST", "/v1/chat/completions", dict(CHAT, model="alpha"))
    assert status == 200, body
    assert body["model"] == "alpha"
    assert router.statuses()["alpha"] == "loaded"
    path = Path(router.request("GET", "/v1/models/alpha")[1]["path"])
    alone = kinetic.load(str(path), n_ctx=256, parallel=1, speculative=False)
    try:
        want = "".join(alone.generate(CHAT["messages"], max_tokens=6, temperature=0))
    finally:
        alone.close()
    assert body["choices"][0]["message"]["content"] == want


def test_past_models_max_the_least_recently_used_is_unloaded(router):
    router.request("POST", "/v1/chat/completions", dict(CHAT, model="alpha"))
    status, body = router.request("POST", "/v1/completions",
                                  {"model": "beta", "prompt": "hi", "max_tokens": 3})
    assert status == 200, body
    assert router.statuses() == {"alpha": "unloaded", "beta": "loaded", "broken": "unloaded"}
    # streamed through the router as it comes
    status, raw = router.request("POST", "/v1/completions", {"model": "beta", "prompt": "hi",
                                                             "max_tokens": 3, "stream": True})
    assert status == 200 and raw.decode().strip().endswith("data: [DONE]")


def test_a_model_that_fails_to_load_fails_alone(router):
    status, body = router.request("POST", "/v1/chat/completions", dict(CHAT, model="broken"))
    assert status == 503 and "failed to load" in body["error"]["message"], body
    assert router.statuses()["broken"] == "failed"
    # asked again at once, it says so without a process of its own each time
    before = router.log.read_text().count("loading broken")
    assert before >= 1, router.log.read_text()[-2000:]
    for _ in range(3):
        again = router.request("POST", "/v1/chat/completions", dict(CHAT, model="broken"))
        assert again == (status, body)
    assert router.log.read_text().count("loading broken") == before
    status, body = router.request("POST", "/v1/chat/completions", dict(CHAT, model="beta"))
    assert status == 200, body


def test_load_and_unload_routes(router):
    status, body = router.request("POST", "/models/load", {"model": "alpha"})
    assert status == 200 and body["status"] == "loaded"
    assert router.statuses()["alpha"] == "loaded"
    status, body = router.request("POST", "/models/unload", {"model": "alpha"})
    assert status == 200 and router.statuses()["alpha"] == "unloaded"
    status, body = router.request("POST", "/models/unload", {"model": "alpha"})
    assert status == 400 and "not loaded" in body["error"]["message"]


def test_ollamas_client_lists_pulls_runs_copies_and_deletes(router, hub):
    data = (Path(router.request("GET", "/v1/models/alpha")[1]["path"])).read_bytes()
    hub.add("test/tiny-GGUF", {"tiny-Q4_0.gguf": data})
    client = ollama.Client(host=router.url)
    names = {m.model for m in client.list().models}
    assert names == {"alpha", "beta", "broken"}
    progress = list(client.pull("hf:test/tiny-GGUF:Q4_0", stream=True))
    assert progress[-1].status == "success"
    names = {m.model for m in client.list().models}
    assert "hf:test/tiny-GGUF:Q4_0" in names
    answer = client.chat("hf:test/tiny-GGUF:Q4_0", messages=CHAT["messages"],
                         options={"num_predict": 3, "temperature": 0}, keep_alive=-1)
    assert answer.done and answer.eval_count == 3
    assert {m.model for m in client.ps().models} == {"hf:test/tiny-GGUF:Q4_0"}
    # a copy is a model of its own (the same file, linked), served and deleted alone
    client.copy("hf:test/tiny-GGUF:Q4_0", "tiny-copy:latest")
    assert {"hf:test/tiny-GGUF:Q4_0", "tiny-copy"} <= {m.model for m in client.list().models}
    copied = client.chat("tiny-copy", messages=CHAT["messages"],
                         options={"num_predict": 3, "temperature": 0})
    assert copied.message.content == answer.message.content
    for source, dest, code in (("hf:test/tiny-GGUF:Q4_0", "tiny-copy", 400),
                               ("alpha", "bad/name", 400), ("gamma", "x", 404)):
        with pytest.raises(ollama.ResponseError) as e:
            client.copy(source, dest)
        assert e.value.status_code == code
    client.delete("tiny-copy")
    names = {m.model for m in client.list().models}
    assert "tiny-copy" not in names and "hf:test/tiny-GGUF:Q4_0" in names
    client.delete("hf:test/tiny-GGUF:Q4_0")
    assert "hf:test/tiny-GGUF:Q4_0" not in {m.model for m in client.list().models}
    assert client.ps().models == []
    with pytest.raises(ollama.ResponseError) as e:
        client.chat("gamma", messages=CHAT["messages"])
    assert e.value.status_code == 404 and "gamma" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.delete("alpha")   # a file of the folder, not a pulled model
    assert e.value.status_code == 400


def test_keep_alive_zero_unloads_after_the_answer(router):
    client = ollama.Client(host=router.url)
    client.generate("beta", "hi", options={"num_predict": 2}, keep_alive=0)
    end = time.monotonic() + 30
    while router.statuses()["beta"] != "unloaded" and time.monotonic() < end:
        time.sleep(0.2)
    assert router.statuses()["beta"] == "unloaded"


def test_a_copy_may_not_take_a_name_the_router_serves(router):
    """A copy named like a file of the folder would have taken that name's requests (the
    copy's weights answering for beta); an hf: name is Hugging Face's. Each is a 400, and
    nothing is copied."""
    for dest in ("beta", "beta:latest", "alpha.gguf", "hf:x"):
        status, body = router.request("POST", "/api/copy", {"source": "alpha",
                                                            "destination": dest})
        assert status == 400 and "destination" in body["error"], (dest, body)
    names = {m["name"] for m in router.request("GET", "/api/tags")[1]["models"]}
    assert names == {"alpha", "beta", "broken"}


def test_a_pull_of_no_models_name_is_a_400(router):
    for body in ({"model": "nosuch", "stream": False}, {"model": "nosuch"},
                 {"model": "hf:../../x"}, {"model": "x" * 100_000, "stream": False}):
        status, answer = router.request("POST", "/api/pull", body)
        assert status == 400 and isinstance(answer["error"], str), (status, str(answer)[:300])
        assert "not a model name" in answer["error"] or "hf:" in answer["error"], answer


def test_keep_alive_past_a_floats_range_and_an_encoded_path(router):
    """keep_alive of 400 digits or 1e400 minutes is forever (as -1), NaN is not given: each
    answers, and /api/ps lists the model after it (it answered 500 for every client). A path
    with a space or a non-ASCII letter goes on to the worker encoded: its 404, not a 502."""
    client = ollama.Client(host=router.url)
    for keep in (int("9" * 400), "1e400m", "nan", "-1"):
        status, body = router.request("POST", "/api/generate", {
            "model": "beta", "prompt": "hi", "stream": False, "keep_alive": keep,
            "options": {"num_predict": 1}})
        assert status == 200, (keep, body)
        assert [m.model for m in client.ps().models] == ["beta"]
    for path in ("/v1/chat%20completions", "/v1/%C3%BC"):
        status, body = router.request("POST", path, dict(CHAT, model="beta"))
        assert status == 404 and body["error"]["type"] == "not_found_error", (path, body)


def test_a_worker_ends_with_its_router_killed(tmp_path, hub):
    """SIGKILL gives the router no chance to stop its workers: each ends by itself (Linux's
    parent-death signal) instead of serving on, orphaned."""
    models = tmp_path / "models"
    models.mkdir()
    write_tiny_model(models / "alpha.gguf", "llama", qtype="Q4_0")
    r = Router(models, tmp_path / "cache", hub.url, *FLAGS)
    try:
        assert r.request("POST", "/models/load", {"model": "alpha"})[0] == 200
        workers = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(p) == r.proc.pid]
        assert len(workers) == 1
        r.proc.kill()
        r.proc.wait(30)
        end = time.monotonic() + 60
        while os.path.exists(f"/proc/{workers[0]}") and _ppid(str(workers[0])) != 0:
            assert time.monotonic() < end, "the worker outlived its router"
            time.sleep(0.2)
    finally:
        r.close()


def _ppid(pid: str) -> int:
    """A process's parent (0 where it is gone or a zombie: its run has ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return 0 if state == "Z" else int(ppid)


@needs_browser
def test_the_web_page_picks_a_model(router):
    """The router serves the web page; in headless Chromium it lists every model with its
    status, and a message goes to the model picked (which loads for it)."""
    with browser.page() as tab:
        tab.goto(router.url + "/")
        tab.wait_for_selector("#models:not([hidden])")
        options = tab.eval_on_selector_all("#models option", "os => os.map(o => o.value)")
        assert sorted(options) == ["alpha", "beta", "broken"]
        tab.select_option("#models", "beta")
        tab.wait_for_function("document.getElementById('model').textContent"
                              ".includes('loaded when a message asks')")
        tab.fill("#max", "4")
        tab.fill("#text", "hello")
        tab.click("#send")
        tab.wait_for_selector(".figures:not([hidden])")
        assert tab.locator(".msg.error").count() == 0
        assert router.statuses()["beta"] == "loaded"
        tab.wait_for_function("[...document.querySelectorAll('#models option')].some("
                              "o => o.value === 'beta' && o.textContent.includes('loaded)'))")
        # the choice is kept for the next visit
        tab.reload()
        tab.wait_for_selector("#models:not([hidden])")
        assert tab.input_value("#models") == "beta"


def test_a_preset_file_is_checked_at_start(tmp_path):
    """Each bad --models-preset stops the start in one line naming the file: no section, not
    UTF-8, or a flag the router sets for its workers (a worker moved off the port the router
    waits on hung its model's load for 30 minutes; one on 0.0.0.0 served anyone)."""
    import argparse

    from kinetic.cli import build_parser
    from kinetic.serve_cli import check_presets, read_presets
    serve = next(a for a in build_parser()._actions
                 if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    cases = [(b"ctx-size = 8\n", "no section headers"), (b"\xff\xfe[x]\n", "utf-8"),
             (b"[beta]\nport = 18999\n", "sets --port"), (b"[*]\nhost = 0.0.0.0\n", "sets --host"),
             (b"[beta]\na = other\n", "sets -a")]
    for content, words in cases:
        path = tmp_path / "presets.ini"
        path.write_bytes(content)
        with pytest.raises(SystemExit) as e:
            check_presets(read_presets(str(path)), serve, str(path))
        message = str(e.value)
        assert "\n" not in message and str(path) in message and words in message, message
    path.write_bytes(b"[*]\nctx-size = 8192\n[beta]\nswa-full = true\n")
    check_presets(read_presets(str(path)), serve, str(path))   # worker flags pass
