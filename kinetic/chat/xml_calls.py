"""The XML call format of Qwen3.5, Qwen3-Coder (and Nemotron 3, StepFun 3.5; LFM3 is assumed to
write the same shape):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Values are free text, one newline trimmed on each side. The arguments' JSON types each value by
the tool's schema where it parses (numbers, booleans, objects, arrays) and keeps strings as
written; without the tools, any value that parses as non-string JSON is taken as such.
"""

from __future__ import annotations

import json
import re

from kinetic.chat.call_format import (Malformed, ToolCall, ToolFormat, expect, loads, skip_ws,
                                      text_until)
from kinetic.grammar import UnsupportedSchema
from kinetic.grammar.ir import Rep, chars, lit, opt, seq, star

_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_NAME_CHAR = chars([(ord(">"), ord(">")), (10, 10)], negate=True)


class QwenXml(ToolFormat):
    name = "qwen3_xml"
    markers = ("<tool_call>", "</tool_call>")
    start = "<tool_call>"

    def _parse_section(self, text, at, schemas):
        calls = []
        while True:
            call, at = _parse_call(text, at, schemas)
            calls.append(call)
            if not text.startswith(self.start, skip_ws(text, at)):
                return calls, at
            at = skip_ws(text, at)

    def _call(self, b, name, params, prefix):
        _check_name(name, f"/{name}")
        value = text_until(b, "</parameter>", "xml-value")

        def param(key):
            return seq(lit(f"<parameter={key}>\n"), value, lit("\n"))

        props = params.get("properties")
        required = list(params.get("required") or [])
        if not isinstance(props, dict):
            body = [star(seq(lit("<parameter="), Rep(_NAME_CHAR, 1, None), lit(">\n"), value,
                             lit("\n")))]
        else:
            keys = list(props) + [k for k in required if k not in props]
            for k in keys:
                _check_name(k, f"/{name}/properties/{k}")
            body = [param(k) if k in required else opt(param(k)) for k in keys]
        return seq(lit(f"<tool_call>\n<function={name}>\n"), *body,
                   lit("</function>\n</tool_call>"))


def _check_name(name: str, path: str) -> None:
    if not name or ">" in name or "\n" in name:
        raise UnsupportedSchema("a name with '>' or a newline in the XML call format", path)


def _parse_call(text: str, at: int, schemas: dict) -> tuple[ToolCall, int]:
    at = skip_ws(text, expect(text, at, "<tool_call>"))
    m = _FUNCTION.match(text, at)
    if not m:
        raise Malformed("no <function=...> in <tool_call>")
    name, at = m.group(1).strip(), m.end()
    props = schemas.get(name, {}).get("properties")
    props = props if isinstance(props, dict) else {}
    args = {}
    while p := _PARAMETER.match(text, skip_ws(text, at)):
        end = text.find("</parameter>", p.end())
        if end < 0:
            raise Malformed("unclosed <parameter>")
        raw = text[p.end():end]
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        key = p.group(1).strip()
        args[key] = _typed(raw, props.get(key))
        at = end + len("</parameter>")
    at = expect(text, skip_ws(text, at), "</function>")
    at = expect(text, skip_ws(text, at), "</tool_call>")
    return ToolCall(name, json.dumps(args, ensure_ascii=False)), at


def _typed(raw: str, schema) -> object:
    """The value of a parameter: JSON of a type the schema allows (any non-string type when the
    schema names none), else the text as written."""
    try:
        value = loads(raw)
    except ValueError:
        return raw
    if isinstance(value, str):
        return raw
    types = schema.get("type") if isinstance(schema, dict) else None
    if types is None:
        return value
    types = types if isinstance(types, list) else [types]
    return value if any(_is_type(value, t) for t in types) else raw


def _is_type(v, t: str) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return {"boolean": bool, "object": dict, "array": list, "null": type(None)}.get(t) is type(v)
