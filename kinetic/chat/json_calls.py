"""The call formats whose arguments are JSON objects: Hermes / Qwen3 (<tool_call> JSON
</tool_call>), LFM2 (a list between <|tool_call_start|> and <|tool_call_end|>), Mistral
([TOOL_CALLS]name[ARGS]{...}, or Nemo's [TOOL_CALLS][{...}, ...]) and Llama 3 (a bare
{"name": ..., "parameters": {...}} as the whole reply)."""

from __future__ import annotations

import ast
import json
import re

from kinetic.chat.call_format import (Malformed, ToolCall, ToolFormat, call_from_object,
                                      decode_json, expect, json_name, loads, skip_ws)
from kinetic.grammar.ir import Rep, chars, lit, seq
from kinetic.grammar.json_schema import schema_expr


def _json_call(b, name: str, params: dict, prefix: str, key: str = "arguments"):
    """{"name": NAME, "arguments": ARGS, as the templates write it (the object left open)."""
    return seq(lit(f'{{"name": {json_name(name)}, "{key}": '), schema_expr(b, params, prefix))


class Hermes(ToolFormat):
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    start = "<tool_call>"

    def _calls_start(self, text):
        # Qwen2.5-Coder writes its calls as bare objects, or in a ```json fence, without the
        # tags: read those too
        at = super()._calls_start(text)
        if at is None and (text.lstrip().startswith("{") or _FENCE_OPEN.match(text)):
            return 0
        return at

    def hold_from(self, text, sent):
        if not sent and _may_be_bare_calls(text):
            return 0   # may be bare call objects: hold until the end
        return super().hold_from(text, sent)

    def _parse_section(self, text, at, schemas):
        if not text.startswith(self.start, at):
            return _fenced_or_bare_calls(text, at)
        calls = []
        while True:
            at = expect(text, at, "<tool_call>")
            obj, at = decode_json(text, at)
            calls.append(call_from_object(obj))
            at = expect(text, skip_ws(text, at), "</tool_call>")
            if not text.startswith(self.start, skip_ws(text, at)):
                return calls, at
            at = skip_ws(text, at)

    def _call(self, b, name, params, prefix):
        return seq(lit("<tool_call>\n"), _json_call(b, name, params, prefix),
                   lit("}\n</tool_call>"))


class Lfm2(ToolFormat):
    """<|tool_call_start|>[{"name": ..., "arguments": {...}}, ...]<|tool_call_end|>; the
    pythonic [f(a="x"), g()] that LFM2 writes unprompted (and LFM2.5's template renders) is
    read too. The grammar forces the JSON list."""

    name = "lfm2"
    markers = ("<|tool_call_start|>", "<|tool_call_end|>")
    start = "<|tool_call_start|>"
    list_open, list_sep, list_close = "<|tool_call_start|>[", ", ", "]<|tool_call_end|>"

    def _parse_section(self, text, at, schemas):
        calls = []
        while True:
            at = expect(text, at, self.start)
            end = text.find("<|tool_call_end|>", at)
            if end < 0:
                raise Malformed("unclosed <|tool_call_start|>")
            calls += _lfm2_calls(text[at:end].strip())
            at = end + len("<|tool_call_end|>")
            if not text.startswith(self.start, skip_ws(text, at)):
                return calls, at
            at = skip_ws(text, at)

    def _call(self, b, name, params, prefix):
        return seq(_json_call(b, name, params, prefix), lit("}"))


def _lfm2_calls(inner: str) -> list[ToolCall]:
    try:
        value = loads(inner)
    except ValueError:
        return _pythonic_calls(inner)
    items = value if isinstance(value, list) else [value]
    return [call_from_object(item) for item in items]


def _pythonic_calls(inner: str) -> list[ToolCall]:
    """[f(a="x", b={"k": true}), g()] as calls (keyword arguments only)."""
    try:
        tree = ast.parse(inner, mode="eval").body
    except SyntaxError:
        raise Malformed("neither JSON nor Python calls") from None
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in items:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
            raise Malformed("not a call with keyword arguments")
        args = {kw.arg: _literal(kw.value) for kw in node.keywords}
        if None in args:
            raise Malformed("**kwargs in a call")
        calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
    return calls


_NAMED = {"true": True, "false": False, "null": None, "True": True, "False": False,
          "None": None}


def _literal(node):
    """A Python literal, or JSON's true/false/null as the templates write objects."""
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise Malformed("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


_MISTRAL_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class Mistral(ToolFormat):
    """[TOOL_CALLS]name[ARGS]{...} per call (Mistral Small 3.2, Devstral, Ministral; an id as
    [CALL_ID]id before [ARGS] is read too). Nemo's [TOOL_CALLS][{...}, ...] list is read as
    well; `MistralNemo` forces it."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    start = "[TOOL_CALLS]"
    list_sep = ""

    def _parse_section(self, text, at, schemas):
        calls = []
        while True:
            at = skip_ws(text, expect(text, at, self.start))
            if text.startswith("[", at):
                items, at = decode_json(text, at)
                if not isinstance(items, list):
                    raise Malformed("[TOOL_CALLS] without a list")
                calls += [call_from_object(item) for item in items]
            else:
                call, at = _mistral_call(text, at)
                calls.append(call)
            if not text.startswith(self.start, skip_ws(text, at)):
                return calls, at
            at = skip_ws(text, at)

    def _call(self, b, name, params, prefix):
        return seq(lit(f"[TOOL_CALLS]{name}[ARGS]"), schema_expr(b, params, prefix))


def _mistral_call(text: str, at: int) -> tuple[ToolCall, int]:
    m = _MISTRAL_NAME.match(text, at)
    if not m:
        raise Malformed("no function name after [TOOL_CALLS]")
    at = m.end()
    if text.startswith("[CALL_ID]", at):
        at = text.find("[ARGS]", at)
        if at < 0:
            raise Malformed("[CALL_ID] without [ARGS]")
    args, at = decode_json(text, expect(text, at, "[ARGS]"))
    if not isinstance(args, dict):
        raise Malformed("[ARGS] is not an object")
    return ToolCall(m.group(), json.dumps(args, ensure_ascii=False)), at


_ALNUM = chars([(48, 57), (65, 90), (97, 122)])


class MistralNemo(Mistral):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "9 alphanumerics"}, ...]"""

    name = "mistral_nemo"
    markers = ("[TOOL_CALLS]",)
    list_open, list_sep, list_close = "[TOOL_CALLS][", ", ", "]"

    def _call(self, b, name, params, prefix):
        return seq(_json_call(b, name, params, prefix), lit(', "id": "'), Rep(_ALNUM, 9, 9),
                   lit('"}'))


class Llama3(ToolFormat):
    """The whole reply is {"name": ..., "parameters": {...}} ("arguments" is read too); several
    calls are such objects one after another. Also the format of templates we do not know."""

    name = "llama3"
    markers = ()

    def _calls_start(self, text):
        return 0 if text.lstrip().startswith("{") else None

    def hold_from(self, text, sent):
        if sent:
            return len(text)   # the reply started as text: no calls
        at = skip_ws(text, 0)
        return 0 if at == len(text) or text[at] == "{" else len(text)

    def _parse_section(self, text, at, schemas):
        return _bare_calls(text, at)

    def _call(self, b, name, params, prefix):
        return seq(_json_call(b, name, params, prefix, key="parameters"), lit("}"))


def _bare_calls(text: str, at: int) -> tuple[list[ToolCall], int]:
    """Call objects one after another, whitespace between, up to the end of the text."""
    calls = []
    at = skip_ws(text, at)
    while at < len(text):
        obj, at = decode_json(text, at)
        calls.append(call_from_object(obj))
        at = skip_ws(text, at)
    return calls, at


_FENCE_OPEN = re.compile(r"\s*```(?:json)?[ \t]*\n?\s*(?=\{)")
_FENCE_START = re.compile(r"\s*(`{1,3}|```j|```js|```jso|```json)?[ \t]*\n?\s*\Z")


def _may_be_bare_calls(text: str) -> bool:
    """Whether a reply so far may still be call objects without tags (bare or fenced)."""
    return (text.lstrip().startswith("{") or _FENCE_OPEN.match(text) is not None
            or _FENCE_START.match(text) is not None)


def _fenced_or_bare_calls(text: str, at: int) -> tuple[list[ToolCall], int]:
    """Call objects without tags: bare up to the end, or inside one ```json fence."""
    m = _FENCE_OPEN.match(text, at)
    if m is None:
        return _bare_calls(text, at)
    calls, at = [], m.end()
    while True:
        obj, at = decode_json(text, at)
        calls.append(call_from_object(obj))
        at = skip_ws(text, at)
        if text.startswith("```", at):
            return calls, at + 3
