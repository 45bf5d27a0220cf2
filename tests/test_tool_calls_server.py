"""Tool calls through a real `kinetic serve` on Qwen2.5-Coder-0.5B (a Hermes-style template:
JSON calls in <tool_call>): calls read from the model's own replies, forced calls held by a
grammar (required, a named function, parallel), "none" hiding the tools, streamed calls in one
delta.tool_calls chunk, the conversation continued with the tool's result, and the official
openai client reading it all. Every call's arguments validate against the tool's schema. The
400s are in the bad-request table of tests/test_server.py; the formats of other families are
tests/test_tool_calls.py.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.conftest import real_model_file
from tests.serve_process import serving

pytestmark = pytest.mark.real_model

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}
TIME = {"type": "object", "properties": {"timezone": {"type": "string"}},
        "required": ["timezone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a timezone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("qwen25coder"), "-c", "4096", "-np", "2") as s:
        yield s


def chat(server, messages=ASK, **fields) -> dict:
    body = dict(messages=messages, temperature=0, max_tokens=80, tools=TOOLS)
    status, _, answer = server.request("POST", CHAT, body=dict(body, **fields))
    assert status == 200, answer
    return answer


def check_calls(message: dict, names=None) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each validated against its tool."""
    out = []
    for call in message["tool_calls"]:
        assert call["type"] == "function" and call["id"].startswith("call-")
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in (names or SCHEMAS)
        jsonschema.validate(args, SCHEMAS[name])
        out.append((name, args))
    return out


def test_auto_reads_the_models_own_call(server):
    choice = chat(server)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert check_calls(choice["message"])[0] == ("get_weather", {"city": "Paris", "unit": "c"})


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "Tell me a joke.",
                                      "What time is it in Tokyo?"])
def test_required_always_gives_a_valid_call(server, question):
    choice = chat(server, [{"role": "user", "content": question}],
                  tool_choice="required")["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert len(check_calls(choice["message"])) == 1


def test_named_function_is_the_one_called(server):
    choice = chat(server, tool_choice={"type": "function", "function": {"name": "get_time"}}
                  )["choices"][0]
    assert [n for n, _ in check_calls(choice["message"], ["get_time"])] == ["get_time"]


def test_parallel_calls_each_validate(server):
    ask = [{"role": "user", "content": "What is the weather in Paris and in Rome, and the "
                                       "time in Tokyo?"}]
    choice = chat(server, ask, tool_choice="required", parallel_tool_calls=True,
                  max_tokens=160)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert len(check_calls(choice["message"])) >= 1


def test_none_hides_the_tools(server):
    with_tools = chat(server)
    without = chat(server, tool_choice="none")
    assert without["usage"]["prompt_tokens"] < with_tools["usage"]["prompt_tokens"]
    message = without["choices"][0]["message"]
    assert "tool_calls" not in message and isinstance(message["content"], str)


def test_streamed_calls_come_whole_in_one_chunk(server):
    whole = chat(server, tool_choice="required")["choices"][0]["message"]
    events = server.stream("POST", CHAT, body=dict(
        messages=ASK, temperature=0, max_tokens=80, tools=TOOLS, tool_choice="required",
        stream=True))
    with_calls = [e for e in events if e["choices"][0]["delta"].get("tool_calls")]
    assert len(with_calls) == 1
    calls = with_calls[0]["choices"][0]["delta"]["tool_calls"]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert [c["function"] for c in calls] == [c["function"] for c in whole["tool_calls"]]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert content == ""


def test_conversation_continues_with_the_tool_result(server):
    messages = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1",
         "content": '{"temp_c": 18, "sky": "clear"}'}]
    choice = chat(server, messages, tool_choice="none")["choices"][0]
    assert choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["content"]


def test_openai_client(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=80)
    call = answer.choices[0].message.tool_calls[0]
    assert answer.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = client.chat.completions.create(model="m", messages=ASK, tools=TOOLS,
                                            tool_choice="required", temperature=0,
                                            max_tokens=80, stream=True)
    streamed = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(call.function.name, call.function.arguments)]
