"""Tool calls: recorded replies of every format parsed finished and streamed (split at every
position and in random pieces: the same content and calls), malformed calls back as content,
which template writes which format, and the forced-call grammars as (accepted, rejected) tables
over a byte-level vocabulary, each accepted reply parsing back into its calls."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kinetic.chat.reasoning import ReasoningSplitter
from kinetic.chat.tool_calls import FORMATS, ParsedReply, ToolCall, tool_format
from kinetic.grammar import UnsupportedSchema
from tests.test_grammar import VOCAB, accepts_bytewise, check_table

TEMPLATES = Path(__file__).parent / "data" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string"},
        "filters": {"type": "object", "properties": {"lang": {"type": "string"},
                                                     "max": {"type": "integer"}}}},
        "required": ["query", "filters"]}}}
PING = {"type": "function", "function": {"name": "ping"}}   # no parameters: any object
TOOLS = [WEATHER, SEARCH, PING]


def call(name: str, **args) -> ToolCall:
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


PARIS = call("get_weather", city="Paris")
ZURICH = call("get_weather", city="Zürich", unit="celsius", days=3)
NESTED = call("search", query="日本の天気", filters={"lang": "ja", "max": 3})

# --- recorded replies: (format, reply, content, calls) ----------------------------------------

HERMES_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
RECORDED = [
    ("hermes", HERMES_PARIS, "", [PARIS]),
    ("hermes", "Let me check both.\n\n" + HERMES_PARIS + '\n<tool_call>\n{"name": "search", '
     '"arguments": {"query": "日本の天気", "filters": {"lang": "ja", "max": 3}}}'
     "\n</tool_call>",
     "Let me check both.", [PARIS, NESTED]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich", '
     '"unit": "celsius", "days": 3}}\n</tool_call>\n', "", [ZURICH]),
    ("hermes", "The answer is 4 (no <tool call needed).", "The answer is 4 (no <tool call "
     "needed).", []),
    ("hermes", HERMES_PARIS + "\nI will report back.", "I will report back.", [PARIS]),
    # Qwen2.5-Coder-0.5B's own reply to "What is the weather in Paris?" (kinetic serve, greedy)
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [PARIS]),
    ("hermes", '{"name": "Ethan", "age": 25}', '{"name": "Ethan", "age": 25}', []),
    # and with two tools offered, the same model and question (a fenced object)
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n'
     '  }\n}\n```', "", [PARIS]),
    ("hermes", '```python\nprint(1)\n```', '```python\nprint(1)\n```', []),
    ("hermes", '```json\n{"a": 1}\n```', '```json\n{"a": 1}\n```', []),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "</function>\n</tool_call>", "", [PARIS]),
    ("qwen3_xml", "I'll look that up.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
     "Zürich\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n"
     "<parameter=query>\n日本の天気\n</parameter>\n<parameter=filters>\n"
     '{"lang": "ja", "max": 3}\n</parameter>\n</function>\n</tool_call>',
     "I'll look that up.", [ZURICH, NESTED]),
    ("qwen3_xml", "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n"
     "<parameter=filters>\n{}\n</parameter>\n</function>\n</tool_call>", "",
     [call("search", query="42", filters={})]),   # a string parameter stays a string
    ("qwen3_xml", "<tool_call>\n<function=write>\n<parameter=text>\nline 1\n  line 2 <b>\n\n"
     "</parameter>\n</function>\n</tool_call>", "",
     [call("write", text="line 1\n  line 2 <b>\n")]),
    ("lfm2", '<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
     "<|tool_call_end|>", "", [PARIS]),
    ("lfm2", 'Checking.<|tool_call_start|>[{"name": "get_weather", "arguments": {"city": '
     '"Zürich", "unit": "celsius", "days": 3}}, {"name": "search", "arguments": {"query": '
     '"日本の天気", "filters": {"lang": "ja", "max": 3}}}]<|tool_call_end|>', "Checking.",
     [ZURICH, NESTED]),
    ("lfm2", "<|tool_call_start|>[get_weather(city='Zürich', unit='celsius', days=3), "
     'search(query="日本の天気", filters={"lang": "ja", "max": 3})]<|tool_call_end|>'
     "Checking the weather and the news.", "Checking the weather and the news.",
     [ZURICH, NESTED]),
    ("lfm2", "<|tool_call_start|>[ping(), set_flag(on=true, note=None)]<|tool_call_end|>", "",
     [call("ping"), call("set_flag", on=True, note=None)]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [PARIS]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "unit": "celsius", '
     '"days": 3}[TOOL_CALLS]search[ARGS]{"query": "日本の天気", "filters": {"lang": "ja", '
     '"max": 3}}', "Sure.", [ZURICH, NESTED]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', "",
     [PARIS]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, '
     '"id": "a1b2c3d4e"}]', "", [PARIS]),
    ("mistral_nemo", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Zürich", '
     '"unit": "celsius", "days": 3}, "id": "Ab3dE6g8H"}, {"name": "search", "arguments": '
     '{"query": "日本の天気", "filters": {"lang": "ja", "max": 3}}, "id": "x0x0x0x0x"}]', "",
     [ZURICH, NESTED]),
    ("mistral_nemo", "Let me see. [TOOL_CALLS]" + '[{"name": "get_weather", "arguments": '
     '{"city": "Paris"}}]', "Let me see.", [PARIS]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [PARIS]),
    ("llama3", '\n{"type": "function", "name": "search", "arguments": {"query": "日本の天気", '
     '"filters": {"lang": "ja", "max": 3}}}\n', "", [NESTED]),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius", '
     '"days": 3}}\n{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [ZURICH, PARIS]),
    ("llama3", '{"name": "Ethan", "age": 25}', '{"name": "Ethan", "age": 25}', []),
    ("llama3", "It is sunny in Paris {really}.", "It is sunny in Paris {really}.", []),
]

MALFORMED = [
    ("hermes", 'Here: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n'
               "</tool_call>"),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'),
    ("hermes", '<tool_call>\n{"function": "get_weather", "args": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>'),
    ("hermes", HERMES_PARIS + " and then " + HERMES_PARIS),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"x": NaN}}\n</tool_call>'),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n"
                  "</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"),
    ("qwen3_xml", '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'),
    ("lfm2", "<|tool_call_start|>[get_weather(city='Paris')]"),
    ("lfm2", "<|tool_call_start|>[get_weather('Paris')]<|tool_call_end|>"),
    ("lfm2", "<|tool_call_start|>[import os]<|tool_call_end|>"),
    ("lfm2", "<|tool_call_start|>[f(x=open('a'))]<|tool_call_end|>"),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS][1, 2]"),
    ("mistral_nemo", '[TOOL_CALLS][{"name": "get_weather"}]'),
    ("mistral_nemo", '[TOOL_CALLS]{"name": "get_weather", "arguments": {}}'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}} is what I would send'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("llama3", '{"name": "get_weather"}'),
]


def stream(fmt, pieces, tools=TOOLS):
    s = fmt.streamer(tools)
    sent = [s.feed(p) for p in pieces]
    return sent, s.finish()


def splits(text: str, rng: random.Random):
    """The text cut in two at every position, one character at a time, and in random pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(6, len(text) + 1)))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name,reply,content,calls", RECORDED)
def test_recorded_replies(name, reply, content, calls):
    fmt = FORMATS[name]
    assert fmt.parse(reply, TOOLS) == ParsedReply(content, tuple(calls))
    rng = random.Random(reply)
    for pieces in splits(reply, rng):
        sent, end = stream(fmt, pieces)
        assert "".join(sent) + end.content == content, pieces
        assert end.calls == tuple(calls), pieces


TEXT_FIRST = [(name, reply) for name, reply, _, calls in RECORDED
              if calls and FORMATS[name].start and FORMATS[name].start in reply
              and reply.split(FORMATS[name].start)[0].strip()]


@pytest.mark.parametrize("name,reply", TEXT_FIRST)
def test_text_before_calls_is_sent_before_the_marker_completes(name, reply):
    fmt = FORMATS[name]
    at = reply.index(fmt.start)
    s = fmt.streamer(TOOLS)
    sent = "".join(s.feed(c) for c in reply[:at + len(fmt.start) - 1])
    assert sent == reply[:at].rstrip()


@pytest.mark.parametrize("name,reply", MALFORMED)
def test_malformed_calls_are_content(name, reply):
    fmt = FORMATS[name]
    assert fmt.parse(reply, TOOLS) == ParsedReply(reply, ())
    for pieces in splits(reply, random.Random(reply)):
        sent, end = stream(fmt, pieces)
        assert "".join(sent) + end.content == reply and end.calls == (), pieces


def test_xml_values_without_tools():
    """Without the tools' schemas, values that parse as non-string JSON are typed."""
    reply = ("<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\n"
             '"q"\n</parameter>\n<parameter=b>\ntrue\n</parameter>\n<parameter=t>\nhi\n'
             "</parameter>\n</function>\n</tool_call>")
    assert FORMATS["qwen3_xml"].parse(reply).calls == (call("f", n=42, s='"q"', b=True, t="hi"),)
    typed = [{"function": {"name": "f", "parameters": {"properties": {
        "n": {"type": "string"}, "b": {"type": "integer"}}}}}]
    assert FORMATS["qwen3_xml"].parse(reply, typed).calls == (
        call("f", n="42", s='"q"', b="true", t="hi"),)


# --- which template writes which format ------------------------------------------------------

@pytest.mark.parametrize("template,name", [
    ("Qwen3.5-4B.jinja", "qwen3_xml"), ("Qwen3-Coder.jinja", "qwen3_xml"),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "qwen3_xml"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes"), ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes"),
    ("LFM2-8B-A1B.jinja", "lfm2"), ("LFM2.5-8B-A1B.jinja", "lfm2"),
    ("LFM2.5-Instruct.jinja", "lfm2"),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral"),
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral"),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", "mistral"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral_nemo"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama3"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3"),
    ("google-gemma-2-2b-it.jinja", "llama3"), ("unsloth-Apriel-1.5.jinja", "llama3"),
    ("GLM-4.6.jinja", "llama3"),
])
def test_template_formats(template, name):
    assert tool_format((TEMPLATES / template).read_text("utf-8")).name == name


# --- forced-call grammars --------------------------------------------------------------------

def _json_call(name, args):
    return f'{{"name": "{name}", "arguments": {args}}}'


# how each JSON format writes a list of (name, arguments text) calls
WRITERS = {
    "hermes": lambda cs: "\n".join(f"<tool_call>\n{_json_call(n, a)}\n</tool_call>"
                                   for n, a in cs),
    "lfm2": lambda cs: "<|tool_call_start|>[" + ", ".join(_json_call(n, a) for n, a in cs)
    + "]<|tool_call_end|>",
    "mistral": lambda cs: "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in cs),
    "mistral_nemo": lambda cs: "[TOOL_CALLS][" + ", ".join(
        _json_call(n, a)[:-1] + ', "id": "aB3dE6g8H"}' for n, a in cs) + "]",
    "llama3": lambda cs: "\n".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in cs),
}
GOOD = [("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Zürich", "unit": "celsius", "days": -3}'),
        ("search", '{"query": "日本", "filters": {"lang": "ja", "max": 3}}'),
        ("search", '{ "query": "x",\n  "filters": {} }'),
        ("ping", '{"anything": [1, {"goes": null}]}'),
        ("ping", "{}")]
BAD = [("get_wether", '{"city": "Paris"}'),           # no such tool
       ("get_weather", '{"city": 42}'),                # wrong type
       ("get_weather", '{"city": "Paris", "days": 1.5}'),
       ("get_weather", '{"unit": "celsius"}'),         # a required argument missing
       ("get_weather", '{"city": "Paris", "unit": "kelvin"}'),   # not in the enum
       ("search", '{"query": "x"}'),
       ("search", '{"query": "x", "filters": {"max": "3"}}'),
       ("ping", "[]")]
THOUGHT = "The user wants the weather.\n</think>\n\n"


def _think_cases(text: str):
    """(think, accepted, rejected) around one reply of calls."""
    return [("none", [text], ["<think>\nhm\n</think>\n" + text, THOUGHT + text, " " + text]),
            ("open", [THOUGHT + text, "</think>" + text, "a </b> </thin </think>\n" + text],
             [text, "<think>" + THOUGHT + "</think>" + text, "a </</think> b\n</think>\n" + text]),
            ("optional", [text, "<think>\n" + THOUGHT + text, "<think></think>" + text],
             [THOUGHT + text, "<think>\nunclosed " + text])]


def _check_parses_back(fmt, texts, think, calls):
    for text in texts:
        splitter = ReasoningSplitter(think == "open")
        _, content = splitter.feed(text)
        content += splitter.finish()[1]
        expected = tuple(ToolCall(n, json.dumps(json.loads(a), ensure_ascii=False))
                         for n, a in calls)
        assert fmt.parse(content, TOOLS) == ParsedReply("", expected), text


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_json_format_grammars(name):
    fmt, write = FORMATS[name], WRITERS[name]
    one = fmt.grammar(TOOLS, parallel=False, think="none")
    many = fmt.grammar(TOOLS, parallel=True, think="none")
    for good in GOOD:
        assert accepts_bytewise(one, VOCAB, write([good]).encode()), good
        _check_parses_back(fmt, [write([good])], "none", [good])
    for bad in BAD:
        assert not accepts_bytewise(many, VOCAB, write([bad]).encode()), bad
    pair = write([GOOD[1], GOOD[2]])
    check_table(one, [write([GOOD[0]])],
                [pair, "Sure! " + write([GOOD[0]]), write([GOOD[0]]) + " done", "",
                 write([BAD[1]])])
    check_table(many, [pair, write([GOOD[0]])], [write([GOOD[0]]) + " done"])
    _check_parses_back(fmt, [pair], "none", [GOOD[1], GOOD[2]])
    for think, accepted, rejected in _think_cases(write([GOOD[2]])):
        g = fmt.grammar(TOOLS, parallel=False, think=think)
        check_table(g, accepted, rejected)
        _check_parses_back(fmt, accepted, think, [GOOD[2]])


def _xml(name, params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_GOOD = [
    (_xml("get_weather", [("city", "Paris")]), [PARIS]),
    (_xml("get_weather", [("city", "Zürich"), ("unit", "celsius"), ("days", "3")]), [ZURICH]),
    (_xml("search", [("query", "日本の天気"), ("filters", '{"lang": "ja", "max": 3}')]),
     [NESTED]),
    (_xml("search", [("query", "multi\nline <b>x</b> </param"), ("filters", "{}")]),
     [call("search", query="multi\nline <b>x</b> </param", filters={})]),
    (_xml("ping", [("anything", "goes"), ("n", "1")]), [call("ping", anything="goes", n=1)]),
    (_xml("ping", []), [call("ping")]),
]
XML_BAD = [
    _xml("get_wether", [("city", "Paris")]),                      # no such tool
    _xml("get_weather", [("town", "Paris")]),                     # no such parameter
    _xml("get_weather", [("unit", "celsius")]),                   # a required one missing
    _xml("search", [("query", "x")]),
    _xml("get_weather", [("city", "Paris"), ("city", "Lyon")]),   # twice
    _xml("get_weather", [("city", "a </parameter> b")]),
    _xml("get_weather", [("city", "a </</parameter> b")]),
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis</function>\n</tool_call>",
]


def test_xml_grammar():
    fmt = FORMATS["qwen3_xml"]
    one = fmt.grammar(TOOLS, parallel=False, think="none")
    many = fmt.grammar(TOOLS, parallel=True, think="none")
    for text, calls in XML_GOOD:
        check_table(one, [text], [])
        assert fmt.parse(text, TOOLS) == ParsedReply("", tuple(calls)), text
    pair = XML_GOOD[1][0] + "\n" + XML_GOOD[2][0]
    check_table(one, [], XML_BAD + [pair, "Let me check.\n\n" + XML_GOOD[0][0], ""])
    check_table(many, [pair], XML_BAD)
    assert fmt.parse(pair, TOOLS) == ParsedReply("", (ZURICH, NESTED))
    for think, accepted, rejected in _think_cases(XML_GOOD[0][0]):
        g = fmt.grammar(TOOLS, parallel=True, think=think)
        check_table(g, accepted, rejected)
        for text in accepted:
            splitter = ReasoningSplitter(think == "open")
            content = splitter.feed(text)[1] + splitter.finish()[1]
            assert fmt.parse(content, TOOLS) == ParsedReply("", (PARIS,)), text


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_refusals(name):
    fmt = FORMATS[name]
    bad = {"function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    if name != "qwen3_xml":   # XML values are free text: no value schema to enforce
        with pytest.raises(UnsupportedSchema):
            fmt.grammar([bad], parallel=False, think="none")
    else:
        weird = {"function": {"name": "f", "parameters": {"properties": {"a>b": {}}}}}
        with pytest.raises(UnsupportedSchema):
            fmt.grammar([weird], parallel=False, think="none")
    with pytest.raises(ValueError):
        fmt.grammar([], parallel=False, think="none")
    with pytest.raises(ValueError):
        fmt.grammar(TOOLS, parallel=False, think="maybe")



def test_tools_with_refs_share_one_grammar():
    """Each tool's $refs resolve in its own schema even when two tools use the same names."""
    def tool(name, leaf):
        return {"function": {"name": name, "parameters": {
            "type": "object", "properties": {"x": {"$ref": "#/$defs/leaf"}},
            "required": ["x"], "$defs": {"leaf": leaf}}}}
    tools = [tool("f", {"type": "integer"}), tool("g", {"type": "string"})]
    g = FORMATS["hermes"].grammar(tools, parallel=True, think="none")
    write = WRITERS["hermes"]
    check_table(g, [write([("f", '{"x": 1}'), ("g", '{"x": "s"}')])],
                [write([("f", '{"x": "s"}')]), write([("g", '{"x": 1}')])])
