"""The router's HTTP side: its own routes, and every other route passed to the worker of the
model the request names (the JSON body's `model`, or `?model=` on a GET).

Its own routes, in llama-server's router shape and Ollama's:
    GET  /health, /v1/health         the router is up (200)
    GET  /models, /v1/models         every model, with its status (loaded, loading,
                                     unloaded, failed) ; GET /v1/models/{id} one of them
    POST /models/load, /models/unload {"model": NAME}
    GET  /api/tags                   every model (Ollama's list), /api/ps the loaded ones
                                     with their expiry
    POST /api/pull                   `kinetic pull NAME`, with Ollama's progress lines
    POST /api/copy                   {"source", "destination"}: a model of its own with
                                     source's file (kinetic/store.py, copy)
    DELETE /api/delete               `kinetic rm NAME` (a pulled model or a copy; unloaded
                                     first)
    GET  /api/version
The checks every request passes (Host, Origin, API key, body size) are the server's own
(kinetic/api/access.py), and errors are in the OpenAI shape, Ollama's on /api/ paths."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from quart import Blueprint, Quart, Response, request

from kinetic.api import access, webui
from kinetic.api.core import ServerConfig, json_response, server_state as state
from kinetic.api.errors import APIError, bad_request
from kinetic.router import catalog
from kinetic.router.proxy import forward
from kinetic.router.workers import Workers

blueprint = Blueprint("router", __name__)
OLLAMA_VERSION = "0.12.0"   # the Ollama API version its routes answer as


@dataclass
class RouterState:
    """What access.guard and the error handlers read (`config`), and the router's own."""

    config: ServerConfig
    models_dir: str | None
    workers: Workers
    autoload: bool = True
    created: int = field(default_factory=lambda: int(time.time()))
    kind: str = "router"

    def require_model(self) -> None:   # access.guard's last check: a router always serves
        return None

    def end_generations(self, message: str) -> None:   # listener._serve's stop hook: the
        return None                                    # workers end their own

    def models(self) -> list[catalog.Model]:
        return catalog.models(self.models_dir)

    def find(self, name: Any, param: str = "model") -> catalog.Model:
        """The model `name` means: a loaded one's without reading the disk (the path of
        every request to it), else from the catalog as it is now."""
        if isinstance(name, str) and name:
            loaded = catalog.find(name, [w.model for w in self.workers.by_name.values()])
            if loaded is not None:
                return loaded
        available = self.models()
        names = ", ".join(m.name for m in available) or "none"
        if not isinstance(name, str) or not name:
            raise bad_request(f"{param} is required: this server routes each request to the "
                              f"model it names (models: {names})", param)
        found = catalog.find(name, available)
        if found is None:
            raise APIError(404, f"model {name!r} not found (models: {names}; `kinetic pull` "
                           f"adds one)", param=param, code="model_not_found")
        return found


def create_router_app(rs: RouterState) -> Quart:
    return access.guarded_app("kinetic-router", rs, (blueprint, webui.blueprint))


# --- the router's own routes --------------------------------------------------------------

@blueprint.get("/health")
@blueprint.get("/v1/health")
async def health():
    return json_response({"status": "ok"})


def _model_object(rs: RouterState, m: catalog.Model) -> dict[str, Any]:
    status = rs.workers.status(m.name)
    out = {"id": m.name, "object": "model", "created": int(m.modified), "owned_by": "kinetic",
           "path": str(m.path), "size": m.size, "status": {"value": status}}
    w = rs.workers.by_name.get(m.name)
    if w is not None and w.error:
        out["status"]["error"] = w.error
    return out


@blueprint.get("/models")
@blueprint.get("/v1/models")
async def list_models():
    rs = state()
    return json_response({"object": "list",
                          "data": [_model_object(rs, m) for m in rs.models()]})


@blueprint.get("/v1/models/<path:model_id>")
@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str):
    rs = state()
    return json_response(_model_object(rs, rs.find(model_id)))


async def _body() -> dict[str, Any]:
    from kinetic.api.core import json_body
    return await json_body()


@blueprint.post("/models/load")
async def load():
    rs = state()
    m = rs.find((await _body()).get("model"))
    await rs.workers.get(m, retry=True)   # asked for by name: a failed model is tried again
    return json_response({"success": True, "model": m.name, "status": "loaded"})


@blueprint.post("/models/unload")
async def unload():
    rs = state()
    m = rs.find((await _body()).get("model"))
    if not await rs.workers.unload(m.name):
        raise bad_request(f"model {m.name} is not loaded", "model")
    return json_response({"success": True, "model": m.name, "status": "unloaded"})


# --- Ollama's model management --------------------------------------------------------------

def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat().replace("+00:00", "Z")


def _ollama_model(m: catalog.Model) -> dict[str, Any]:
    return {"name": m.name, "model": m.name, "modified_at": _iso(m.modified), "size": m.size,
            "digest": "", "details": {"format": "gguf", "family": "", "families": None,
                                      "parameter_size": "", "quantization_level": ""}}


@blueprint.get("/api/tags")
async def tags():
    return json_response({"models": [_ollama_model(m) for m in state().models()]})


@blueprint.get("/api/ps")
async def ps():
    rs = state()
    now_mono, now = time.monotonic(), time.time()
    out = []
    for name, w in rs.workers.by_name.items():
        if w.state != "loaded":
            continue
        left = (w.expires - now_mono) if w.expires is not None else 100 * 365 * 86400
        out.append(dict(_ollama_model(w.model), size_vram=0,
                        expires_at=_iso(now + max(left, 0))))
    return json_response({"models": out})


@blueprint.get("/api/version")
async def version():
    return json_response({"version": OLLAMA_VERSION})


@blueprint.post("/api/pull")
async def pull():
    from kinetic import store
    from kinetic.fetch import FetchError
    body = await _body()
    name = body.get("model") or body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required: the name to pull (`kinetic list` shows them)",
                          "model")
    name = name.removesuffix(":latest")
    try:   # a name that is no model's is the client's error (a 400), found before any pull
        store.check_pull_name(name)
    except FetchError as e:
        raise bad_request(str(e), "model") from None
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue = asyncio.Queue()

    def progress(message: str) -> None:
        loop.call_soon_threadsafe(lines.put_nowait, {"status": message})

    def run() -> None:
        try:
            store.pull(name, progress)
            loop.call_soon_threadsafe(lines.put_nowait, {"status": "success"})
        except Exception as e:  # noqa: BLE001 - every failure is the pull's error line
            loop.call_soon_threadsafe(lines.put_nowait, {"error": str(e)})
        finally:
            loop.call_soon_threadsafe(lines.put_nowait, None)

    lines.put_nowait({"status": f"pulling {name}"})
    task = asyncio.get_running_loop().run_in_executor(None, run)
    if body.get("stream", True) is False:
        last = None
        while (line := await lines.get()) is not None:
            last = line
        await task
        if "error" in last:
            raise APIError(500, last["error"])
        return json_response(last)

    async def ndjson():
        while (line := await lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()
    resp = Response(ndjson(), mimetype="application/x-ndjson")
    resp.timeout = None
    return resp


@blueprint.delete("/api/delete")
async def delete():
    from kinetic import store
    rs = state()
    body = await _body()
    m = rs.find(body.get("model") or body.get("name"))
    if not m.pulled:
        raise bad_request(f"model {m.name} is a file of --models-dir ({m.path}), not a pulled "
                          f"model: delete the file itself", "model")
    await rs.workers.unload(m.name)
    try:
        await asyncio.to_thread(store.remove, m.name)
    except store.ModelNotFound as e:
        raise APIError(404, str(e)) from None
    return Response(status=200)


@blueprint.post("/api/copy")
async def copy():
    """Ollama's copy: `destination` becomes a model of its own with `source`'s file (a link
    in kinetic's cache: kinetic/store.py)."""
    from kinetic import store
    rs = state()
    body = await _body()
    m = rs.find(body.get("source"), "source")
    dest = body.get("destination")
    if isinstance(dest, str) and dest and catalog.find(dest, rs.models()) is not None:
        # a copy may not take a name the router already serves (a pulled model's, a file's
        # of --models-dir): its requests would go to the copy's weights
        raise bad_request(f"destination {dest!r} already names a model", "destination")
    try:
        await asyncio.to_thread(store.copy, m.path, dest)
    except ValueError as e:
        raise bad_request(str(e), "destination") from None
    except OSError as e:
        raise APIError(500, f"cannot copy {m.name}: {e.strerror or e}") from None
    return Response(status=200)


# --- everything else: the model's worker ----------------------------------------------------

@blueprint.route("/<path:path>", methods=["GET", "POST", "DELETE"])
async def route(path: str):
    rs = state()
    body = await request.get_data()
    if request.method == "POST":
        from kinetic.api.body import parse_json_object
        try:
            name = parse_json_object(body).get("model") if body else None
        except APIError:
            name = None   # the worker names what is wrong with the body; it needs a model
    else:
        name = request.args.get("model")
    m = rs.find(name)
    if not rs.autoload and rs.workers.status(m.name) != "loaded":
        raise APIError(503, f"model {m.name} is not loaded (this router loads models only "
                       f"through POST /models/load: --no-models-autoload)")
    worker = await rs.workers.get(m)
    keep = _keep_alive(body) if path.startswith("api/") and request.method == "POST" else None
    resp = await forward(worker, body)
    if keep is not None:
        worker.expires = None if keep < 0 else time.monotonic() + keep
    return resp


KEEP_ALIVE_MAX = 100 * 365 * 86400.0   # seconds; a longer keep_alive is forever (as -1)


def _keep_alive(body: bytes) -> float | None:
    """Ollama's keep_alive of a body in seconds (negative: forever, as is anything past
    KEEP_ALIVE_MAX), None when not given or not a number (NaN)."""
    try:
        value = json.loads(body).get("keep_alive")
    except (ValueError, AttributeError):
        return None
    if value is None or isinstance(value, bool):
        return None
    scale = 1.0
    if isinstance(value, str):
        units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
        unit = next((u for u in ("ms", "s", "m", "h") if value.endswith(u)), None)
        if unit is not None:
            value, scale = value[:-len(unit)], units[unit]
    try:
        seconds = float(value) * scale
    except OverflowError:   # an integer past a float's range
        return -1.0
    except (TypeError, ValueError):
        return None
    if math.isnan(seconds):
        return None
    return -1.0 if seconds > KEEP_ALIVE_MAX else seconds


# --- serving ----------------------------------------------------------------------------------

def run_router(config: ServerConfig, rs_args: dict) -> int:
    """Serve the router until SIGINT or SIGTERM (kinetic/api/listener.py's listener and
    stop); its workers are stopped with it."""
    from kinetic.api import listener
    listener.setup_logging()
    return asyncio.run(_main(config, rs_args))


async def _main(config: ServerConfig, rs_args: dict) -> int:
    import signal

    from kinetic.api import listener
    models_max = rs_args["models_max"]
    if models_max <= 0:
        from kinetic.router.workers import default_models_max
        models_max = default_models_max([m.size for m in catalog.models(rs_args["models_dir"])])
    workers = Workers(rs_args["flags"], rs_args["presets"], models_max)
    rs = RouterState(config, rs_args["models_dir"], workers, rs_args["autoload"])
    app = create_router_app(rs)
    listening = listener.listen(config)
    if listening is None:
        return 1
    hconfig, host, sockets, port = listening
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def expiring() -> None:
        while not stop.is_set():
            await asyncio.sleep(1.0)
            await workers.expire()
    expiry = loop.create_task(expiring())
    names = ", ".join(m.name for m in rs.models()) or "none yet (kinetic pull NAME)"
    print(f"kinetic: routing at http://{host}:{port}/v1 to the model each request names "
          f"(up to {models_max} loaded at once): {names}", file=sys.stderr, flush=True)
    try:
        await listener._serve(app, hconfig, sockets, config.max_connections, stop,
                            rs.end_generations)
    finally:
        expiry.cancel()
        await workers.close()
        print("kinetic: stopped", file=sys.stderr, flush=True)
    return 0

