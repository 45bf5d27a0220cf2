"""The official `ollama` client against a real `kinetic serve` over HTTP, on
Qwen2.5-Coder-0.5B (a Hermes-style template: tools, no thinking): list, ps, show, chat and
generate streamed and not, options, format, tool calls with their arguments as objects
(validated against the tool's schema), and the conversation continued from a tool's result.
An app written for Ollama needs only its host pointed here. The routes' edges are
tests/test_ollama_api.py.
"""

from __future__ import annotations

import json

import jsonschema
import ollama
import pytest

from tests.conftest import real_model_file
from tests.serve_process import serving

pytestmark = pytest.mark.real_model

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 80}


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("qwen25coder"), "-c", "4096", "-np", "2") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def test_list_ps_and_show(client):
    (listed,) = client.list().models
    assert listed.model == "qwen2.5-coder-0.5b-instruct-q4_k_m:latest"
    assert listed.details.family == "qwen2" and listed.details.quantization_level == "Q4_K_M"
    assert listed.details.parameter_size.endswith("M") and len(listed.digest) == 64
    (running,) = client.ps().models
    assert running.model == listed.model and running.context_length == 2048
    shown = client.show(listed.model)
    assert shown.capabilities == ["completion", "tools"]
    assert "<tool_call>" in shown.template
    assert shown.modelinfo["general.architecture"] == "qwen2"


def test_chat_and_generate_streamed_equal_whole(client):
    ask = [{"role": "user", "content": "Say hello in French."}]
    whole = client.chat("qwen", messages=ask, options=GREEDY)
    parts = list(client.chat("qwen", messages=ask, options=GREEDY, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert "bonjour" in whole.message.content.lower()
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count
    answer = client.generate("qwen", "Say hello in French.", options=GREEDY)
    streamed = list(client.generate("qwen", "Say hello in French.", options=GREEDY,
                                    stream=True))
    assert "".join(p.response for p in streamed) == answer.response
    assert answer.response == whole.message.content   # the same prompt, through the template


def test_options_are_honoured(client):
    capped = client.generate("qwen", "Count from 1 to 50.", options=dict(GREEDY, num_predict=5))
    assert capped.eval_count == 5 and capped.done_reason == "length"
    sampled = {"temperature": 1.0, "seed": 42, "num_predict": 24}
    first = client.generate("qwen", "Write a short poem.", options=sampled)
    assert client.generate("qwen", "Write a short poem.", options=sampled).response == \
        first.response
    counted = client.generate("qwen", "Count from 1 to 10, separated by spaces.",
                              options=GREEDY).response
    assert "3" in counted
    stopped = client.generate("qwen", "Count from 1 to 10, separated by spaces.",
                              options=dict(GREEDY, stop=["3"]))
    assert stopped.response == counted[:counted.index("3")] and stopped.done_reason == "stop"


def test_format_json_and_schema(client):
    ask = [{"role": "user", "content": "Describe a fictional person as JSON."}]
    answer = client.chat("qwen", messages=ask, format="json", options=GREEDY)
    assert isinstance(json.loads(answer.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    answer = client.chat("qwen", messages=ask, format=schema, options=GREEDY)
    jsonschema.validate(json.loads(answer.message.content), schema)


def test_tool_calls_have_object_arguments(client):
    answer = client.chat("qwen", messages=ASK, tools=TOOLS, options=GREEDY)
    (call,) = answer.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    assert answer.done_reason == "stop" and answer.message.content == ""
    streamed = [c for part in client.chat("qwen", messages=ASK, tools=TOOLS, options=GREEDY,
                                          stream=True) for c in part.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(call.function.name, dict(call.function.arguments))]


def test_conversation_continues_from_the_tool_result(client, server):
    """The call (arguments as an object) and the result (role tool) are read back into the
    prompt as the OpenAI route reads the same conversation: the same answer, token for token."""
    result = '{"temp_c": 18, "sky": "clear"}'
    history = ASK + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": result}]
    answer = client.chat("qwen", messages=history, options=GREEDY)
    assert answer.message.content and not answer.message.tool_calls
    assert answer.prompt_eval_count > client.chat("qwen", messages=ASK,
                                                  options=GREEDY).prompt_eval_count
    openai_history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": result}]
    status, _, same = server.request("POST", "/v1/chat/completions", body={
        "messages": openai_history, "temperature": 0, "max_tokens": 80})
    assert status == 200 and same["choices"][0]["message"]["content"] == answer.message.content


def test_capabilities_the_model_lacks_are_refused(client):
    for call in (lambda: client.chat("qwen", messages=ASK, think=True),
                 lambda: client.embed("qwen", input="hi")):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and "does not support" in e.value.error
