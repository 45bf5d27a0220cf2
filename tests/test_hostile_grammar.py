"""Hostile grammars through the API (issue 9): the 100,000-string enum is a 400 within
seconds while a normal request beside it answers; a grammar whose masks overrun the engine's
budget during generation ends alone with a 503 (an error event when streamed), and the
server serves on. In-process app on a tiny random-weight model with a real 151k-token
vocabulary (tests/app_client.py).
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from kinetic.engine import grammar_step
from kinetic.engine.engine import Engine
from tests.app_client import ERROR_FIELDS, assert_error_shape, in_process_app


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("hostile")) as client:
        yield client


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


NORMAL = body(prompt="hi", n_predict=4, temperature=0)


def test_huge_enum_is_refused_while_a_normal_request_answers(app):
    assert app.post("/completion", NORMAL)[0] == 200   # compiled and warm
    hostile = body(prompt="hi", n_predict=4,
                   json_schema={"enum": [f"v{i}" for i in range(100_000)]})
    answers = {}

    def send(name, data):
        answers[name] = app.post("/completion", data)

    refused = threading.Thread(target=send, args=("hostile", hostile))
    started = time.monotonic()
    refused.start()
    send("normal", NORMAL)
    refused.join()
    # a bound on a hang, not a timing assertion: the refusal must come, not hang the server
    assert time.monotonic() - started < 60
    status, answer = answers["hostile"]
    err = assert_error_shape(status, answer, "100,000-string enum")
    assert status == 400 and err["param"] == "json_schema"
    assert answers["normal"][0] == 200 and answers["normal"][1]["content"] is not None


def test_grammar_over_its_step_budget_is_a_503_alone(app, monkeypatch):
    """prepare_grammar passes (patched out, as for a grammar cheap at its start), then every
    piece of grammar work in the engine overruns (a budget already past): 503 for this
    request, whole or streamed, and the next normal request answers as before."""
    want = app.post("/completion", NORMAL)[1]["content"]
    monkeypatch.setattr(Engine, "prepare_grammar", lambda self, grammar: None)
    monkeypatch.setattr(grammar_step, "MASK_BUDGET_SECONDS", -1.0)
    grammar = 'root ::= "k" [a-z]+'
    status, answer = app.post("/completion", body(prompt="hi", n_predict=4, grammar=grammar))
    assert status == 503, (status, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == ERROR_FIELDS
    assert answer["error"]["type"] == "unavailable_error"
    assert "grammar" in answer["error"]["message"]
    status, stream = app.post("/completion", body(prompt="hi", n_predict=4, grammar=grammar,
                                                  stream=True))
    assert status == 200
    events = [json.loads(line[6:]) for line in stream.decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1]["error"]["type"] == "unavailable_error"
    monkeypatch.undo()
    assert app.post("/completion", NORMAL)[1]["content"] == want


@pytest.mark.parametrize("grammar, words", [
    # a million one-byte rules: 15 s of a parse worker each before MAX_RULES
    ('root ::= x{0,1000000}\nx ::= "a"', "more than 65536 rules"),
    ('root ::= [a-z]{0,1000000}', "more than 65536 rules"),
    # no text at all: an answer under it would end at once, unparsed, as a "stop"
    ('root ::= [^\\x00-\\U0010FFFF]', "matches no text"),
    ('root ::= [\\uD800]', "matches no text"),
    ('root ::= "ab" [^\\x00-\\U0010FFFF]', "matches no text"),
])
def test_a_grammar_too_large_to_lower_or_matching_nothing_is_a_400(app, grammar, words):
    for path, fields in (("/completion", dict(prompt="hi", n_predict=4)),
                         ("/v1/chat/completions", dict(messages=[{"role": "user",
                                                                  "content": "hi"}],
                                                       max_tokens=4))):
        status, answer = app.post(path, body(grammar=grammar, **fields))
        assert status == 400, (path, answer)
        assert words in assert_error_shape(status, answer, path)["message"], answer


def test_an_alternative_that_matches_nothing_is_never_taken(app):
    """root ::= "a" | "b" x, x matching nothing: the "b" way is cut at compile time, so
    every answer is "a" (before, "b" was allowed and the answer ended there, unparsed)."""
    for seed in range(4):
        status, answer = app.post("/completion", body(
            prompt="hi", n_predict=4, temperature=1.0, seed=seed,
            grammar='root ::= "a" | "b" x\nx ::= [^\\x00-\\U0010FFFF]'))
        assert status == 200 and answer["content"] == "a", answer
