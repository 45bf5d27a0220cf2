"""`kinetic serve`: the app on Hypercorn, with the model loaded in the background.

The server listens at once, so that /v1/health can answer 503 while the model loads; a
loader thread reads the GGUF file, builds the engine, compiles every step shape the engine
will use and runs one short warm-up request (progress on stderr: a bar on a terminal, a few
plain lines in a log), then the server prints one line with its address and serves.
SIGINT or SIGTERM stop it: no new connections, open ones get a few seconds to finish, then
the engine stops.

Hypercorn's own accept loop has no connection limit, so `_serve` runs Hypercorn's connection
handler (TCPServer) under an accept loop of ours that counts open connections: one past
`max_connections` is still served, but marked, and the app answers its request 503 and
closes it. A connection counts until the client closes it or it has been idle for
`request_timeout`. Time limits: a client must send its request line and headers within
`request_timeout` of connecting (or of the previous answer: Hypercorn's keep-alive timeout),
and its body within `request_timeout` after that (Quart's BODY_TIMEOUT, answered 408).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig
from hypercorn.utils import wrap_app

from kinetic.api.app import OVER_LIMIT, ServerConfig, ServerState, create_app, log
from kinetic.engine.engine_config import EngineConfig

GRACEFUL_SECONDS = 5.0


@dataclass(frozen=True)
class ModelOptions:
    """What the server loads: the GGUF file, the engine's shape, an optional draft model."""

    path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "bfloat16"
    draft: str | None = None

    @property
    def model_id(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def build_model(opts: ModelOptions, progress: Callable[[str], Callable[[int, int], None]]):
    """Load, compile and warm up a kinetic.llm.Model for serving. progress(label) gives the
    callback for one stage (loading, compiling)."""
    from kinetic.engine.engine import Engine
    from kinetic.engine.request import GenerationRequest
    from kinetic.grammar import compile_json_schema
    from kinetic.llm import Model
    from kinetic.model.loader import load_model
    from kinetic.text.tokenizer import Tokenizer

    loaded = load_model(opts.path, dtype=opts.dtype, progress=progress("loading"))
    tokenizer = Tokenizer.from_metadata(loaded.file.metadata)
    draft = None if opts.draft is None else load_model(
        opts.draft, dtype=opts.dtype, progress=progress("loading the draft model"))
    engine = Engine(loaded, tokenizer, opts.engine, draft=draft)
    model = Model(loaded, tokenizer, engine)
    # every key-axis bucket now, then the sampler and log-probabilities by one short request,
    # so that no client request waits for XLA (the engine thread is idle until then); the
    # request has a grammar, so the token trie for grammar masks is built now too
    engine.runner.compile(progress=progress("compiling"))
    if engine.drafter is not None:
        engine.drafter.runner.compile(progress=progress("compiling the draft model"))
    first = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    warm_up = GenerationRequest([first], max_tokens=2, logprobs=1,
                                grammar=compile_json_schema(True))
    for delta in engine.generate(warm_up):
        if delta.error:
            raise RuntimeError(delta.error)
    return model


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run(config: ServerConfig, opts: ModelOptions) -> int:
    """Serve until SIGINT or SIGTERM. Returns the exit status (1 if the model failed to
    load or the address cannot be bound)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kinetic: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return asyncio.run(_main(config, opts))


async def _main(config: ServerConfig, opts: ModelOptions) -> int:
    from kinetic.cli import _progress_printer

    loop = asyncio.get_running_loop()
    state = ServerState(config, opts.model_id)
    app = create_app(state)
    hconfig = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hconfig.bind = [f"{host}:{config.port}"]
    hconfig.keep_alive_timeout = config.request_timeout
    hconfig.read_timeout = None  # it would also cut clients quietly waiting for an answer
    hconfig.graceful_timeout = GRACEFUL_SECONDS
    try:
        sockets = hconfig.create_sockets()
    except OSError as e:
        print(f"kinetic: cannot listen on {host}:{config.port}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    port = sockets.insecure_sockets[0].getsockname()[1]
    stop = asyncio.Event()
    status = [0]
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    def progress(label: str) -> Callable[[int, int], None]:
        show = _progress_printer(label)

        def update(done: int, total: int) -> None:
            state.loading = f"Loading model: {label} {100 * done // max(total, 1)}%"
            show(done, total)
        return update

    def ready(model) -> None:  # on the event loop: no request runs between these two lines
        slots = _count(model.engine.config.parallel, "slot")
        print(f"kinetic: serving {state.model_id} at http://{host}:{port}/v1 (context "
              f"{model.n_ctx}, {slots}); Ctrl+C stops it", file=sys.stderr, flush=True)
        state.set_ready(model)

    def load() -> None:
        try:
            model = build_model(opts, progress)
        except Exception as e:  # noqa: BLE001 - any failure ends the server with its message
            print(f"kinetic: {e}", file=sys.stderr, flush=True)
            status[0] = 1
            loop.call_soon_threadsafe(stop.set)
            return
        loop.call_soon_threadsafe(ready, model)

    print(f"kinetic: loading {opts.path}", file=sys.stderr, flush=True)
    loader = threading.Thread(target=load, name="kinetic-loader", daemon=True)
    loader.start()
    await _serve(app, hconfig, sockets, config.max_connections, stop)
    if loader.is_alive():  # stopped while loading: XLA may be compiling; leave at once
        print("kinetic: stopped while loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status[0])
    if state.model is not None:
        state.model.close()
        print("kinetic: stopped", file=sys.stderr, flush=True)
    return status[0]


class _Connection(TCPServer):
    """Hypercorn's connection handler, closing as soon as the client has: Hypercorn itself
    keeps a connection whose client left while idle until its keep-alive timeout, and here
    such a connection would hold one of the `max_connections` places all that time."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


async def _serve(app, hconfig: HypercornConfig, sockets, max_connections: int,
                 stop: asyncio.Event) -> None:
    """Hypercorn's worker loop (hypercorn.asyncio.run.worker_serve) with a count of open
    connections: each one past `max_connections` carries OVER_LIMIT in its ASGI state."""
    loop = asyncio.get_running_loop()
    asgi = wrap_app(app, hconfig.wsgi_max_body_size, "asgi")
    lifespan_state: dict = {}
    lifespan = Lifespan(asgi, hconfig, loop, lifespan_state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    context = WorkerContext(None)
    tasks: set[asyncio.Task] = set()
    open_connections = 0

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_connections
        task = asyncio.current_task()
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        open_connections += 1
        conn_state = dict(lifespan_state)
        if open_connections > max_connections:
            conn_state[OVER_LIMIT] = True
        try:
            await _Connection(asgi, loop, hconfig, context, conn_state, reader, writer)
        except asyncio.CancelledError:
            pass  # stopping: a connection still open after the grace period
        finally:
            open_connections -= 1

    servers = [await asyncio.start_server(connection, backlog=hconfig.backlog, sock=sock)
               for sock in sockets.insecure_sockets]
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await context.terminated.set()  # idle keep-alive connections close now
        for server in servers:
            server.close()
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=hconfig.graceful_timeout)
            for task in pending:  # streams still running: cancelling them cancels generation
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=hconfig.graceful_timeout)
        for server in servers:
            await server.wait_closed()
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        try:
            await lifespan_task
        except asyncio.CancelledError:
            pass
