"""The whole tool-call path for each model family kinetic loads, on tiny random-weight
models with the families' real chat templates: a forced call (tool_choice "required") is held
by the grammar to the family's own format, and the server reads it back as a call whose
arguments validate. The formats themselves, reply by reply, are tests/test_tool_calls.py.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from kinetic.chat.tool_calls import FORMATS, tool_format
from tests.app_client import model_app
from tests.tiny_models import DATA, write_tiny_model

UNIT = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                         "days": {"enum": [1, 2, 3]}},
        "required": ["unit", "days"], "additionalProperties": False}
# The XML format's values are free text (kinetic/chat/xml_calls.py), which random weights would
# write forever: its tool takes no parameters, so that the grammar alone writes the call.
NONE = {"type": "object", "properties": {}}

# (architecture, the template of a model of that family, the call format it writes, the
# tool's parameters)
FAMILIES = [
    ("qwen3moe", "Qwen-Qwen3-0.6B.jinja", "hermes", UNIT),    # Qwen3-30B-A3B's template
    ("qwen35", "Qwen3.5-4B.jinja", "qwen3_xml", NONE),
    ("llama", "meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3", UNIT),
    ("llama", "Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral", UNIT),
    ("qwen3", "LFM2.5-Instruct.jinja", "lfm2", UNIT),
]


@pytest.mark.parametrize("arch,template,fmt,params", FAMILIES,
                         ids=[f[1] for f in FAMILIES])
def test_forced_call_in_the_familys_format(tmp_path, arch, template, fmt, params):
    source = (DATA / "templates" / template).read_text()
    assert tool_format(source) is FORMATS[fmt]
    path = write_tiny_model(tmp_path / f"tiny-{arch}.gguf", arch, chat_template=source,
                            context_length=1024)
    with model_app(path, n_ctx=1024, parallel=1) as app:
        body = {"messages": [{"role": "user", "content": "Use celsius for two days."}],
                "tools": [{"type": "function", "function": {"name": "set_unit",
                                                            "parameters": params}}],
                "tool_choice": "required", "temperature": 0,
                "max_tokens": 120,   # no thinking: random weights would ramble in it
                "chat_template_kwargs": {"enable_thinking": False}}
        status, answer = app.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"][:1]
    assert call["function"]["name"] == "set_unit"
    jsonschema.validate(json.loads(call["function"]["arguments"]), params)
