"""What every embedding and rerank route shares, whatever its dialect: reading the inputs,
their limits, running them through the model's encoder off the event loop, and counting them
in /metrics. The routes (dialects/openai.py: /v1/embeddings, /v1/rerank; dialects/
llama_server.py: /embedding, /embeddings) only read their own fields and write their own
answer shapes.

Limits: at most MAX_INPUTS texts (or documents) a request, each 1 to n_ctx tokens; a token id
must be in the vocabulary. An input over the context is a 400 naming its index, unless the
request asks to truncate it (then its first n_ctx tokens run).

Fairness: `encode` runs a request's inputs a piece at a time, the inputs of one encoder step
(at most step_tokens rows, or one text longer than that), and the requests take turns piece
by piece (`Turns`, round-robin), so a one-token request behind a 256 x 512-token one waits
for one step of it, not for all 256.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable
from weakref import WeakKeyDictionary

import numpy as np

from kinetic import kernels
from kinetic.api.core import JSONText, ServerState
from kinetic.api.errors import APIError, bad_request

MAX_INPUTS = 256

Item = str | list[int | str]   # a text, token ids, or ids and texts in one sequence


def parse_inputs(value: Any, param: str) -> list[Item]:
    """An embedding input: a string, a list of strings, a list of token ids (texts may stand
    among the ids, as llama-server takes them: [12, 34, "text", 56] is one input), or a list
    of such lists (strings and id lists may mix). 400 for anything else, an empty list or
    string, or more than MAX_INPUTS."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and any(_is_id(t) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(f"{param} must be a string, a list of strings, a list of token ids "
                          f"or a list of such lists", param)
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    if len(items) > MAX_INPUTS:
        raise bad_request(f"{param} has {len(items)} inputs; at most {MAX_INPUTS} a request",
                          param)
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{param}[{i}] is an empty string", param)
        elif not (isinstance(item, list) and any(_is_id(t) for t in item)
                  and all(_is_id(t) or (isinstance(t, str) and t) for t in item)):
            raise bad_request(f"{param}[{i}] must be a non-empty string or a non-empty list of "
                              f"token ids (non-empty texts may stand among them)", param)
    return items


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def parse_documents(value: Any, param: str = "documents") -> list[str]:
    """Rerank documents: strings or objects with a string `text`, 1 to MAX_INPUTS."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of strings (or of objects with "
                          f"text)", param)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"{param} has {len(value)} documents; at most {MAX_INPUTS} a request",
                          param)
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict):
            d = d.get("text")
        if not isinstance(d, str):
            raise bad_request(f"{param}[{i}] must be a string or an object with a string text",
                              param)
        out.append(d)
    return out


def token_ids(state: ServerState, items: list[Item], param: str,
              truncate: bool = False) -> list[list[int]]:
    """Each input's tokens (texts tokenized as llama-server does), checked against the
    vocabulary and the context."""
    model = state.require_model()
    vocab, n_ctx = model.config.vocab_size, model.n_ctx
    out = []
    for i, item in enumerate(items):
        ids = model.input_ids(item)
        if not ids:
            raise bad_request(f"{param}[{i}] has no tokens", param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}[{i}] has token id {bad[0]}, outside the vocabulary "
                              f"(0..{vocab - 1})", param)
        if len(ids) > n_ctx:
            if not truncate:
                raise APIError(400, f"{param}[{i}] is too large: {len(ids)} tokens; the context "
                               f"holds {n_ctx} (send truncate: true to cut it)", param=param,
                               code="context_length_exceeded")
            ids = ids[:n_ctx]
        out.append(ids)
    return out


async def encode(state: ServerState, texts: list[list[int]], run: Callable[[list], list]) -> list:
    """run(texts) (one of the model's encoder methods: pooled, hidden, scores) in a worker
    thread a piece at a time, the texts of one encoder step (Encoder.batches), taking turns
    with the pieces of the other requests (`Turns`): a one-text request waits for at most one
    step of a 256-text one, not for all of it. The pieces are the steps the whole list would
    run, so the answers are the same bits. Counted in /metrics as one request of sum(len)
    prompt tokens."""
    encoder = state.require_model().encoder
    state.activity.encoding += 1
    began = time.perf_counter()
    try:
        return await in_turns(_turns_of(encoder), encoder.batches(texts), texts, run)
    finally:
        state.activity.encoding -= 1
        state.activity.encoded(sum(len(t) for t in texts), max(len(t) for t in texts),
                               time.perf_counter() - began)


class Turns:
    """Round-robin turns on the event loop: one turn runs at a time, the requests waiting
    take theirs in the order they asked, and a request with more to do asks again after its
    turn, behind those already waiting. A request cancelled while it waits leaves the line;
    one cancelled holding the turn hands it on."""

    def __init__(self) -> None:
        self._line: deque[asyncio.Future] = deque()
        self._busy = False

    @asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        if self._busy:
            handed = asyncio.get_running_loop().create_future()
            self._line.append(handed)
            try:
                await handed
            except asyncio.CancelledError:
                if handed.done() and not handed.cancelled():   # it had just been handed over
                    self._hand_on()
                raise   # (a cancelled future left in the line is skipped by _hand_on)
        self._busy = True
        try:
            yield
        finally:
            self._hand_on()

    @property
    def waiting(self) -> int:
        return sum(not f.done() for f in self._line)

    def _hand_on(self) -> None:
        while self._line:
            handed = self._line.popleft()
            if not handed.done():
                handed.set_result(None)
                return   # still busy: the turn goes to `handed`
        self._busy = False


_TURNS: WeakKeyDictionary[Any, Turns] = WeakKeyDictionary()   # one line per encoder


def _turns_of(encoder: Any) -> Turns:
    turns = _TURNS.get(encoder)
    if turns is None:
        turns = _TURNS[encoder] = Turns()
    return turns


async def in_turns(turns: Turns, pieces: list[list[int]], texts: list,
                   run: Callable[[list], list]) -> list:
    """run over texts, one piece (a list of indices into texts) a turn, each in a worker
    thread; the results in the texts' order."""
    out: list = [None] * len(texts)
    for piece in pieces:
        async with turns.turn():
            results = await asyncio.to_thread(run, [texts[i] for i in piece])
        for i, r in zip(piece, results):
            out[i] = r
    return out


def flag(body: dict[str, Any], name: str) -> bool:
    """A true/false field, false when absent (and a 400 for anything but a JSON boolean)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value


def vector_json(v: np.ndarray, encoding: str = "float") -> JSONText | list[float] | str:
    """A vector as the OpenAI API writes it: a list of floats (as JSON text written in C++
    where the kernels are built: the same text as json.dumps of the list), or base64 of its
    little-endian float32 bytes."""
    v = np.asarray(v, np.float32)
    if encoding == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    text = kernels.json_floats(v)
    return v.tolist() if text is None else JSONText(text)


def usage(n_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
