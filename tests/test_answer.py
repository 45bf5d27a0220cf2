"""kinetic/api/answer.py over hand-made deltas: the fold's pieces, the stream's framing (SSE
and NDJSON), an engine error mid-stream and at the end of a fold, the end marker, the receipt
fed every delta, and the generation closed when the client leaves. The dialects' shapes
over a real model are tests/test_server.py, tests/test_llama_server_api.py and
tests/test_ollama_api.py."""

from __future__ import annotations

import asyncio

import pytest

from kinetic.api.answer import fold, ndjson_line, sse_event, stream
from kinetic.api.errors import APIError
from kinetic.engine.request import Delta, TokenLogprob, Usage

A = TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5)))
B = TokenLogprob(7, -0.25, ())
DONE = Delta((8,), "!", finish_reason="stop", stop_word=None, usage=Usage(3, 3, 0, 1))
ANSWER = [Delta((5,), "Hé", (A,)), Delta((7,), "llo", (B,)), DONE]


class Deltas:
    """An async generator of `deltas` that remembers whether it was closed."""

    def __init__(self, deltas: list[Delta]):
        self.deltas, self.closed = deltas, False

    async def __call__(self):
        try:
            for d in self.deltas:
                yield d
        finally:
            self.closed = True


class Receipt:
    def __init__(self):
        self.fed: list[Delta] = []

    def feed(self, d: Delta) -> None:
        self.fed.append(d)


def run(coro):
    return asyncio.run(coro)


async def collect(events) -> list[str]:
    return [e async for e in events]


def test_fold_gathers_the_pieces_and_keeps_the_last_delta():
    source, receipt = Deltas(ANSWER), Receipt()
    whole = run(fold(source(), receipt))
    assert whole.text == "Héllo!" and whole.tokens == [5, 7, 8]
    assert whole.logprobs == [A, B] and whole.last is DONE
    assert receipt.fed == ANSWER and source.closed


@pytest.mark.parametrize("deltas, status", [
    ([Delta((5,), "a"), Delta(finish_reason="error", error="boom")], 500),
    ([Delta(finish_reason="error", error="budget", busy=True)], 503),
    ([], 500),   # the engine stopped without a word
])
def test_fold_raises_the_engine_error(deltas, status):
    with pytest.raises(APIError) as e:
        run(fold(Deltas(deltas)()))
    assert e.value.status == status


def test_stream_frames_each_piece_then_the_end():
    receipt = Receipt()
    events = run(collect(stream(Deltas(ANSWER)(), lambda d: [{"t": d.text}] if d.text else [],
                                sse_event, APIError.body, receipt=receipt,
                                end="data: [DONE]\n\n")))
    assert events == ['data: {"t":"Hé"}\n\n', 'data: {"t":"llo"}\n\n', 'data: {"t":"!"}\n\n',
                      "data: [DONE]\n\n"]
    assert receipt.fed == ANSWER


def test_an_engine_error_ends_the_stream_in_the_dialects_shape():
    deltas = [Delta((5,), "a"), Delta(finish_reason="error", error="boom")]
    receipt = Receipt()
    lines = run(collect(stream(Deltas(deltas)(), lambda d: [{"response": d.text}], ndjson_line,
                               lambda e: {"error": e.message}, receipt=receipt, end="never")))
    assert lines == ['{"response":"a"}\n', '{"error":"boom"}\n']
    assert receipt.fed == deltas[:1]   # no receipt of a failed answer


def test_pieces_are_made_one_at_a_time_as_they_are_sent():
    made = []

    def pieces(d: Delta):
        for i in range(2):
            made.append(i)
            yield {"i": i}

    async def first_event() -> tuple[str, list]:
        events = stream(Deltas(ANSWER[:1])(), pieces, sse_event, APIError.body)
        event = await anext(events)
        await events.aclose()
        return event, list(made)
    assert run(first_event()) == ('data: {"i":0}\n\n', [0])


def test_leaving_the_stream_closes_the_generation():
    source = Deltas(ANSWER)

    async def leave_after_one():
        events = stream(source(), lambda d: [{"t": d.text}], sse_event, APIError.body)
        await anext(events)
        await events.aclose()
    run(leave_after_one())
    assert source.closed
