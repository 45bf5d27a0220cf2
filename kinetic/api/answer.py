"""One answer made of the engine's deltas, whole or streamed: the fold and the stream writer of
every generating dialect (kinetic/api/dialects/: openai.py, llama_server.py, ollama.py).

`core.generation` yields one request's deltas (kinetic/engine/request.py: Delta). A whole
answer folds them: `fold` gathers the text, the token ids and the log-probability entries and
keeps the last delta (finish reason, stop word, usage), or raises the engine's error. A
streamed answer writes the same deltas: `stream` frames each object that the dialect's
`pieces(delta)` makes of a delta (those of the last delta end with the dialect's final
chunk) as a server-sent event (`sse_event`) or an NDJSON line (`ndjson_line`); an engine
error ends the stream with one more, in the dialect's error shape, and a finished one ends
with the dialect's `end` marker, if it has one (OpenAI's `data: [DONE]`). Both feed the
request's receipt, if it asked for one (kinetic/api/receipt.py), every delta they take.

A dialect gives only its shapes: its field names, its framing, its final chunk, its error.
"""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Iterable

from kinetic.api.core import dumps
from kinetic.api.errors import APIError, engine_error
from kinetic.engine.request import Delta, TokenLogprob


@dataclass(frozen=True)
class Folded:
    """A whole answer's pieces."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob]
    last: Delta        # the finish reason, the stop word, the usage


async def fold(deltas: AsyncIterator[Delta], receipt=None) -> Folded:
    """Every delta of `deltas` (closed at the end, or on cancellation) gathered into one
    answer; `receipt` (a ReceiptMaker) is fed each. Raises the engine's error as an APIError
    (errors.engine_error) when the answer ended with one, or with nothing."""
    text, tokens, lps, last = [], [], [], None
    async with aclosing(deltas):
        async for d in deltas:
            text.append(d.text)
            tokens.extend(d.token_ids)
            lps.extend(d.logprobs)
            last = d
            if receipt is not None:
                receipt.feed(d)
    if last is None or last.finish_reason == "error":
        raise engine_error(last)
    return Folded("".join(text), tokens, lps, last)


def sse_event(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


def ndjson_line(obj: Any) -> str:
    return dumps(obj) + "\n"


async def stream(deltas: AsyncIterator[Delta], pieces: Callable[[Delta], Iterable[Any]],
                 frame: Callable[[Any], str], error: Callable[[APIError], Any], *,
                 receipt=None, end: str | None = None) -> AsyncIterator[str]:
    """The stream of one answer: `frame(obj)` for each object `pieces(delta)` makes of each
    delta (made one at a time, as they are sent), then `end` if given. A delta with finish
    reason "error" ends it at once with `frame(error(e))`, e the engine's APIError. `receipt`
    is fed each other delta before its pieces are made, so the last one can carry it.
    Closing the stream (the client went away) closes `deltas`, which cancels the generation."""
    async with aclosing(deltas):
        async for d in deltas:
            if d.finish_reason == "error":
                yield frame(error(engine_error(d)))
                return
            if receipt is not None:
                receipt.feed(d)
            for obj in pieces(d):
                yield frame(obj)
    if end is not None:
        yield end
