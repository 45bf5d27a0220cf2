"""Reasoning through a real `kinetic serve`: a tiny random-weight model with Qwen3's chat
template (which thinks in <think> blocks). Its words are nonsense, so a GBNF grammar writes
the reply; the server must hand the thinking back as reasoning_content (streamed as
delta.reasoning_content) and only the answer as content. A forced tool call after thinking
is read as a call. The splitting itself, at every split position, is tests/test_reasoning.py.
"""

from __future__ import annotations

import json

import pytest

from tests.serve_process import serving
from tests.tiny_models import DATA, vocab_file, write_tiny_model

CHAT = "/v1/chat/completions"
REPLY = 'root ::= "<think>\\nThe user says hi.\\nI greet back.\\n</think>\\n\\nHello there!"'
ASK = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = (DATA / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    path = write_tiny_model(tmp_path_factory.mktemp("qwen3") / "tiny-qwen3.gguf", "qwen3",
                            context_length=1024, chat_template=template)
    with serving(str(path), "-c", "2048", "-np", "2") as s:
        yield s


def chat(server, **fields) -> dict:
    body = dict(messages=ASK, temperature=0, max_tokens=60)
    status, _, answer = server.request("POST", CHAT, body=dict(body, **fields))
    assert status == 200, answer
    return answer["choices"][0]


def test_thinking_comes_apart_from_the_answer(server):
    choice = chat(server, grammar=REPLY)
    assert choice["message"]["reasoning_content"] == "The user says hi.\nI greet back."
    assert choice["message"]["content"] == "Hello there!"
    assert choice["finish_reason"] == "stop"


def test_streamed_thinking_is_reasoning_content(server):
    events = server.stream("POST", CHAT, body=dict(messages=ASK, temperature=0, max_tokens=60,
                                                   grammar=REPLY, stream=True))
    deltas = [e["choices"][0]["delta"] for e in events]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("The user says hi.\nI greet back.", "Hello there!")
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning_content") for d in deltas[first_content:])


def test_without_think_tags_all_is_content(server):
    choice = chat(server, grammar='root ::= "Just an answer."',
                  chat_template_kwargs={"enable_thinking": False})
    assert choice["message"]["content"] == "Just an answer."
    assert "reasoning_content" not in choice["message"]


def test_forced_call_on_a_thinking_template(server):
    """Qwen3's template knows <think>, so the forced-call grammar starts with an optional think
    block; a bias on the tokens of "<tool_call>" (plain text in this vocabulary) takes the
    random model straight to the call, which the grammar then holds to the tool's schema: one
    valid call, read back as a call."""
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(vocab_file("qwen2")).metadata)
    bias = {str(t): 50 for t in tok.encode("<tool_call>", add_special=False)}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}}]
    choice = chat(server, tools=tools, tool_choice="required", max_tokens=200,
                  logit_bias=bias)
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert list(args) == ["city"] and len(args["city"]) <= 8
