"""`kinetic serve`: the app on Hypercorn, with the model loaded in the background.

The server listens at once, so that /v1/health can answer 503 while the model loads; a
loader thread reads the GGUF file, builds the engine, compiles every step shape the engine
will use and runs one short warm-up request (progress on stderr: a bar on a terminal, a few
plain lines in a log), then the server prints one line with its address and serves.

Stopping always stops. SIGINT or SIGTERM: no new connections, idle ones close, requests
still running get GRACEFUL_SECONDS to finish; then each answer still running ends with an
error in its dialect's shape (a stream's error event or line, then its end; a 503 for one
not streamed), resumable streams included, and what is left after CANCELLED_SECONDS is
cancelled; the engine thread stops between two steps. A watchdog thread, started with the
stop, ends the process (status 1, with a message) if all that has not finished within
STOP_SECONDS: an engine thread stuck in a long device call can never be joined. A second
signal ends the process at once.

Hypercorn's own accept loop has no connection limit, so `_serve` runs Hypercorn's connection
handler (TCPServer) under an accept loop of ours that counts open connections: one past
`max_connections` is answered at once on accept, whatever it has sent or not yet sent: a
503 in the OpenAI error shape with `Retry-After`, then closed (`_refuse`). A connection
counts until the client closes it or it has been idle for `request_timeout`. Time limits: a
client must send its request line and headers within `request_timeout` of connecting (or of
the previous answer: Hypercorn's keep-alive timeout), and its body within `request_timeout`
after that (Quart's BODY_TIMEOUT, answered 408).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import h11
import hypercorn.protocol
from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig, Sockets
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.utils import wrap_app

from kinetic import kernels
from kinetic.progress import progress_printer
from kinetic.api.app import create_app
from kinetic.api.core import ServerConfig, ServerState, dumps, log
from kinetic.api.errors import ERROR_TYPES, error_body
from kinetic.api.offload import SWITCH_INTERVAL
from kinetic.engine.engine_config import EngineConfig, memory_summary
from kinetic.memory import resident_bytes

GRACEFUL_SECONDS = 5.0     # a stop: running requests' time to finish before they are cancelled
CANCELLED_SECONDS = 1.0    # then their time to end (a cancel reaches the engine at once)
STOP_SECONDS = 10.0        # the watchdog: a stop not done by then ends the process
RETRY_AFTER_SECONDS = 2    # told to a connection past the limit
REFUSED_SECONDS = 1.0      # a refused connection: what it sends is read and dropped this long,
REFUSED_BYTES = 64 << 10   # at most this much, so that closing it does not reset the answer
OLLAMA_PORT = 11434        # --ollama listens here too


@dataclass(frozen=True)
class ModelOptions:
    """What the server loads: the GGUF file, the engine's shape, an optional draft model."""

    path: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    dtype: str = "bfloat16"
    draft: str | None = None
    sampling: dict = field(default_factory=dict)   # --temp, --seed...: SamplingParams fields
                                                   # that replace the model's defaults
    chat_template: str | None = None               # --chat-template(-file): Jinja source
    pooling: str | None = None                     # --pooling: an embedding model's pooling
    mmproj: str | None = None                      # --mmproj: a vision projector
    kernel: str = "auto"                           # --kernel: weights.kernel_choice

    @property
    def model_id(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


def build_model(opts: ModelOptions, progress: Callable[[str], Callable[[int, int], None]]):
    """A kinetic.llm.Model (or EmbeddingModel) ready to serve: loaded and compiled
    (llm.open_model), then one short request, so that no client request waits for XLA (the
    engine thread is idle until then). The request has a grammar, so the token trie for
    grammar masks is built now too. progress(label) gives the callback of one stage."""
    from kinetic.engine.request import GenerationRequest
    from kinetic.grammar import compile_json_schema
    from kinetic.llm import open_model

    model = open_model(opts.path, opts.engine, dtype=opts.dtype, draft=opts.draft,
                       stage=progress, compile=True, pooling=opts.pooling, mmproj=opts.mmproj,
                       kernel=opts.kernel)
    tokenizer = model.tokenizer
    first = tokenizer.bos_id if tokenizer.bos_id is not None else 0
    if model.loaded.config.task != "text":
        model.encoder.pooled([[first]])   # the host side (pooling, head) once
        return model
    model.default_params = dataclasses.replace(model.default_params, **opts.sampling)
    if opts.chat_template is not None:
        model.use_chat_template(opts.chat_template)
    warm_up = GenerationRequest([first], max_tokens=2, logprobs=1,
                                grammar=compile_json_schema(True))
    for delta in model.engine.generate(warm_up):
        if delta.error:
            raise RuntimeError(delta.error)
    return model


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def run(config: ServerConfig, opts: ModelOptions) -> int:
    """Serve until SIGINT or SIGTERM. Returns the exit status (1 if the model failed to
    load or the address cannot be bound). The interpreter switches threads every
    offload.SWITCH_INTERVAL, so that the event loop waits little for the lock while workers
    parse requests."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
    setup_logging()
    return asyncio.run(_main(config, opts))


def setup_logging() -> None:
    """The server's log lines on stderr, as `kinetic: message`."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kinetic: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


async def _main(config: ServerConfig, opts: ModelOptions) -> int:

    loop = asyncio.get_running_loop()
    state = ServerState(config, opts.model_id)
    app = create_app(state)
    listening = listen(config)
    if listening is None:
        return 1
    hconfig, host, sockets, port = listening
    also = (f" and Ollama's API at http://{host}:{OLLAMA_PORT}/api"
            if len(sockets.insecure_sockets) > 1 else "")
    stop = asyncio.Event()
    status = [0]
    stop_began: list[float] = []

    def on_signal(sig: signal.Signals) -> None:
        if stop_began:
            exit_now(f"{sig.name} again: stopped at once", 1)
        stop_began.append(time.monotonic())
        start_watchdog(STOP_SECONDS)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    def progress(label: str) -> Callable[[int, int], None]:
        show = progress_printer(label)

        def update(done: int, total: int) -> None:
            state.loading = f"Loading model: {label} {100 * done // max(total, 1)}%"
            show(done, total)
        return update

    def ready(model) -> None:  # on the event loop: no request runs between these two lines
        task = model.loaded.config.task
        slots = (_count(model.engine.config.parallel, "slot") if task == "text" else
                 f"{'an embedding' if task == 'embedding' else 'a ranking'} model, pooling "
                 f"{model.pooling}")
        kernel = model.loaded.config.kernel
        on = kernels.describe(kernel)["backend"]
        how = {"ffi": f"kinetic's C++ kernel, {kernels.isa()} path",
               "pallas": f"the pallas kernel on {on} (weights quantized on the device"
                         f"{'; interpreted: slow, for tests' if on != 'gpu' else ''})",
               }.get(kernel, f"XLA on {on} (dequantized weights)")
        print(f"kinetic: weights multiplied by {how}", file=sys.stderr, flush=True)
        if task == "text":
            line = memory_summary(model.loaded.config, model.engine.config,
                                  os.path.getsize(model.loaded.file.path), resident_bytes())
            print(f"kinetic: {line}", file=sys.stderr, flush=True)
        print(f"kinetic: serving {state.model_id} at http://{host}:{port}/v1{also} (context "
              f"{model.n_ctx}, {slots}); Ctrl+C stops it", file=sys.stderr, flush=True)
        # what loading made lives as long as the server: out of the collector's sight, so
        # that a full collection (tens of ms with a model loaded, on the event loop's
        # thread or a worker's, holding the lock) does not walk it again and again
        gc.freeze()
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
    await _serve(app, hconfig, sockets, config.max_connections, stop, state.end_generations)
    if loader.is_alive():  # stopped while loading: XLA may be compiling; leave at once
        print("kinetic: stopped while loading", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(status[0])
    if state.model is not None:
        began = stop_began[0] if stop_began else time.monotonic()
        left = STOP_SECONDS - 1.0 - (time.monotonic() - began)
        # (an embedding model has no engine thread: its requests ran out with the server)
        if state.kind == "text" and not state.model.engine.close(timeout=max(left, 0.0)):
            exit_now("stopped, but the engine thread is stuck in a step; exiting without it", 1)
        print("kinetic: stopped", file=sys.stderr, flush=True)
    return status[0]


def listen(config: ServerConfig) -> tuple[HypercornConfig, str, Sockets, int] | None:
    """(Hypercorn's config, the host as a URL writes it, the bound sockets, the port) for
    `config` (a server's or a router's), or None, the reason printed, where the address
    cannot be bound."""
    hconfig = HypercornConfig()
    host = f"[{config.host}]" if ":" in config.host else config.host
    hconfig.keep_alive_timeout = config.request_timeout
    hconfig.read_timeout = None  # it would also cut clients quietly waiting for an answer
    sockets = _listen(hconfig, host, config)
    if sockets is None:
        return None
    return hconfig, host, sockets, sockets.insecure_sockets[0].getsockname()[1]


def _listen(hconfig: HypercornConfig, host: str, config: ServerConfig) -> Sockets | None:
    """The listening sockets: --port's, and with --ollama Ollama's port too (when --port is
    another). A port that cannot be had is one line on stderr and None."""
    ports = [config.port]
    if config.ollama and config.port != OLLAMA_PORT:
        ports.append(OLLAMA_PORT)
    listening: list = []
    for port in ports:
        hconfig.bind = [f"{host}:{port}"]
        try:
            listening += hconfig.create_sockets().insecure_sockets
        except OSError as e:
            for sock in listening:
                sock.close()
            whose = " (Ollama's port, for --ollama)" if port == OLLAMA_PORT else ""
            print(f"kinetic: cannot listen on {host}:{port}{whose}: {e.strerror or e}",
                  file=sys.stderr)
            return None
    hconfig.bind = [f"{host}:{p}" for p in ports]
    return Sockets([], listening, [])


def exit_now(message: str, status: int) -> None:
    """End the process at once, whatever its threads are doing."""
    print(f"kinetic: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(status)


def start_watchdog(seconds: float, exit: Callable[[str, int], None] = exit_now
                   ) -> threading.Event:
    """A daemon thread that ends the process with a message if it still runs `seconds` from
    now (it is started when a stop begins, and the process normally ends long before). Setting
    the returned event calls it off."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            exit(f"not stopped after {seconds:g} s (the engine thread may be stuck in a step); "
                 f"exiting now", 1)

    threading.Thread(target=watch, name="kinetic-watchdog", daemon=True).start()
    return done


class _Connection(TCPServer):
    """Hypercorn's connection handler, closing as soon as the client has: Hypercorn itself
    keeps a connection whose client left while idle until its keep-alive timeout, and here
    such a connection would hold one of the `max_connections` places all that time."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


async def _refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  max_connections: int) -> None:
    """Answer a connection past the limit 503 at once (before it has sent anything, or
    whatever it has sent) and close it."""
    body = dumps(error_body(f"the server already has {max_connections} open connections; "
                            f"try again later", "unavailable_error")).encode()
    head = ("HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_SECONDS}\r\n"
            "Connection: close\r\n\r\n").encode()
    try:
        async with asyncio.timeout(REFUSED_SECONDS):
            writer.write(head + body)
            writer.write_eof()
            await writer.drain()
            # closing with unread bytes would send a reset, which can destroy the answer in
            # the client's buffer before it reads it: read until it closes, or enough
            left = REFUSED_BYTES
            while left > 0 and (chunk := await reader.read(min(left, 1 << 16))):
                left -= len(chunk)
    except (OSError, TimeoutError):
        pass
    finally:
        writer.close()


# what a request h11 cannot read is told, by the status it hints (Hypercorn's own answer
# has no body at all)
UNREADABLE = {
    431: "the request's headers are larger than the server takes (16 KiB)",
    501: "the request's Transfer-Encoding is not one the server takes (only chunked)",
}
UNREADABLE_DEFAULT = ("the request is not valid HTTP/1.1: its request line or a header is "
                      "malformed (a path must be ASCII without spaces or control characters: "
                      "percent-encode other bytes)")


class _H11(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, answering a request it cannot parse (a non-ASCII byte
    or a NUL in the path, a malformed header) with an error in the OpenAI shape: Hypercorn's
    own answer is an empty 400 that no client can read a reason from. No route ran, so the
    path, and with it the dialect, is unknown: the OpenAI shape is the server's default."""

    async def _send_error_response(self, status_code: int) -> None:
        body = dumps(error_body(UNREADABLE.get(status_code, UNREADABLE_DEFAULT),
                                ERROR_TYPES.get(status_code, "invalid_request_error"))).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close"),
                   *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


# Hypercorn's ProtocolWrapper builds its HTTP/1.1 protocol by this module-level name
hypercorn.protocol.H11Protocol = _H11


def title_case_headers(app):
    """The ASGI app with its answers' header names written as llama-server writes them
    (Content-Type, Access-Control-Allow-Origin): ASGI hands them on lowercased, and scripts
    that read headers into a plain dict look them up by llama-server's spelling."""
    def title(name: bytes) -> bytes:
        return b"-".join(word.capitalize() for word in name.split(b"-"))

    async def asgi(scope, receive, send):
        async def send_titled(message):
            if message["type"] == "http.response.start":
                message = dict(message, headers=[(title(n), v)
                                                 for n, v in message.get("headers", ())])
            await send(message)
        await app(scope, receive, send_titled)
    return asgi


async def _serve(app, hconfig: HypercornConfig, sockets, max_connections: int,
                 stop: asyncio.Event, end_generations: Callable[[str], int]) -> None:
    """Hypercorn's worker loop (hypercorn.asyncio.run.worker_serve) with a count of open
    connections: each one past `max_connections` is refused at once (`_refuse`). Once `stop`
    is set and the grace period is over, `end_generations(message)` ends the answers still
    running with an error each (ServerState.end_generations), which they get
    CANCELLED_SECONDS to send before everything left is cancelled."""
    loop = asyncio.get_running_loop()
    asgi = wrap_app(title_case_headers(app), hconfig.wsgi_max_body_size, "asgi")
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
        if open_connections >= max_connections:
            await _refuse(reader, writer, max_connections)
            return
        open_connections += 1
        try:
            await _Connection(asgi, loop, hconfig, context, dict(lifespan_state), reader,
                              writer)
        except asyncio.CancelledError:
            pass  # stopping: a connection still open after the grace period
        finally:
            open_connections -= 1

    servers = [await asyncio.start_server(connection, backlog=hconfig.backlog, sock=sock)
               for sock in sockets.insecure_sockets]
    try:
        await stop.wait()
    finally:
        log.info("stopping: running requests get %g s to finish", GRACEFUL_SECONDS)
        await context.terminated.set()  # idle keep-alive connections close now
        for server in servers:
            server.close()
        if tasks:
            await asyncio.wait(set(tasks), timeout=GRACEFUL_SECONDS)
        # answers still running, streams and resumable streams included, end with an error
        # in their dialect's shape (an SSE error event, an NDJSON error line, a 503), so a
        # client can tell a stop from a network fault
        ended = end_generations(f"the server is stopping: the answer was cut after the "
                                f"{GRACEFUL_SECONDS:g} s that running requests get")
        others = asyncio.all_tasks() - {asyncio.current_task(), lifespan_task}
        if ended and others:   # connections, and resumable streams' tasks, which have none
            await asyncio.wait(others, timeout=CANCELLED_SECONDS)
        # what still runs is cancelled, which cancels its generation: the connections, and
        # the request tasks Quart starts beside them (cancelling a connection leaves those)
        running = asyncio.all_tasks() - {asyncio.current_task(), lifespan_task}
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=CANCELLED_SECONDS)
        for server in servers:
            await server.wait_closed()
        await lifespan.wait_for_shutdown()
        lifespan_task.cancel()
        try:
            await lifespan_task
        except asyncio.CancelledError:
            pass
