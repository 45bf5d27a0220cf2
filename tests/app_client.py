"""kinetic's HTTP app in this process, for tests that send many requests fast: a tiny
random-weight Qwen3 model (tests/tiny_models.py, with Qwen3's chat template, so tools and
thinking are in play) behind `create_app`, driven through Quart's test client. No server
process and no socket: the body goes to the route as sent, byte for byte.

    with in_process_app(tmp_dir) as app:
        status, body = app.post("/tokenize", b'{"content": "hi"}')
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from tests.tiny_models import DATA, write_tiny_model

N_CTX = 256
TIMEOUT = 60.0  # seconds per request; only reached when something hangs (the test fails)
ERROR_FIELDS = {"message", "type", "param", "code"}
# error types whose object carries more fields, as llama-server's does
EXTRA_ERROR_FIELDS = {"exceed_context_size_error": {"n_prompt_tokens", "n_ctx"}}

# endpoint -> a body the route serves (200), generating at most one token: the base the
# malformed-body table and the fuzz test vary
SERVED_BODIES = {
    "openai.chat_completions": {"messages": [{"role": "user", "content": "hi"}],
                                "max_tokens": 1},
    "openai.completions": {"prompt": "hi", "max_tokens": 1},
    "llama_server.completion": {"prompt": "hi", "n_predict": 1},
    "llama_server.tokenize": {"content": "hi"},
    "llama_server.detokenize": {"tokens": [1, 2]},
    "prefill.prefill": {"messages": [{"role": "user", "content": "hi there"}]},
    "ollama.chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "stream": False, "options": {"num_predict": 1}},
    "ollama.generate": {"model": "m", "prompt": "hi", "stream": False,
                        "options": {"num_predict": 1}},
}


class AppClient:
    """The app and its test client, run on an event loop in a thread of its own, so that a
    request that never answers fails the test after TIMEOUT instead of hanging it."""

    def __init__(self, app):
        self.app, self.client = app, app.test_client()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def post(self, path: str, body: bytes, content_type: str = "application/json",
             timeout: float = TIMEOUT) -> tuple[int, Any]:
        """(status, the answer parsed as JSON, or its raw bytes when it is not JSON)."""
        async def send():
            resp = await self.client.post(path, data=body,
                                          headers={"Content-Type": content_type})
            return resp.status_code, await resp.get_data()
        future = asyncio.run_coroutine_threadsafe(send(), self.loop)
        status, data = future.result(timeout)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def get(self, path: str, timeout: float = TIMEOUT) -> tuple[int, Any]:
        async def send():
            resp = await self.client.get(path)
            return resp.status_code, await resp.get_data()
        status, data = asyncio.run_coroutine_threadsafe(send(), self.loop).result(timeout)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def raw(self, method: str, path: str, body: bytes = b"",
            headers: dict[str, str] | None = None,
            timeout: float = TIMEOUT) -> tuple[int, Any, bytes]:
        """Any method with any headers: (status, the answer's headers (case-insensitive), its
        bytes)."""
        async def send():
            resp = await self.client.open(path, method=method, data=body, headers=headers or {})
            return resp.status_code, resp.headers, await resp.get_data()
        return asyncio.run_coroutine_threadsafe(send(), self.loop).result(timeout)

    def request(self, method: str, path: str, body: bytes = b"",
                headers: dict[str, str] | None = None,
                timeout: float = TIMEOUT) -> tuple[int, Any, Any]:
        """Any method with any headers: (status, the answer's headers (case-insensitive), the
        answer parsed as JSON, or its raw bytes when it is not JSON)."""
        status, head, data = self.raw(method, path, body, headers, timeout)
        try:
            return status, head, json.loads(data)
        except ValueError:
            return status, head, data

    def post_routes(self) -> list[str]:
        """Every POST route of the app, so that a new one is walked too; a number in the path
        (/slots/<int:id_slot>) is 0."""
        return sorted(re.sub(r"<int:\w+>", "0", r.rule)
                      for r in self.app.url_map.iter_rules() if "POST" in r.methods)

    def endpoint(self, path: str) -> str:
        return self.app.url_map.bind("localhost").match(path, method="POST")[0]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


@contextmanager
def in_process_app(tmp_dir: Path) -> Iterator[AppClient]:
    """The app over a tiny Qwen3 model written to `tmp_dir`, ready (the model is loaded; its
    steps compile on the first generation)."""
    template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    path = write_tiny_model(tmp_dir / "tiny-qwen3.gguf", "qwen3", context_length=N_CTX,
                            chat_template=template)
    with model_app(path, n_ctx=N_CTX, parallel=1) as client:
        yield client


@contextmanager
def model_app(path: Path, server_config=None, **load_args) -> Iterator[AppClient]:
    """The app over any GGUF file (kinetic.load(path, **load_args)), ready; server_config: a
    kinetic.api.core.ServerConfig (the default one without it)."""
    import kinetic
    from kinetic.api.app import create_app
    from kinetic.api.core import ServerConfig, ServerState

    model = kinetic.load(path, **load_args)
    state = ServerState(server_config or ServerConfig(), Path(path).stem)
    state.set_ready(model)
    client = AppClient(create_app(state))
    try:
        yield client
    finally:
        client.close()
        model.close()


class Transport(httpx.BaseTransport):
    """An httpx transport into the app, so that an HTTP client library (the official ollama
    or openai client) drives the app in this process: `ollama.Client(transport=...)`. A
    streamed answer arrives whole, then the client reads it as it would read the stream."""

    def __init__(self, app: AppClient):
        self.app = app

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.raw_path.decode("ascii")
        status, head, data = self.app.raw(request.method, path, request.read(),
                                          dict(request.headers))
        return httpx.Response(status, headers=list(head.items()), content=data)


def assert_route_error(path: str, status: int, answer: Any, what: str = "") -> None:
    """A 4xx in the shape of the route's dialect: Ollama's under /api/, else OpenAI's."""
    if path.startswith("/api/"):
        assert_ollama_error(status, answer, what)
    else:
        assert_error_shape(status, answer, what)


def assert_ollama_error(status: int, answer: Any, what: str = "") -> str:
    """A 4xx in Ollama's shape, {"error": "..."}; returns the message."""
    assert 400 <= status < 500, f"{what}: {status} {answer!r:.600}"
    assert isinstance(answer, dict) and set(answer) == {"error"}, f"{what}: {answer!r:.600}"
    assert isinstance(answer["error"], str) and answer["error"], f"{what}: {answer!r:.600}"
    return answer["error"]


def assert_error_shape(status: int, answer: Any, what: str = "") -> dict:
    """A 4xx in the OpenAI error shape; returns its "error" object."""
    assert 400 <= status < 500, f"{what}: {status} {answer!r:.600}"
    assert isinstance(answer, dict) and set(answer) == {"error"}, f"{what}: {answer!r:.600}"
    err = answer["error"]
    assert isinstance(err, dict), f"{what}: {err!r:.600}"
    assert set(err) == ERROR_FIELDS | EXTRA_ERROR_FIELDS.get(err.get("type"), set()), \
        f"{what}: {err!r:.600}"
    assert isinstance(err["message"], str) and err["message"], f"{what}: {err!r:.600}"
    assert isinstance(err["type"], str) and err["type"], f"{what}: {err!r:.600}"
    assert err["param"] is None or isinstance(err["param"], str), f"{what}: {err!r:.600}"
    assert err["code"] is None or isinstance(err["code"], str), f"{what}: {err!r:.600}"
    return err
