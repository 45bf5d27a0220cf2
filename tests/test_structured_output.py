"""Structured output through a real `kinetic serve` on SmolLM2: response_format (json_schema,
json_object), grammar, and llama-server's json_schema/grammar on /completion. Every finished
constrained answer must parse and validate (the jsonschema package), streamed or not, on a
sample of the real-world JSONSchemaBench schemas too. The 400s are in the bad-request tables
of tests/test_server.py and tests/test_llama_server_api.py.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from kinetic.grammar import UnsupportedSchema, compile_json_schema
from tests.conftest import real_model_file
from tests.serve_process import serving

pytestmark = pytest.mark.real_model

CHAT = "/v1/chat/completions"
BENCH = os.path.join(os.path.dirname(__file__), "data", "jsonschemabench")
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("smollm2"), "-c", "8192", "-np", "4") as s:
        yield s


def chat(server, content: str, **fields):
    body = dict(messages=[{"role": "user", "content": content}], temperature=0, max_tokens=120)
    status, _, answer = server.request("POST", CHAT, body=dict(body, **fields))
    assert status == 200, answer
    return answer["choices"][0]


def chat_streamed(server, content: str, **fields) -> tuple[str, str]:
    body = dict(messages=[{"role": "user", "content": content}], temperature=0,
                max_tokens=120, stream=True, **fields)
    text, reason = [], None
    for event in server.stream("POST", CHAT, body=body):
        choice = event["choices"][0]
        text.append(choice["delta"].get("content") or "")
        reason = choice["finish_reason"] or reason
    return "".join(text), reason


def test_json_schema_answer_validates_streamed_or_not(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    choice = chat(server, "Give me a person.", response_format=fmt)
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)
    streamed, reason = chat_streamed(server, "Give me a person.", response_format=fmt)
    assert (streamed, reason) == (choice["message"]["content"], "stop")


def test_json_object_is_a_json_object(server):
    # as OpenAI's JSON mode: an object, never another JSON value (SmolLM2 greedy may nest
    # objects until max_tokens: a finished answer parses, an unfinished one is an object's
    # start)
    choice = chat(server, "What is 2+2? Reply with a JSON object with one key, answer.",
                  response_format={"type": "json_object"})
    content = choice["message"]["content"]
    assert content.lstrip().startswith("{"), content
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def test_gbnf_grammar_holds_the_answer(server):
    for question in ("Is the sky blue?", "Is fire cold?", "Write a poem."):
        choice = chat(server, question, grammar='root ::= "yes" | "no"')
        assert choice["message"]["content"] in ("yes", "no")
        assert choice["finish_reason"] == "stop"
    pattern = 'root ::= [0-9]{3} "-" [A-Z]{2,4}'
    choice = chat(server, "Give me a code.", grammar=pattern)
    assert re.fullmatch(r"[0-9]{3}-[A-Z]{2,4}", choice["message"]["content"])


def test_completions_take_the_shape_too(server):
    status, _, answer = server.request("POST", "/v1/completions", body={
        "prompt": "A person as JSON:", "temperature": 0, "max_tokens": 100,
        "response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}})
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["choices"][0]["text"]), PERSON)
    status, _, answer = server.request("POST", "/completion", body={
        "prompt": "A person as JSON:", "temperature": 0, "n_predict": 100,
        "json_schema": PERSON})
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["content"]), PERSON)
    status, _, answer = server.request("POST", "/completion", body={
        "prompt": "Answer yes or no: is water wet?", "n_predict": 8,
        "grammar": 'root ::= ("yes" | "no") "."'})
    assert status == 200 and answer["content"] in ("yes.", "no."), answer
    assert answer["generation_settings"]["grammar"] == 'root ::= ("yes" | "no") "."'


def bench_sample(every: int = 25) -> list[tuple[str, dict]]:
    """Every `every`th JSONSchemaBench schema that compiles."""
    out = []
    for name in sorted(os.listdir(BENCH))[::every]:
        with open(os.path.join(BENCH, name)) as f:
            schema = json.load(f)
        try:
            compile_json_schema(schema)
        except UnsupportedSchema:
            continue
        out.append((name, schema))
    return out


def test_real_world_schemas_answers_all_validate(server):
    """Constrained generation on JSONSchemaBench schemas, four at a time: every answer that
    finished (not cut by max_tokens) parses and validates."""
    sample = bench_sample()
    assert len(sample) >= 6

    def run(item):
        name, schema = item
        choice = chat(server, "Fill in an example JSON document for this schema:\n"
                      + json.dumps(schema)[:1500], max_tokens=200,
                      response_format={"type": "json_schema", "json_schema": {
                          "name": "doc", "schema": schema}})
        return name, schema, choice
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, sample))
    finished = 0
    for name, schema, choice in results:
        if choice["finish_reason"] != "stop":
            assert choice["finish_reason"] == "length", (name, choice)
            continue
        finished += 1
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert finished >= len(sample) // 2, [(n, c["finish_reason"]) for n, _, c in results]
