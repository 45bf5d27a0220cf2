"""Every POST route against a table of malformed bodies: each one is a 4xx in the OpenAI
error shape, never a 5xx (issue 9: every text a client sends is valid Unicode or a 400; no
exception from parsing or templating surfaces as a 500).

The routes come from the app's url_map, so a new route gets the rows every body must pass
(bytes that are not UTF-8, JSON that is not an object, NaN, nesting past body.MAX_DEPTH, ...)
without an edit here; the routes in ROUTES also get one row per field: a lone surrogate in
each text field, and wrong types and values for each field the route reads, where `param`
must name the field (its path inside the body). Runs in-process (tests/app_client.py) on a
tiny random-weight model; the fuzzing counterpart is tests/test_fuzz_routes.py.
"""

from __future__ import annotations

import json

import pytest

from kinetic.api.body import MAX_DEPTH
from tests.app_client import (SERVED_BODIES, assert_error_shape, assert_route_error,
                              in_process_app)

SURROGATE = "\ud800"  # json.dumps writes it as the escape \ud800, as a client would send it
HUGE = 10**400        # an integer JSON can carry and no float can hold

ROUTES = SERVED_BODIES

# bodies no route may take: (label, raw bytes)
EVERY_ROUTE = [
    ("empty", b""),
    ("blank", b" \r\n\t"),
    ("invalid utf-8", b'{"prompt": "\xff"}'),
    ("overlong utf-8", b'{"prompt": "\xc0\xaf"}'),
    ("encoded surrogate", b'{"prompt": "\xed\xa0\x80"}'),
    ("truncated utf-8", b'{"prompt": "\xe2\x82"}'),
    ("utf-16", '{"prompt": "hi"}'.encode("utf-16")),
    ("truncated json", b'{"prompt": '),
    ("trailing junk", b'{"prompt": "hi"} x'),
    ("single quotes", b"{'prompt': 'hi'}"),
    ("array", b'[{"prompt": "hi"}]'),
    ("string", b'"hi"'),
    ("number", b"1"),
    ("null", b"null"),
    ("true", b"true"),
    ("NaN", b'{"temperature": NaN}'),
    ("Infinity", b'{"temperature": Infinity}'),
    ("-Infinity", b'{"temperature": -Infinity}'),
    ("1e999", b'{"temperature": 1e999}'),
    ("-1e999", b'{"top_p": -1e999}'),
    ("5000-digit integer", b'{"max_tokens": ' + b"9" * 5000 + b"}"),
    ("nested past the limit", b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"),
    ("nested 100000 deep", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nested objects", b'{"a": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1000 + b"}"),
    ("unclosed nesting", b"[" * 100_000),
    ("lone surrogate key", b'{"\\ud800": 1}'),
    ("lone low surrogate", b'{"prompt": "\\udfff", "content": "\\udfff"}'),
    ("reversed pair", b'{"prompt": "\\ude00\\ud83d", "content": "\\ude00\\ud83d"}'),
    ("nul byte", b'{"prompt": "hi"\x00}'),
]

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


# (fields set on the route's body, the param the 400 must name); None: any param
CHAT_ROWS = [
    ({"messages": [{"role": "user", "content": SURROGATE}]}, "messages[0].content"),
    ({"messages": [{"role": SURROGATE, "content": "hi"}]}, "messages[0].role"),
    ({"messages": _user([{"type": "text", "text": "a" + SURROGATE}])},
     "messages[0].content[0].text"),
    ({"messages": [MSG[0], {"role": "assistant", "content": "", "reasoning_content":
                            SURROGATE}]}, "messages[1].reasoning_content"),
    ({"messages": [MSG[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": SURROGATE}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"stop": ["ok", SURROGATE]}, "stop[1]"),
    ({"grammar": f'root ::= "{SURROGATE}"'}, "grammar"),
    ({"tools": [{"type": "function", "function": {"name": SURROGATE}}]},
     "tools[0].function.name"),
    ({"logit_bias": {SURROGATE: 1}}, "logit_bias"),
    ({"chat_template_kwargs": {"x": SURROGATE}}, "chat_template_kwargs.x"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "enum": [SURROGATE]}}}}, "response_format.json_schema.schema.enum[0]"),
    ({"messages": "hi"}, "messages"),
    ({"messages": {"role": "user", "content": "hi"}}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [5]}, "messages[0]"),
    ({"messages": [None]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "hi"}]}, "messages[0].role"),
    ({"messages": _user(5)}, "messages[0].content"),
    ({"messages": _user({"type": "text", "text": "hi"})}, "messages[0].content"),
    ({"messages": _user(True)}, "messages[0].content"),
    ({"messages": _user([5])}, "messages[0].content[0]"),
    ({"messages": _user(["hi"])}, "messages[0].content[0]"),
    ({"messages": _user([{"text": "hi"}])}, "messages[0].content[0]"),
    ({"messages": _user([{"type": 5, "text": "hi"}])}, "messages[0].content[0]"),
    ({"messages": _user([{"type": "text", "text": 5}])}, "messages[0].content[0].text"),
    ({"messages": _user([{"type": "text", "text": None}])}, "messages[0].content[0].text"),
    ({"messages": _user([{"type": "text", "text": ["a"]}])}, "messages[0].content[0].text"),
    ({"messages": _user([{"type": "text"}])}, "messages[0].content[0].text"),
    ({"messages": _user([{"type": "text", "text": "a"}, {"type": "video", "video": "x"}])},
     "messages[0].content[1].type"),
    ({"messages": _user([{"type": "media_marker", "text": "x"}])},
     "messages[0].content[0].type"),
    ({"messages": _user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}])},
     "messages[0].content[0]"),
    ({"messages": _user([{"type": "input_audio", "input_audio": {"data": "", "format":
                                                                  "wav"}}])},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "1", "tool_call_id": {}}]},
     "messages[0].tool_call_id"),
    ({"messages": [MSG[0], {"role": "assistant", "content": "", "reasoning_content": 5}]},
     "messages[1].reasoning_content"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": "f()"}]},
     "messages[1].tool_calls"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": {"a": 1}}]},
     "messages[1].tool_calls"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": [5]}]},
     "messages[1].tool_calls[0]"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": ["f"]}]},
     "messages[1].tool_calls[0]"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": 5}}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": [MSG[0], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": "f"}]}]}, "messages[1].tool_calls[0]"),
    ({"messages": [MSG[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": 5, "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].id"),
    ({"messages": [MSG[0], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{"}}]}, MSG[0]]},
     "messages"),  # the arguments are not JSON: the template step refuses them
    ({"messages": [{"role": "user"}]}, "messages"),  # no content
    ({"messages": [{"role": "assistant", "content": "a"}, {"role": "assistant",
                                                           "content": "b"}]}, "messages"),
    ({"tools": "f"}, "tools"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [5]}, "tools[0]"),
    ({"tools": [None]}, "tools[0]"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "g", "description": 5}}]},
     "tools[1].function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [TOOL] * 129}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": 5}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters.properties.x.pattern"),
    # checked even when no grammar is compiled: the XML call reader types values by them
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": [["string"]]}}}}}]},
     "tools[0].function.parameters.properties.x.type[0]"),
    ({"tools": [TOOL], "tool_choice": 5}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": ["auto"]}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "no"}}, "messages"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_completion_tokens": "10"}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": 5}}, "response_format"),
    ({"response_format": {"type": ["json_object"]}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{}"}}},
     "response_format"),
    ({"response_format": {"type": "json_object", "schema": 5}}, "response_format.schema"),
    ({"response_format": {"type": "json_object", "schema": [1]}}, "response_format.schema"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"n": "1"}, "n"),
]

# rows of every generating route (chat, completions, /completion)
SAMPLING_ROWS = [
    ({"receipt": "yes"}, "receipt"),
    ({"receipt": 1}, "receipt"),
    ({"stop": 5}, "stop"),
    ({"stop": [5]}, "stop"),
    ({"stop": [["a"]]}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stop": True}, "stop"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": "x" * 1001}, "stop"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": 101}, "temperature"),
    ({"temperature": HUGE}, "temperature"),
    ({"temperature": -HUGE}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": [0.5]}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": HUGE}, "top_p"),
    ({"top_p": {}}, "top_p"),
    ({"min_p": -0.5}, "min_p"),
    ({"typical_p": "1"}, "typical_p"),
    ({"top_n_sigma": HUGE}, "top_n_sigma"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": "40"}, "top_k"),
    ({"top_k": HUGE}, "top_k"),
    ({"top_k": -HUGE}, "top_k"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"repeat_penalty": HUGE}, "repeat_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
    ({"repeat_last_n": HUGE}, "repeat_last_n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -HUGE}, "frequency_penalty"),
    ({"dry_multiplier": -1}, "dry_multiplier"),
    ({"dry_base": HUGE}, "dry_base"),
    ({"dry_allowed_length": -1}, "dry_allowed_length"),
    ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ({"dry_sequence_breakers": 5}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": [5]}, "dry_sequence_breakers"),
    ({"dry_sequence_breakers": [SURROGATE]}, "dry_sequence_breakers[0]"),
    ({"dry_sequence_breakers": ["x"] * 65}, "dry_sequence_breakers"),
    ({"xtc_probability": 2}, "xtc_probability"),
    ({"xtc_threshold": "x"}, "xtc_threshold"),
    ({"mirostat": 3}, "mirostat"),
    ({"mirostat": 1.5}, "mirostat"),
    ({"mirostat_tau": -1}, "mirostat_tau"),
    ({"mirostat_eta": HUGE}, "mirostat_eta"),
    ({"min_keep": -1}, "min_keep"),
    ({"seed": "42"}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": -2}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": HUGE}, "seed"),
    ({"ignore_eos": "true"}, "ignore_eos"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": [[1]]}, "logit_bias"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias"),
    # a text key biases its tokens (llama-server's), but not an empty or endless one
    ({"logit_bias": {"": 1}}, "logit_bias"),
    ({"logit_bias": [["a" * 5000, 1]]}, "logit_bias"),
    ({"logit_bias": [[None, 1]]}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": [[HUGE, 1]]}, "logit_bias"),
    ({"logit_bias": [[-1, 1]]}, "logit_bias"),
    ({"logit_bias": {"1": "x"}}, "logit_bias"),
    ({"logit_bias": {"1": None}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"1": HUGE}}, "logit_bias"),
    ({"logit_bias": {"1": -HUGE}}, "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"grammar": 5}, "grammar"),
    ({"grammar": ["root ::= x"]}, "grammar"),
    ({"grammar": 'root ::= "a" )'}, "grammar"),
    ({"grammar": "x" * (256 * 1024 + 1)}, "grammar"),
    ({"json_schema": 5}, "json_schema"),
    ({"json_schema": "{}"}, "json_schema"),
    ({"json_schema": [1]}, "json_schema"),
    ({"json_schema": {"type": "strin"}}, "json_schema.type"),
    ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "json_schema"),
    # keywords of the wrong type (the keyword table's `value`), refused as the body is parsed
    ({"json_schema": {"type": 5}}, "json_schema.type"),
    ({"json_schema": {"required": 5}}, "json_schema.required"),
    ({"json_schema": {"type": "object", "required": [5]}}, "json_schema.required"),
    ({"json_schema": {"prefixItems": 5}}, "json_schema.prefixItems"),
    ({"json_schema": {"pattern": 5}}, "json_schema.pattern"),
    ({"json_schema": {"type": "string", "minLength": "a"}}, "json_schema.minLength"),
    ({"json_schema": {"type": "array", "maxItems": 1.5}}, "json_schema.maxItems"),
    ({"json_schema": {"anyOf": [5]}}, "json_schema.anyOf[0]"),
    ({"json_schema": {"allOf": [5]}}, "json_schema.allOf[0]"),
    ({"json_schema": {"dependencies": 5}}, "json_schema.dependencies"),
    ({"json_schema": {"dependencies": {"a": [5]}}}, "json_schema.dependencies.a"),
    ({"json_schema": {"properties": {"a": {"type": "object", "properties": []}}}},
     "json_schema.properties.a.properties"),
    ({"json_schema": {"items": [{"minItems": -1}]}}, "json_schema.items[0].minItems"),
    ({"json_schema": {"enum": "a"}}, "json_schema.enum"),
    ({"json_schema": {"uniqueItems": "yes"}}, "json_schema.uniqueItems"),
    ({"json_schema": {"type": "integer", "minimum": "0"}}, "json_schema.minimum"),
    ({"response_format": {"type": "json_object", "schema": {"required": "a"}}},
     "response_format.schema.required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "$defs": {"a": 5}}}}}, "response_format.json_schema.schema.$defs.a"),
    ({"json_schema": {"type": ["string", "strin"]}}, "json_schema.type[1]"),
    ({"json_schema": {"type": []}}, "json_schema.type"),
    ({"json_schema": {"anyOf": []}}, "json_schema.anyOf"),
    ({"json_schema": {"properties": {"0": {"anyOf": [{}, 5]}}}},
     "json_schema.properties.0.anyOf[1]"),
    ({"json_schema": {"properties": {"a/b": {"minLength": -1}}}},
     "json_schema.properties.a/b.minLength"),
    ({"json_schema": {"type": "number", "maximum": HUGE}}, "json_schema.maximum"),
    ({"json_schema": {"type": "number", "exclusiveMinimum": "0"}},
     "json_schema.exclusiveMinimum"),
    ({"json_schema": {"$ref": "#/x", "x": 5}}, "json_schema.$ref"),
    ({"json_schema": {"not": {"nullable": "yes"}}}, "json_schema.not.nullable"),
]

COMPLETION_ROWS = [
    ({"prompt": SURROGATE}, "prompt"),
    ({"prompt": ["a" + SURROGATE]}, "prompt[0]"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": True}, "prompt"),
    ({"prompt": {"text": "hi"}}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"prompt": [HUGE]}, "prompt"),
    ({"prompt": [[HUGE]]}, "prompt"),
    ({"prompt": [-HUGE]}, "prompt"),
]

# prompts /v1/completions refuses as a whole; /completion takes some of them (several
# prompts, token ids mixed with text) and names the one at fault in the others
OPENAI_COMPLETION_ROWS = [
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [[1, "a"]]}, "prompt"),
    ({"prompt": [[[1]]]}, "prompt"),
    ({"prompt": [{"a": 1}]}, "prompt"),
    ({"prompt": [1.5]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": [None]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": HUGE}, "max_tokens"),
    ({"max_tokens": [1]}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"echo": True}, "echo"),
    ({"echo": "yes"}, "echo"),
    ({"suffix": "x"}, "suffix"),
    ({"suffix": 5}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": "1"}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "5"}, "logprobs"),
    ({"logprobs": HUGE}, "logprobs"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
]

LLAMA_COMPLETION_ROWS = [
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"n_predict": "8"}, "n_predict"),
    ({"n_predict": 0}, "n_predict"),
    ({"n_predict": -2}, "n_predict"),
    ({"n_predict": 1.5}, "n_predict"),
    ({"n_predict": HUGE}, "n_predict"),
    ({"n_predict": -HUGE}, "n_predict"),
    ({"n_predict": [8]}, "n_predict"),
    ({"n_predict": None, "max_tokens": "8"}, "max_tokens"),
    ({"n_probs": -1}, "n_probs"),
    ({"n_probs": "3"}, "n_probs"),
    ({"n_probs": HUGE}, "n_probs"),
    ({"n_probs": 21}, "n_probs"),
    ({"prompt": [[[1]]]}, "prompt[0]"),
    ({"prompt": [{"a": 1}]}, "prompt[0]"),
    ({"prompt": [["a", "b"]]}, "prompt[0]"),
    ({"prompt": ["a", 1.5]}, "prompt[1]"),
    ({"prompt": [True]}, "prompt[0]"),
    ({"prompt": [None]}, "prompt[0]"),
    ({"prompt": {"prompt_string": None}}, "prompt.prompt_string"),
    ({"prompt": {"prompt_string": "hi", "multimodal_data": []}}, "prompt"),
    ({"prompt": ["hi", [1, 999999]]}, "prompt[1]"),
    ({"post_sampling_probs": "yes"}, "post_sampling_probs"),
    ({"timings_per_token": 1}, "timings_per_token"),
    ({"return_progress": "true"}, "return_progress"),
    ({"response_fields": [5]}, "response_fields"),
    ({"return_tokens": "yes"}, "return_tokens"),
    ({"cache_prompt": "yes"}, "cache_prompt"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'},
     "response_format"),
]

TOKENIZE_ROWS = [
    ({"content": SURROGATE}, "content"),
    ({"content": "ok" + SURROGATE + "ok"}, "content"),
    ({"content": "\udc80"}, "content"),
    ({"content": 5}, "content"),
    ({"content": ["hi"]}, "content"),
    ({"content": {"text": "hi"}}, "content"),
    ({"content": True}, "content"),
    ({"add_special": "yes"}, "add_special"),
    ({"parse_special": 1}, "parse_special"),
    ({"with_pieces": "yes"}, "with_pieces"),
]

DETOKENIZE_ROWS = [
    ({"tokens": "abc"}, "tokens"),
    ({"tokens": {"a": 1}}, "tokens"),
    ({"tokens": 5}, "tokens"),
    ({"tokens": [1.5]}, "tokens"),
    ({"tokens": [True]}, "tokens"),
    ({"tokens": ["1"]}, "tokens"),
    ({"tokens": [[1]]}, "tokens"),
    ({"tokens": [None]}, "tokens"),
    ({"tokens": [-1]}, "tokens"),
    ({"tokens": [1, 99999999]}, "tokens"),
    ({"tokens": [HUGE]}, "tokens"),
    ({"tokens": [-HUGE]}, "tokens"),
]

FIELD_ROWS = {
    "openai.chat_completions": CHAT_ROWS + SAMPLING_ROWS,
    "openai.completions": COMPLETION_ROWS + OPENAI_COMPLETION_ROWS + SAMPLING_ROWS,
    "llama_server.completion": COMPLETION_ROWS + LLAMA_COMPLETION_ROWS + SAMPLING_ROWS,
    "llama_server.tokenize": TOKENIZE_ROWS,
    "llama_server.detokenize": DETOKENIZE_ROWS,
    # a prefill's body is a chat completion's, refused alike: the fields that shape the
    # prompt, and every field's type and range (a GBNF grammar is not compiled for a
    # prefill, so its syntax errors come with the completion)
    "prefill.prefill": [r for r in CHAT_ROWS if set(r[0]) <= {
        "messages", "tools", "tool_choice", "chat_template_kwargs"}] + [
        r for r in SAMPLING_ROWS if r[0] != {"grammar": 'root ::= "a" )'}],
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("malformed")) as a:
        yield a


def test_every_route_refuses_every_malformed_body(app):
    failures = []
    routes = app.post_routes()
    assert "/v1/chat/completions" in routes and "/tokenize" in routes
    for path in routes:
        for label, raw in EVERY_ROUTE:
            status, answer = app.post(path, raw)
            try:
                assert_route_error(path, status, answer, f"{path} {label}")
            except AssertionError as e:
                failures.append(str(e))
    assert not failures, "\n".join(failures)


def test_body_level_errors_say_what_is_wrong(app):
    cases = [(b"", "empty"), (b'{"prompt": "\xff"}', "not valid UTF-8"),
             (b'{"prompt": "\xed\xa0\x80"}', "not valid UTF-8"),
             (b'{"temperature": NaN}', "NaN"), (b'{"temperature": 1e999}', "out of range"),
             (b'{"a": ' + b"[" * 100_000, f"at most {MAX_DEPTH}"),
             (b"[1]", "must be a JSON object")]
    for raw, words in cases:
        status, answer = app.post("/tokenize", raw)
        err = assert_error_shape(status, answer, repr(raw[:40]))
        assert status == 400 and words in err["message"] and err["param"] is None, err
    status, answer = app.post("/tokenize", b'{"content": "\\ud800"}')
    err = assert_error_shape(status, answer)
    assert err["param"] == "content" and "lone surrogate" in err["message"]
    status, answer = app.post("/tokenize", b'{"x": {"\\udc00": 1}}')
    err = assert_error_shape(status, answer)
    assert err["param"] == "x" and "a key of x" in err["message"]


def _cases():
    for endpoint, rows in FIELD_ROWS.items():
        for i, (fields, param) in enumerate(rows):
            yield pytest.param(endpoint, fields, param, id=f"{endpoint}-{i}-{param}")


@pytest.mark.parametrize("endpoint,fields,param", list(_cases()))
def test_malformed_field_is_a_400_naming_it(app, endpoint, fields, param):
    path = _path_of(app, endpoint)
    body = {**ROUTES[endpoint], **fields}
    status, answer = app.post(path, json.dumps(body).encode())
    err = assert_error_shape(status, answer, f"{path} {json.dumps(fields)[:200]}")
    assert status == 400 and err["type"] == "invalid_request_error", err
    assert param is None or err["param"] == param, err


def test_each_route_serves_its_base_body_and_its_fields_are_covered(app):
    """The rows above are 400 because of the field they change: the same body without it
    answers 200. And every route of ROUTES still exists."""
    for endpoint, body in ROUTES.items():
        status, answer = app.post(_path_of(app, endpoint), json.dumps(body).encode())
        assert status == 200, (endpoint, answer)


def test_a_valid_escaped_pair_is_text(app):
    status, answer = app.post("/tokenize", b'{"content": "\\ud83d\\ude00", "with_pieces": true}')
    assert status == 200 and answer["tokens"], answer
    status, answer = app.post("/detokenize", json.dumps(
        {"tokens": [t["id"] for t in answer["tokens"]]}).encode())
    assert status == 200 and answer["content"] == "\U0001F600", answer


def test_json_schema_at_the_depth_limit_still_fits(app):
    """A schema nested as deep as real ones (tests/data/jsonschemabench reaches 16) fits well
    inside MAX_DEPTH, counted from the top of the body."""
    schema: dict = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"a": schema}}
    body = {"prompt": "hi", "max_tokens": 1, "json_schema": schema}
    status, answer = app.post("/v1/completions", json.dumps(body).encode())
    assert status == 200, answer


def test_a_schema_value_of_the_wrong_type_says_what_it_must_be(app):
    """The 400 of a keyword value of the wrong type names the keyword, what it must be and its
    JSON pointer; `param` is the same place as a body path."""
    body = {"prompt": "hi", "max_tokens": 1,
            "json_schema": {"properties": {"name": {"type": "string", "minLength": "3"}}}}
    status, answer = app.post("/v1/completions", json.dumps(body).encode())
    assert status == 400, answer
    assert answer["error"]["param"] == "json_schema.properties.name.minLength", answer
    assert answer["error"]["message"] == (
        "invalid JSON Schema: minLength must be an integer of at least 0, at "
        "/properties/name/minLength"), answer


def _path_of(app, endpoint: str) -> str:
    paths = [p for p in app.post_routes() if app.endpoint(p) == endpoint]
    assert paths, f"no POST route is {endpoint}"
    return paths[0]
