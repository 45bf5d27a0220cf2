"""The HTTP listener `kinetic serve` and the router share: Hypercorn's connection handler
under an accept loop of kinetic's (a connection limit, answered at once), requests h11
cannot parse answered in the OpenAI shape, header names as llama-server writes them, and a
stop that always stops (kinetic/api/server.py's module docstring says how). It imports no
JAX: a router (kinetic/router/) runs on it without one.

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
import logging
import os
import sys
import threading
from typing import Callable

import h11
import hypercorn.protocol
from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HypercornConfig, Sockets
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.utils import wrap_app

from kinetic.api.core import ServerConfig, dumps, log
from kinetic.api.errors import ERROR_TYPES, error_body

GRACEFUL_SECONDS = 5.0     # a stop: running requests' time to finish before they are cancelled
CANCELLED_SECONDS = 1.0    # then their time to end (a cancel reaches the engine at once)
STOP_SECONDS = 10.0        # the watchdog: a stop not done by then ends the process
RETRY_AFTER_SECONDS = 2    # told to a connection past the limit
REFUSED_SECONDS = 1.0      # a refused connection: what it sends is read and dropped this long,
REFUSED_BYTES = 64 << 10   # at most this much, so that closing it does not reset the answer
OLLAMA_PORT = 11434        # --ollama listens here too


def setup_logging() -> None:
    """The server's log lines on stderr, as `kinetic: message`."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("kinetic: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


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
