"""The HTTP app: what every route shares, and the dialects' blueprints on top.

A connection past --max-connections never gets here: server.py answers it 503 on accept.
One request, in order (`_guard`, before any route runs):
1. a browser `Origin` that is not this computer gets 403, on every route, so that no web page
   can drive the server, whatever content type it sends;
2. every route but /health and /v1/health needs the API key when the server has one (401);
3. POST bodies of the OpenAI routes must be application/json (415) and, on every route, at
   most `max_body_bytes` (413); a client has `request_timeout` seconds to send its body;
4. while the model loads, every route but health answers 503;
then the route reads its body (`json_body`: strict UTF-8 JSON of valid Unicode, body.py),
parses it into a typed request (params.py), runs it through the engine (`generation`) and
writes the answer as JSON or server-sent events (`sse_response`). Every error, the router's
404 and 405 included, is written in the OpenAI shape (errors.py).

Dialects are blueprints: `openai` (openai.py) and `llama_server` (llama_server.py); Ollama's
routes register theirs in `create_app` the same way. /v1/prefill (prefill.py) has its own. Every generation, whatever its dialect,
is recorded in `ServerState.activity` (metrics.py) for /metrics and /slots.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator
from urllib.parse import urlsplit

from quart import Quart, Response, current_app, request
from werkzeug.exceptions import HTTPException

from kinetic.api.body import parse_json_object
from kinetic.api.errors import APIError, unavailable
from kinetic.api.metrics import Activity, Task
from kinetic.engine.request import Delta, GenerationRequest

if TYPE_CHECKING:
    from kinetic.llm import Model

log = logging.getLogger("kinetic.server")

PUBLIC_ENDPOINTS = {"health"}                  # no API key needed
JSON_ONLY_BLUEPRINTS = {"openai", "prefill"}   # their POST bodies must be application/json
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `kinetic serve` (one flag, one field; engine sizes are EngineConfig's)."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()     # --api-key / --api-key-file; empty: no authentication
    max_connections: int = 64          # more open connections are answered 503 and closed
    request_timeout: float = 30.0      # seconds a client has to send its request
    stall_timeout: float = 60.0        # /health answers 503 once a step runs longer
    max_body_bytes: int = 16 << 20
    sign_key: str | None = None        # --sign-key: kept for signed receipts
    ollama: bool = False               # --ollama: Ollama's port (its routes come later)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.request_timeout > 0:
            raise ValueError(f"--timeout must be more than 0 seconds, got {self.request_timeout}")
        if not self.stall_timeout > 0:
            raise ValueError(f"--stall-timeout must be more than 0 seconds, got "
                             f"{self.stall_timeout}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")


class ServerState:
    """What the routes share: the config, the model once it is loaded, how loading goes."""

    def __init__(self, config: ServerConfig, model_id: str):
        self.config, self.model_id = config, model_id
        self.model: Model | None = None
        self.kind = "text"                 # what the model serves: "text" (generation),
                                           # "embedding" or "rerank" (kinetic.embedding)
        self.loading = "Loading model"     # the 503 message while loading
        self.created = int(time.time())
        self.activity = Activity()         # every generation since ready (metrics.py)

    @property
    def ready(self) -> bool:
        return self.model is not None

    def set_ready(self, model: "Model") -> None:
        """Serve `model` from now on."""
        self.kind = getattr(model, "kind", "text")
        self.model = model

    def require_model(self) -> "Model":
        if self.model is None:
            raise unavailable(self.loading)
        return self.model


def server_state() -> ServerState:
    return current_app.extensions["kinetic"]


def create_app(state: ServerState) -> Quart:
    """The Quart app over `state`: shared checks, error handlers, health, the dialects."""
    from kinetic.api import llama_server, openai, prefill

    app = Quart("kinetic")
    app.extensions["kinetic"] = state
    app.config.update(MAX_CONTENT_LENGTH=state.config.max_body_bytes,
                      BODY_TIMEOUT=state.config.request_timeout)
    app.before_request(_guard)
    app.errorhandler(APIError)(_api_error)
    app.errorhandler(HTTPException)(_http_error)
    app.errorhandler(Exception)(_internal_error)
    app.add_url_rule("/health", "health", _health, methods=["GET"])
    app.add_url_rule("/v1/health", "health", _health, methods=["GET"])
    app.register_blueprint(openai.blueprint)
    app.register_blueprint(prefill.blueprint)
    app.register_blueprint(llama_server.blueprint)
    return app


async def _health() -> Response:
    """{"status": "ok"} and the slots once the model is ready; 503 while it loads, once the
    engine thread has died, or while its current step has run past `stall_timeout` (a
    supervisor polling health can then restart the server)."""
    state = server_state()
    model = state.require_model()
    if state.kind != "text":   # an encoder: nothing runs between requests
        busy = int(state.activity.encoding > 0)
        return json_response({"status": "ok", "slots_idle": 1 - busy, "slots_processing": busy})
    engine = model.engine
    if engine.failure is not None:
        raise unavailable(f"the engine has stopped ({engine.failure}); restart the server")
    stalled = engine.stalled_for()
    if stalled > state.config.stall_timeout:
        raise unavailable(f"the engine has not finished a step for {stalled:.0f} s (the "
                          f"limit is {state.config.stall_timeout:g} s); restart the server")
    slots = engine.stats().slots
    busy = sum(1 for s in slots if s.busy)
    return json_response({"status": "ok", "slots_idle": len(slots) - busy,
                          "slots_processing": busy})


# --- checks shared by every route ---------------------------------------------------------

async def _guard() -> None:
    state = server_state()
    origin = request.headers.get("Origin")
    if origin is not None and not is_local_origin(origin):
        raise APIError(403, f"requests from web pages of other sites (Origin: {origin}) are "
                       f"refused")
    if request.endpoint in PUBLIC_ENDPOINTS:
        return
    if state.config.api_keys and not authorized(state.config.api_keys):
        raise APIError(401, "Invalid API Key: send it as Authorization: Bearer KEY or "
                       "X-Api-Key: KEY", code="invalid_api_key")
    if request.url_rule is None:
        return  # the router answers 404 or 405
    length = request.content_length
    if length is not None and length > state.config.max_body_bytes:
        raise APIError(413, f"the body is {length} bytes; the server takes at most "
                       f"{state.config.max_body_bytes}", close=True)
    if (request.method == "POST" and request.blueprint in JSON_ONLY_BLUEPRINTS
            and request.mimetype != "application/json"):
        got = request.headers.get("Content-Type") or "none"
        raise APIError(415, f"the body must be sent as Content-Type: application/json "
                       f"(got {got})")
    state.require_model()


def is_local_origin(origin: str) -> bool:
    """Whether a browser's Origin is a page served by this computer (a loopback host)."""
    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or host is None:
        return False
    if host in LOCAL_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def authorized(keys: tuple[str, ...]) -> bool:
    """Whether the request carries one of `keys` (Bearer or X-Api-Key), compared in constant
    time."""
    given = []
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        given.append(auth[7:].strip())
    if "X-Api-Key" in request.headers:
        given.append(request.headers["X-Api-Key"].strip())
    ok = False
    for g in given:
        for k in keys:
            ok |= hmac.compare_digest(g.encode(), k.encode())
    return ok


# --- errors -------------------------------------------------------------------------------

def error_response(e: APIError) -> Response:
    resp = json_response(e.body(), e.status)
    if e.close:
        resp.headers["Connection"] = "close"
    if e.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


async def _api_error(e: APIError) -> Response:
    return error_response(e)


async def _http_error(e: HTTPException) -> Response:
    status = e.code or 500
    if status == 404:
        err = APIError(404, f"no such endpoint: {request.method} {request.path}")
    elif status == 405:
        allowed = ", ".join(m for m in (e.valid_methods or []) if m not in ("HEAD", "OPTIONS"))
        err = APIError(405, f"{request.path} does not take {request.method} (it takes "
                       f"{allowed or 'no other method'})")
    elif status == 413:
        err = APIError(413, f"the body is larger than the {server_state().config.max_body_bytes}"
                       f" bytes the server takes", close=True)
    elif status == 408:
        err = APIError(408, f"the request was not sent within "
                       f"{server_state().config.request_timeout:g} seconds", close=True)
    else:
        err = APIError(status, e.description or e.name)
    resp = error_response(err)
    if status == 405 and e.valid_methods:
        resp.headers["Allow"] = ", ".join(e.valid_methods)
    return resp


async def _internal_error(e: Exception) -> Response:
    log.exception("error in %s %s", request.method, request.path)
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))


# --- bodies and answers -------------------------------------------------------------------

INLINE_BODY_BYTES = 64 << 10   # larger bodies are parsed in a worker thread


async def json_body() -> dict[str, Any]:
    """The request body as a JSON object of valid Unicode, at most body.MAX_DEPTH deep (400
    saying what is wrong, and where, otherwise: body.py). A large body is parsed in a worker
    thread: 16 MiB take up to seconds, and the event loop streams everyone's tokens."""
    raw = await request.get_data()
    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, mimetype="application/json")


def sse_response(events: AsyncIterator[str]) -> Response:
    """A server-sent events answer from an async iterator of ready-made `data: ...` events.
    Closing it (the client went away) closes `events`, which cancels its generation."""
    resp = Response(events, mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.timeout = None  # a stream lasts as long as the generation, not RESPONSE_TIMEOUT
    return resp


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def generation(state: ServerState, request_: GenerationRequest, label: str, *,
                     stream: bool = False, task: Task | None = None) -> AsyncIterator[Delta]:
    """The engine's deltas for one request, recorded in `state.activity` (as `task` if given:
    its slot, cached tokens and timings are known once the first delta has come). Iterate it
    inside `aclosing` (or let Quart close a streamed body): leaving early, by a client that
    went away or by cancellation, cancels the request in the engine at once, freeing its
    slot. Nothing runs until it is iterated."""
    engine = state.require_model().engine
    if task is None:
        task = Task(request_, stream)
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[Delta] = asyncio.Queue()

    def sink(delta: Delta) -> None:  # on the engine thread
        task.engine_delta(delta, engine)
        loop.call_soon_threadsafe(out.put_nowait, delta)

    task.id = engine.start(request_, sink)
    state.activity.started(task)
    done = False
    try:
        while not done:
            delta = await out.get()
            state.activity.saw(task, delta)
            done = delta.finish_reason is not None
            if delta.finish_reason == "error":
                log.error("%s failed: %s", label, delta.error)
            yield delta
    finally:
        state.activity.ended(task)
        if not done:
            engine.cancel(task.id)
            log.info("%s cancelled after %d tokens (the client went away, or the server is "
                     "stopping)", label, task.n_decoded)
