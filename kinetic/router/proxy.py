"""A request passed to its model's worker, and the worker's answer streamed back as it comes.

The worker's own checks run on it (its route, its body rules, its errors); the router
replaces the client's credentials with the worker's key and drops Origin and Host (the
router checked them). The answer keeps its status and content type; its body is read in a
worker thread (http.client) in pieces as they arrive, so a stream stays a stream. A client
that goes away closes the connection to the worker, which cancels the generation there."""

from __future__ import annotations

import asyncio
import http.client
import threading
from typing import AsyncIterator
from urllib.parse import quote

from quart import Response, request

from kinetic.router.workers import Worker

PASSED_HEADERS = ("Content-Type", "Accept", "X-Conversation-Id", "Last-Event-ID")
ANSWER_HEADERS = ("Content-Type", "Retry-After", "Cache-Control", "X-Conversation-Id")
PIECE_BYTES = 64 * 1024


async def forward(worker: Worker, body: bytes) -> Response:
    """`request` (its method, path, query and `body`) sent to `worker`; its answer."""
    # the path as it came, percent-encoded again (Quart hands it on decoded: a space or a
    # non-ASCII letter in it cannot go on an HTTP request line), and the query as it came
    path = quote(request.path, safe="/:@!$&'()*+,;=~")
    if request.query_string:
        path += "?" + request.query_string.decode("latin-1")
    headers = {h: request.headers[h] for h in PASSED_HEADERS if h in request.headers}
    headers["Authorization"] = f"Bearer {worker.key}"
    method = request.method   # read here: the thread has no request context
    loop = asyncio.get_running_loop()
    pieces: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()

    def run() -> None:   # in a thread: http.client blocks
        conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=3600)
        try:
            conn.request(method, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            head = (resp.status, [(h, resp.getheader(h)) for h in ANSWER_HEADERS
                                  if resp.getheader(h) is not None])
            loop.call_soon_threadsafe(pieces.put_nowait, head)
            while not gone.is_set():
                data = resp.read1(PIECE_BYTES)
                if not data:
                    break
                loop.call_soon_threadsafe(pieces.put_nowait, data)
        except Exception as e:  # noqa: BLE001 - every failure is the client's 502, said
            loop.call_soon_threadsafe(pieces.put_nowait, e)
        finally:
            conn.close()
            loop.call_soon_threadsafe(pieces.put_nowait, None)

    worker.busy += 1
    thread = threading.Thread(target=run, name="kinetic-proxy", daemon=True)
    thread.start()
    first = await pieces.get()
    if isinstance(first, Exception) or first is None:
        worker.busy -= 1
        from kinetic.api.errors import APIError
        raise APIError(502, f"model {worker.model.name}: its worker did not answer "
                       f"({first or 'no answer'})")
    status, answer_headers = first

    async def body_pieces() -> AsyncIterator[bytes]:
        try:
            while True:
                piece = await pieces.get()
                if piece is None or isinstance(piece, Exception):
                    return
                yield piece
        finally:
            gone.set()
            worker.busy -= 1

    resp = Response(body_pieces(), status=status, headers=dict(answer_headers))
    resp.timeout = None   # a stream lasts as long as its generation
    return resp
