"""Resumable streams: llama-server's X-Conversation-Id.

A streamed answer whose request carries `X-Conversation-Id: ID` is recorded under ID as the
bytes of its server-sent events. The generation runs in a task of its own, so that it goes on
when the client goes away; the client's answer and every later `GET /v1/stream?conv_id=ID&
from=N` read the recording from byte N and follow it live until the answer ends. `DELETE
/v1/stream?conv_id=ID` stops the generation and forgets the recording. A new stream under a
running ID replaces it (the old generation is stopped), as in llama-server.

Everything a client controls is bounded: the ID's length, the recordings kept (the oldest
finished one goes first; a server holding MAX_SESSIONS running ones refuses another with 503),
the bytes of one recording (past MAX_BYTES the recording stops with an error event and the
generation is stopped), and how long a finished one is kept (KEEP_SECONDS).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import AsyncIterator

MAX_ID_CHARS = 256
MAX_SESSIONS = 64
MAX_BYTES = 32 << 20
KEEP_SECONDS = 600.0


class Session:
    """One recorded stream: its bytes so far, and whether it has ended."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.done = False
        self.ended_at = 0.0
        self.task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    def append(self, chunk: bytes) -> None:
        self.data += chunk
        self._wake()

    def finish(self) -> None:
        if not self.done:
            self.done, self.ended_at = True, time.monotonic()
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def read(self, start: int) -> AsyncIterator[bytes]:
        """The recording from byte `start`, then what is added, until it ends."""
        at = max(start, 0)
        while True:
            changed = self._changed
            if at < len(self.data):
                chunk = bytes(self.data[at:])
                at += len(chunk)
                yield chunk
                continue
            if self.done:
                return
            await changed.wait()


class StreamStore:
    """The server's recordings, by conversation id."""

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def get(self, conv_id: str) -> Session | None:
        self._expire()
        return self._sessions.get(conv_id)

    def record(self, conv_id: str, events: AsyncIterator[str]) -> Session:
        """Start running `events` (an answer's SSE events) into a new recording under
        `conv_id`, replacing (and stopping) one there. Raises LookupError when MAX_SESSIONS
        recordings are running."""
        self.stop(conv_id)
        self._expire()
        if len(self._sessions) >= MAX_SESSIONS:
            finished = [k for k, s in self._sessions.items() if s.done]
            if not finished:
                raise LookupError(f"{MAX_SESSIONS} resumable streams are running")
            del self._sessions[finished[0]]
        session = Session()
        self._sessions[conv_id] = session
        session.task = asyncio.get_running_loop().create_task(_pump(session, events))
        return session

    def stop(self, conv_id: str) -> bool:
        """Stop a recording's generation and forget it; False if there was none."""
        session = self._sessions.pop(conv_id, None)
        if session is None:
            return False
        if session.task is not None and not session.task.done():
            session.task.cancel()
        session.finish()
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items()
                    if s.done and now - s.ended_at > KEEP_SECONDS]:
            del self._sessions[key]


async def _pump(session: Session, events: AsyncIterator[str]) -> None:
    """Run the answer's events into the recording. Closing `events` (at its end, on a stop,
    or past MAX_BYTES) ends the generation, as a client going away does."""
    try:
        async for event in events:
            chunk = event.encode()
            if len(session.data) + len(chunk) > MAX_BYTES:
                session.append(b'data: {"error": {"message": "the stream is longer than '
                               b'a resumable stream may be", "type": "server_error", '
                               b'"param": null, "code": null}}\n\n')
                break
            session.append(chunk)
    finally:
        await events.aclose()
        session.finish()
