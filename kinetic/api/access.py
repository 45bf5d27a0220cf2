"""What every request passes before its route runs, and how every error is written.

`guard`, in order:
0. a Host header that names anything but this computer gets 403, on every route, when the
   server listens on a loopback address and has no API key (`host_allowed`): a web page can
   make its own name resolve to 127.0.0.1 (DNS rebinding) and then read the server's answers
   as same-origin, sending no Origin at all; its requests still carry its own name as Host.
   --allowed-hosts names more hosts. A server listening on another address is reached under
   names it cannot know, so there the check is off, and the docs say to set --api-key;
1. an OPTIONS request is a browser's CORS preflight: answered 200 at once, as llama-server
   answers it (`preflight`), for any Origin; it runs nothing, and a foreign page that goes on
   to send its request still meets rule 1;
2. a browser `Origin` that is not this computer gets 403, on every route, so that no web page
   can drive the server, whatever content type it sends;
3. every route but /health and /v1/health needs the API key when the server has one (401);
4. POST bodies of the OpenAI routes must be application/json (415) and, on every route, at
   most `max_body_bytes` (413); a client has `request_timeout` seconds to send its body;
5. while the model loads, every route but health answers 503.
A connection past --max-connections never gets here: server.py answers it 503 on accept.

Every error, the router's 404 and 405 included, is written in the OpenAI shape (errors.py),
except under /api/, Ollama's paths, where it is Ollama's `{"error": "..."}`.
Every answer to a page of this computer (a local Origin) carries Access-Control-Allow-Origin
for it (`cors_headers`), so that local web apps can read it.
"""

from __future__ import annotations

import hmac
import time
import ipaddress
from urllib.parse import urlsplit

from quart import Quart, Response, g, request
from werkzeug.exceptions import HTTPException

from kinetic.api.core import json_response, log, server_state
from kinetic.api.errors import APIError

PUBLIC_ENDPOINTS = {"llama_server.health", "webui.page", "router.health"}   # no API key
JSON_ONLY_BLUEPRINTS = {"openai", "prefill"}   # their POST bodies must be application/json
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}
CORS_METHODS = "GET, POST, DELETE, OPTIONS"   # every method a route takes, as llama-server says


# --- checks shared by every route ---------------------------------------------------------

def guarded_app(name: str, state, blueprints) -> Quart:
    """A Quart app over `state` (a server's or a router's: what `guard` and the error
    handlers read as server_state()) with these checks, these error handlers and
    `blueprints`."""
    app = Quart(name)
    app.extensions["kinetic"] = state
    app.config.update(MAX_CONTENT_LENGTH=state.config.max_body_bytes,
                      BODY_TIMEOUT=state.config.request_timeout)
    app.before_request(guard)
    app.after_request(cors_headers)
    app.after_request(log_request)
    app.errorhandler(APIError)(api_error)
    app.errorhandler(HTTPException)(http_error)
    app.errorhandler(Exception)(internal_error)
    for blueprint in blueprints:
        app.register_blueprint(blueprint)
    return app


MAX_HEADER_BYTES = 16 * 1024   # Hypercorn's h11 limit, which only holds while headers are
                               # incomplete: headers that come in one read (up to 64 KiB) pass it


async def guard() -> Response | None:
    state = server_state()
    g.began = time.monotonic()
    size = sum(len(k) + len(v) + 4 for k, v in request.headers.items())
    if size > MAX_HEADER_BYTES:
        raise APIError(431, f"the request's headers are {size} bytes; the server takes at most "
                       f"{MAX_HEADER_BYTES} (16 KiB)", close=True)
    if not host_allowed(state.config, request.headers.get("Host")):
        raise APIError(403, f"requests for the host {request.headers.get('Host')!r} are "
                       f"refused: this server answers for this computer's own names "
                       f"(localhost, 127.0.0.1, [::1]); start it with --allowed-hosts to "
                       f"add others")
    origin = request.headers.get("Origin")
    if request.method == "OPTIONS":
        return preflight(origin)
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


async def log_request(response: Response) -> Response:
    """--verbose: one line per answered request (method, path, status, seconds to the answer's
    head; a stream goes on after it)."""
    if server_state().config.verbose:
        began = getattr(g, "began", None)
        took = f" {time.monotonic() - began:.3f} s" if began is not None else ""
        log.info("%s %s -> %d%s", request.method, request.path, response.status_code, took)
    return response


def preflight(origin: str | None) -> Response:
    """A CORS preflight's answer, in llama-server's shape: 200, the Origin echoed, credentials
    allowed. It needs no API key (browsers never send one on a preflight) and holds for any
    Origin, as llama-server's does: it only lets the browser send the request, which the
    guard then refuses from another site's page. Allowed headers are the ones the preflight
    asks for rather than llama-server's bare "*", which browsers never read as covering
    Authorization (nor anything, with credentials), so a local page could not send its key."""
    resp = Response("", status=200)
    if origin is not None:
        resp.headers["Access-Control-Allow-Origin"] = origin
        resp.headers["Vary"] = "Origin"
    resp.headers["Access-Control-Allow-Credentials"] = "true"
    resp.headers["Access-Control-Allow-Methods"] = CORS_METHODS
    resp.headers["Access-Control-Allow-Headers"] = (
        request.headers.get("Access-Control-Request-Headers") or "*")
    return resp


async def cors_headers(response: Response) -> Response:
    """Let a page of this computer read the answer (the guard has refused any other page)."""
    origin = request.headers.get("Origin")
    if origin is not None and request.method != "OPTIONS" and is_local_origin(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Allow-Credentials"] = "true"
        response.vary.add("Origin")
    return response


def is_local_origin(origin: str) -> bool:
    """Whether a browser's Origin is a page served by this computer (a loopback host)."""
    try:
        parts = urlsplit(origin)
        host = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or host is None:
        return False
    return is_loopback_name(host)


def is_loopback_name(host: str) -> bool:
    """Whether a host name (lower case, no port, no brackets) is this computer's own:
    localhost, a name under .localhost, an address of 127.0.0.0/8 or ::1."""
    if host in LOCAL_HOSTS or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(config, header: str | None) -> bool:
    """Rule 0 of `guard`: whether a request's Host header may be served. Checked only when
    the server listens on a loopback address and has no API key; then the Host must be a
    loopback name or one of --allowed-hosts ("*" allows any). A request without a Host
    (HTTP/1.0) comes from no browser: served."""
    if header is None or config.api_keys or "*" in config.allowed_hosts:
        return True
    if not is_loopback_name(config.host.strip("[]").lower()):
        return True
    name = host_name(header)
    return name is not None and (is_loopback_name(name) or name in config.allowed_hosts)


def host_name(header: str) -> str | None:
    """The name of a Host header, lower case, without its port, brackets or a final dot
    (`[::1]:8080` -> `::1`); None when it is not a well-formed host."""
    header = header.strip().lower()
    if header.startswith("["):
        name, sep, rest = header[1:].partition("]")
        if not sep or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        return name
    name, sep, port = header.partition(":")
    if sep and not port.isdigit():
        return None
    return name.rstrip(".") or None


def is_ollama_path(path: str) -> bool:
    """Ollama's routes (kinetic/api/dialects/ollama.py), whose errors are in Ollama's shape."""
    return path == "/api" or path.startswith("/api/")


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
    for key in given:
        for k in keys:
            ok |= hmac.compare_digest(key.encode(), k.encode())
    return ok


# --- errors -------------------------------------------------------------------------------

def error_response(e: APIError) -> Response:
    """The error in the OpenAI shape, or in Ollama's ({"error": "..."}) on its paths."""
    if is_ollama_path(request.path):   # Ollama's error has no param: the message names it
        named = e.param is None or e.param in e.message
        body: dict = {"error": e.message if named else f"{e.param}: {e.message}"}
    else:
        body = e.body()
    resp = json_response(body, e.status)
    if e.close or not _body_received():
        resp.headers["Connection"] = "close"
    if e.status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def _body_received() -> bool:
    """Whether the request's body, if it has one, has all come in. An answer sent before
    it has (a 401, a 415, a route refusing the model's kind before reading the body) closes
    the connection: HTTP/1.1 would read the rest of the body as the next request, and
    Hypercorn drops the connection instead, with the client's next request on it."""
    declared = (request.content_length or 0) > 0 or "chunked" in request.headers.get(
        "Transfer-Encoding", "").lower()
    if not declared:
        return True
    complete = getattr(request.body, "_complete", None)   # Quart's Body: an asyncio.Event
    return complete.is_set() if hasattr(complete, "is_set") else False


async def api_error(e: APIError) -> Response:
    return error_response(e)


async def http_error(e: HTTPException) -> Response:
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


async def internal_error(e: Exception) -> Response:
    log.exception("error in %s %s", request.method, request.path)
    return error_response(APIError(500, f"internal error: {type(e).__name__}: {e}"))
