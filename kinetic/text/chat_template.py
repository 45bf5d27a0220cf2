"""Chat templates rendered the way llama-server --jinja renders them.

A GGUF file carries its chat template as Jinja source. llama-server does not hand the OpenAI
messages to that template as they arrive: it normalises them (content parts joined or wrapped to
suit the template, JSON-string tool-call arguments parsed when the template reads them as
objects, a system message folded into the next one when the template ignores system messages,
a few model families' own adjustments), adds its own variables, continues a final assistant
message instead of opening a new turn, and strips a leading BOS that tokenization adds again.
`ChatTemplate.render` does all of that, so its output is the prompt llama-server evaluates.
Templates run in jinja2's immutable sandbox.

What a template can do is found as llama.cpp finds it: by rendering small probe conversations
whose values record how the template touched them (see `_probe_caps`).
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MEDIA_MARKER = "<__media__>"  # what llama-server puts where an image or audio part was

# llama-server's fallback when the model has no template; the newlines inside the Jinja string
# literals are real newlines in llama.cpp's source too.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}")

# Conditions in two real templates that raise on conversations llama-server accepts; llama.cpp
# replaces them with `if false`, and so do we. (marker, trigger, condition)
_SOURCE_PATCHES = [
    ("<|channel|>", "in message.content or",
     "{%- if \"<|channel|>analysis<|message|>\" in message.content or "
     "\"<|channel|>final<|message|>\" in message.content %}"),
    ("[TOOL_CALLS]", "if (message['content'] is none or",
     "{%- if (message['content'] is none or message['content'] == '' or "
     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
]

class ChatTemplateError(ValueError):
    """A template that cannot render this conversation; the message says why (the template's
    own raise_exception text, or the Jinja error and its line)."""


class _Raised(Exception):
    """raise_exception() called by a template."""


def _raise_exception(message: Any = "") -> None:
    raise _Raised(str(message))


def _strftime_now(fmt: str) -> str:
    return time.strftime(fmt, time.localtime())


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' tojson: json.dumps without jinja2's HTML escaping of <, >, & and '."""
    seps = tuple(separators) if separators is not None else None
    return json.dumps(_plain(value), ensure_ascii=ensure_ascii, indent=indent, separators=seps,
                      sort_keys=sort_keys)


def _plain(value: Any) -> Any:
    """JSON-ready data: undefined is null and lazy sequences (the output of map, select, ...)
    are lists, as they are values in llama.cpp. Probe values are marked as used on the way."""
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        _mark(value)
        return str.__str__(value) if isinstance(value, str) else value
    _mark(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in dict.items(value)}
    if isinstance(value, list):
        return [_plain(v) for v in list.__iter__(value)]
    try:
        return [_plain(v) for v in value]
    except TypeError:
        return str(value)


class _InputList(list):
    """A list from the caller's data. Templates may not mutate it; lists a template builds
    itself may take append/pop, as llama.cpp allows (Kimi K2's template relies on that)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %} block (it marks assistant text for training): llama.cpp
    ignores the tags and renders what is between them, and so do we."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Undefined(jinja2.ChainableUndefined):
    """llama.cpp's undefined: its attributes are undefined too, and `+` with a string treats it
    as empty (templates such as firefunction-v2 rely on both)."""

    __slots__ = ()

    def __add__(self, other: Any) -> Any:
        return other if isinstance(other, str) else self._fail_with_undefined_error()

    __radd__ = __add__


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox configured as transformers configures it, with llama.cpp's
    leniency about undefined and null values."""

    intercepted_binops = frozenset({"+"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, undefined=_Undefined,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        # from_json: DeepSeek V3.2/V4 name it; llama.cpp never reaches that branch because it
        # hands those templates parsed arguments, but jinja2 needs the name to compile.
        # safe stays a plain string: jinja2's Markup would HTML-escape whatever is added to it
        self.filters.update(tojson=_tojson, from_json=json.loads, safe=lambda value: value)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        # llama.cpp joins a string with null as if null were ""
        if left is None and isinstance(right, str) or right is None and isinstance(left, str):
            return (left or "") + (right or "")
        return super().call_binop(context, operator, left, right)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja2 would hand back a silent undefined; a template probing internals must fail
        kind = "list" if isinstance(obj, list) else type(obj).__name__
        raise SecurityError(f"access to attribute {attribute!r} of a {kind} is not allowed")

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if type(obj) is list and attr in ("append", "pop"):
            return True
        return super().is_safe_attribute(obj, attr, value)


def _template_line(exc: BaseException) -> int | None:
    """The template line a runtime error happened on (jinja2 maps its frames to the source)."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _compile(env: jinja2.Environment, source: str) -> jinja2.Template:
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        message = f"chat template syntax error on line {e.lineno}: {e.message}"
        raise ChatTemplateError(message) from None


def _run(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render, turning every failure into ChatTemplateError."""
    try:
        return template.render(context)
    except _Raised as e:
        raise ChatTemplateError(str(e)) from None
    except Exception as e:  # whatever Python raised, it is the template's fault: say where
        line = _template_line(e)
        where = f" on line {line}" if line else ""
        kind = "forbidden operation" if isinstance(e, SecurityError) else "error"
        raise ChatTemplateError(f"chat template {kind}{where}: {e}") from None


def _freeze(value: Any) -> Any:
    """Deep copy of JSON-like data whose lists templates cannot mutate (the immutable sandbox
    already guards every dict)."""
    if isinstance(value, dict):
        return {k: _freeze(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _InputList(_freeze(v) for v in value)
    return value


def _dump_compact(value: Any) -> str:
    # how llama.cpp turns object arguments back into the string it stores
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _join_parts(parts: list[dict]) -> str:
    """llama.cpp's join of content parts: newline between texts, none around media markers."""
    text, after_media = "", False
    for part in parts:
        kind = part.get("type")
        if kind == "text":
            newline, after_media = not after_media and text != "", False
        elif kind == "media_marker":
            newline, after_media = False, True
        else:
            continue
        text += ("\n" if newline else "") + part.get("text", "")
    return text


def _parse_message(m: Any, trim: bool) -> dict:
    """One OpenAI message as llama-server stores and re-emits it (its to_json_oaicompat)."""
    if not isinstance(m, dict) or "role" not in m:
        raise ChatTemplateError(f"each message needs a role: {m!r}")
    role = m["role"]
    if "content" not in m and not (role == "assistant" and "tool_calls" in m):
        raise ChatTemplateError(f"a {role} message needs content")
    content, parts = m.get("content"), []
    if isinstance(content, list):
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": p.get("text", "")})
            elif kind in ("image_url", "input_audio", "media_marker"):
                parts.append({"type": "media_marker", "text": MEDIA_MARKER})
            else:
                raise ChatTemplateError(f"unsupported content part type {kind!r}")
        content = ""
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError("message content must be a string or a list of parts")
    strip = (lambda s: s.strip(" \t\n\r\v\f")) if trim else (lambda s: s)  # StepFun only
    content, reasoning = strip(content or ""), strip(m.get("reasoning_content") or "")
    out: dict[str, Any] = {"role": role}
    if content:
        out["content"] = content
    elif parts:
        parts = [dict(p, text=strip(p["text"])) if p["type"] == "text" else p for p in parts]
        has_media = any(p["type"] == "media_marker" for p in parts)
        out["content"] = _join_parts(parts) if has_media else parts
    else:
        out["content"] = ""
    for key, value in (("reasoning_content", reasoning), ("name", m.get("name")),
                       ("tool_call_id", m.get("tool_call_id"))):
        if value:
            out[key] = value
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if tc.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
            raise ChatTemplateError(f"unsupported tool call: {tc!r}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = _dump_compact(args)
        call: dict[str, Any] = {"type": "function",
                                "function": {"name": fn["name"], "arguments": args}}
        if tc.get("id"):
            call["id"] = tc["id"]
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out


def _parse_tools(tools: list[dict] | None) -> list[dict]:
    """Tools as llama-server re-emits them: name, description and parameters only."""
    out = []
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) or "name" not in fn:
            raise ChatTemplateError(f"unsupported tool: {tool!r}")
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {})}})
    return out


@dataclass(frozen=True)
class TemplateCaps:
    """What a template does with its input, found by probing it as llama.cpp does."""

    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_system_role: bool = True
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_parallel_tool_calls: bool = True
    supports_object_arguments: bool = False
    supports_preserve_reasoning: bool = False
    supports_reasoning_effort: bool = False


# ---------------------------------------------------------------------------------------------
# Probing: values that remember whether the template used them (llama.cpp's value stats)


class _TStr(str):
    """A probe string. Iterating it fails, as a for loop over a string does in llama.cpp."""

    def __new__(cls, value: str) -> "_TStr":
        obj = super().__new__(cls, value)
        obj.used, obj.ops = False, set()
        return obj

    def _use(self, op: str | None = None) -> None:
        self.used = True
        if op:
            self.ops.add(op)

    def __str__(self) -> str:
        self._use()
        return str.__str__(self)

    def __len__(self) -> int:
        self._use()
        return str.__len__(self)

    def __eq__(self, other: object) -> bool:
        self._use()
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        self._use()
        return str.__ne__(self, other)

    __hash__ = str.__hash__

    def __add__(self, other: str) -> str:
        self._use()
        return str.__add__(self, other)

    def __radd__(self, other: str) -> str:
        self._use()
        return other + str.__str__(self)

    def __contains__(self, item: object) -> bool:
        self._use()
        return str.__contains__(self, item)

    def __getitem__(self, key: Any) -> str:
        self._use("array_access" if isinstance(key, int) else "object_access")
        return str.__getitem__(self, key)

    def __iter__(self):
        self._use("array_access")
        raise TypeError("Expected iterable or object type in for loop: got String")


class _TDict(dict):
    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.used, self.ops = False, set()

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        self.used = True
        self.ops.add("object_access")
        _mark(value)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        self.used = True
        return self[key] if key in self else default

    def items(self):  # type: ignore[override]
        self.used = True
        return dict.items(self)


class _TList(list):
    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.used, self.ops = False, set()

    def __getitem__(self, key: Any) -> Any:
        self.used = True
        self.ops.add("array_access")
        value = list.__getitem__(self, key)
        _mark(value)
        return value

    def __iter__(self):
        self.used = True
        self.ops.add("array_access")
        return list.__iter__(self)


def _track(value: Any) -> Any:
    if isinstance(value, dict):
        return _TDict({k: _track(v) for k, v in value.items()})
    if isinstance(value, list):
        return _TList(_track(v) for v in value)
    return _TStr(value) if isinstance(value, str) else value


def _mark(value: Any, deep: bool = False) -> None:
    if isinstance(value, (_TStr, _TDict, _TList)):
        value.used = True
        if deep and isinstance(value, _TDict):
            for v in dict.values(value):
                _mark(v, True)
        elif deep and isinstance(value, _TList):
            for v in list.__iter__(value):
                _mark(v, True)


def _at(value: Any, *path: Any) -> Any:
    """Walk probe data without marking it."""
    for key in path:
        value = (dict if isinstance(value, dict) else list).__getitem__(value, key)
    return value


class _ProbeSandbox(_Sandbox):
    """The sandbox with every filter, test and attribute lookup reporting to the probe values."""

    def __init__(self) -> None:
        super().__init__()
        for table, prefix in ((self.filters, ""), (self.tests, "test_is_")):
            for name, fn in list(table.items()):
                table[name] = self._watch(fn, prefix + name, deep=name in ("tojson", "string"))
        iterable, sequence = self.tests["iterable"], self.tests["sequence"]
        self.tests["iterable"] = lambda v: isinstance(v, str) or iterable(v)
        self.tests["sequence"] = lambda v: isinstance(v, str) or sequence(v)

    @staticmethod
    def _watch(fn: Any, op: str, deep: bool) -> Any:
        skip = 1 if getattr(fn, "jinja_pass_arg", None) else 0

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if len(args) > skip and isinstance(args[skip], (_TStr, _TDict, _TList)):
                _mark(args[skip], deep)
                args[skip].ops.add(op)
            if deep and len(args) > skip:  # a plain copy: serialising must not count as access
                args = args[:skip] + (_plain(args[skip]),) + args[skip + 1:]
            return fn(*args, **kwargs)
        return watched

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, _TStr):
            obj._use(attribute)
        return super().getattr(obj, attribute)


_PROBE_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object",
        "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]


def _probe_conversation(arguments: Any, n_calls: int) -> list[dict]:
    calls = [{"id": f"call0000{i + 1}", "type": "function",
              "function": {"name": "tool1", "arguments": arguments}} for i in range(n_calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def _probe_caps(source: str) -> TemplateCaps:
    """llama.cpp's capability checks: render probe conversations, see what was touched."""
    template = _compile(_ProbeSandbox(), source)

    def run(messages: list, tools: list | None = None, **extra: Any) -> tuple:
        msgs, tls = _track(messages), _track(tools or [])
        ctx = {"messages": msgs, "tools": tls, "bos_token": "", "eos_token": "",
               "add_generation_prompt": True, **extra}
        try:
            return True, msgs, tls, template.render(ctx)
        except Exception:  # a probe the template rejects tells something too
            return False, msgs, tls, ""

    caps: dict[str, bool] = {}
    ok, msgs, _, out = run([{"role": "user", "content": "STRING_MARKER"}])
    content = _at(msgs, 0, "content")
    as_array = bool(content.ops & {"selectattr", "array_access"})
    caps["supports_typed_content"] = as_array
    caps["supports_string_content"] = ok and not (as_array and "STRING_MARKER" not in out)
    if "test_is_string" in content.ops:
        ok, msgs, _, _ = run([{"role": "user", "content": []}])
        if ok and _at(msgs, 0, "content").ops & {"selectattr", "array_access"}:
            caps["supports_typed_content"] = True

    _, msgs, _, _ = run([{"role": "system", "content": "System message"},
                         {"role": "user", "content": "User message"}])
    caps["supports_system_role"] = _at(msgs, 0, "content").used

    tools_ok = calls_ok = True
    ok, msgs, tls, _ = run(_probe_conversation({"arg": "value"}, 1), _PROBE_TOOLS)
    if ok:
        tools_ok = _at(tls, 0, "function", "name").used
        calls_ok = _at(msgs, 1, "tool_calls").used
        caps["supports_object_arguments"] = calls_ok and _at(
            msgs, 1, "tool_calls", 0, "function", "arguments", "arg").used
    if not caps.get("supports_object_arguments"):
        ok, msgs, tls, _ = run(_probe_conversation('{"arg": "value"}', 1), _PROBE_TOOLS)
        tools_ok = ok and _at(tls, 0, "function", "name").used
        calls_ok = ok and _at(msgs, 1, "tool_calls").used
    caps["supports_tools"], caps["supports_tool_calls"] = tools_ok, calls_ok

    args = {"arg": "value"} if caps.get("supports_object_arguments") else '{"arg": "value"}'
    ok, msgs, _, _ = run(_probe_conversation(args, 2), _PROBE_TOOLS)
    caps["supports_parallel_tool_calls"] = ok and _at(msgs, 1, "tool_calls", 1, "function").used

    placeholder = "<REASONING_CONTENT_PLACEHOLDER>"
    user = {"role": "user", "content": "User message"}
    answer = {"role": "assistant", "content": "Assistant message"}
    history = [user, dict(answer, reasoning_content=placeholder), user,
               dict(answer, reasoning_content="Reasoning content"), user]
    _, _, _, out = run(history, enable_thinking=True, **_preserve_flags(True))
    caps["supports_preserve_reasoning"] = placeholder in out

    effort = _TStr("low")
    run([{"role": "user", "content": "User message"}], enable_thinking=True,
        reasoning_effort=effort, reasoning_strength=effort)
    caps["supports_reasoning_effort"] = effort.used
    return TemplateCaps(**caps)


def _preserve_flags(enabled: bool) -> dict[str, bool]:
    return {"preserve_thinking": enabled, "clear_thinking": not enabled,
            "truncate_history_thinking": not enabled, "drop_thinking": not enabled}


# ---------------------------------------------------------------------------------------------
# Model families whose messages llama.cpp reshapes before rendering


def _family(src: str) -> str:
    """Which of llama.cpp's dedicated handlers takes this template ("" for its generic one);
    the first match wins, in llama.cpp's order."""
    def has(*needles: str) -> bool:
        return all(n in src for n in needles)
    rules = [
        ("ministral", has("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in src),
        ("llm_jp", has("chat_format=llm-jp-harmony-v1")),
        ("gpt_oss", has("<|channel|>")),
        ("muse", has("<atem:function_calls>", "<|eom|>")),
        ("functionary", has(">>>all", ">>>${recipient}")),
        ("kimi_k2", has("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
        ("kimi_k3", has("<|open|>", "<|close|>", "<|end_of_msg|>")),
        ("ling3", has("<role>ASSISTANT</role>", "<arg_key>")),
        ("cohere2moe", has("<|START_TEXT|>", "<|START_ACTION|>")),
        ("lfm2", has("<|tool_list_start|>", "<|tool_list_end|>") or has("List of tools: [")),
        ("gigachat", has("<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in src),
        ("minimax_m3", has("]<]minimax[>[", "<tool_call>", "<invoke name=")),
        ("deepseek_v4" if "function_calls" not in src else "deepseek_v3_2",
         has("dsml_token", "DSML") and ("function_calls" in src or "tool_calls" in src)),
        ("gemma4" if "{#- OpenAI Chat Completions:" in src else "gemma4_old",
         has("'<|tool_call>call:'")),
        ("minicpm5", has("Tool usage guidelines:", '<function name="', '<param name="')),
        ("qwen3_coder", has("<tool_call>", "<function=", "<parameter=")
         and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in src),
    ]
    return next((name for name, hit in rules if hit), "")


# How llama.cpp's dedicated handlers open a continued assistant turn (then the reasoning), and
# what they put between the reasoning and the content.
_FAMILY_TURNS = {
    "qwen3_coder": "<|im_start|>assistant\n", "gigachat": "assistant<|role_sep|>\n",
    "functionary": "<|start_header_id|>assistant<|end_header_id|>\n\n>>>all\n",
    "cohere2moe": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>",
    "kimi_k2": "<|im_assistant|>assistant<|im_middle|><think>",
    "kimi_k3": '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    "minimax_m3": "<mm:think>", "deepseek_v3_2": "<｜Assistant｜><think>",
    "deepseek_v4": "<｜Assistant｜><think>", "gemma4": "<|channel>thought\n",
    "gemma4_old": "<|channel>thought\n", "ling3": "<role>ASSISTANT</role>\n<think>",
    "gpt_oss": "<|start|>assistant<|channel|>analysis<|message|>",
    "llm_jp": "<|start|>assistant<|channel|>analysis<|message|>", "ministral": "[THINK]",
    "muse": "<|start|>assistant to=self<|message|>", "minicpm5": "<|im_start|>assistant\n<think>\n",
    "lfm2": "<|im_start|>assistant\n<think>"}
_FAMILY_MIDDLES = {
    "cohere2moe": "<|END_THINKING|><|START_TEXT|>", "kimi_k2": "</think>",
    "kimi_k3": "<|close|>think<|sep|><|open|>response<|sep|>", "minimax_m3": "</mm:think>",
    "deepseek_v3_2": "</think>", "deepseek_v4": "</think>", "gemma4": "<channel|>",
    "gemma4_old": "<channel|>", "ling3": "</think>",
    "gpt_oss": "<|end|><|start|>assistant<|channel|>final<|message|>",
    "llm_jp": "<|end|><|start|>assistant<|channel|>final<|message|>", "ministral": "[/THINK]",
    "muse": "<|eom|><|start|>assistant to=user<|message|>", "minicpm5": "\n</think>\n\n",
    "lfm2": "</think>"}


# the dedicated handlers that declare thinking support whatever the template says
_THINKING_FAMILIES = {"ministral", "llm_jp", "gpt_oss", "muse", "kimi_k2", "kimi_k3", "ling3",
                      "cohere2moe", "lfm2", "minimax_m3", "deepseek_v4", "deepseek_v3_2", "gemma4",
                      "gemma4_old", "minicpm5"}


def _reshape(family: str, messages: list[dict]) -> list[dict]:
    """The message rewrites of llama.cpp's dedicated handlers."""
    out = []
    for m in messages:
        m = dict(m)
        reasoning = m.get("reasoning_content")
        if family == "ministral" and m["role"] in ("system", "assistant"):
            blocks = []
            if isinstance(reasoning, str):
                blocks.append({"type": "thinking", "thinking": reasoning})
            content = m.get("content")
            if isinstance(content, str):
                blocks.append({"type": "text", "text": content})
            else:
                blocks += list(content or [])
            m["content"] = blocks
            m.pop("reasoning_content", None)
        elif family in ("llm_jp", "gpt_oss", "lfm2") and isinstance(reasoning, str):
            m["thinking"] = reasoning
            if family != "lfm2" and m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    if family == "deepseek_v4":
        return _sort_tool_results(out)
    if family == "gemma4_old":
        return _gemma4_tool_responses(out)
    return out


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """DeepSeek V4 lists a run of tool results in the order of the calls they answer."""
    order: dict[str, int] = {}
    i = 0
    while i < len(messages):
        role = messages[i]["role"]
        if role == "assistant" and messages[i].get("tool_calls"):
            order = {c["id"]: n for n, c in enumerate(messages[i]["tool_calls"]) if c.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end]["role"] in ("user", "tool"):
            end += 1
        slots = [k for k in range(i, end) if messages[k]["role"] == "tool"]
        if len(slots) > 1 and order:
            ranked = sorted((messages[k] for k in slots),
                            key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for k, m in zip(slots, ranked):
                messages[k] = m
        i = end
    return messages


def _gemma4_tool_responses(messages: list[dict]) -> list[dict]:
    """Older Gemma 4 templates want tool results inside the assistant turn that called them."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i].get("content")
            if isinstance(result, str):
                try:
                    result = json.loads(result)
                except ValueError:
                    pass
            name = calls[len(responses)]["function"]["name"] if len(responses) < len(calls) else ""
            name = name or messages[i].get("tool_call_id", "")
            responses.append({"name": name, "response": result})
            i += 1
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        after = messages[i] if i < len(messages) else {}
        answer = after.get("role") == "assistant" and not after.get("tool_calls")
        if answer and after.get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


# ---------------------------------------------------------------------------------------------


_SPECIAL_DEFAULTS = {  # tokenizer model -> (bos id, eos id, add_bos, add_eos), as llama.cpp's vocab
    "llama": (1, 2, True, False), "bert": (101, None, True, False),
    "gpt2": (11, 11, False, False), "t5": (None, 1, False, True),
    "rwkv": (None, None, False, False), "plamo2": (1, 2, False, False)}
_BPE_WITH_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                 "lfm2", "tekken", "chameleon"}


class ChatTemplate:
    """A model's chat template, rendering OpenAI-style conversations into prompt text exactly as
    llama-server --jinja does. `caps` holds what probing found; `supports_thinking` says whether
    the template reacts to enable_thinking (llama-server then turns thinking on by default) and
    `supports_tools` whether it describes the offered tools."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 add_bos: bool = False, add_eos: bool = False):
        if not source or source == "chatml":
            source = CHATML_TEMPLATE
        for marker, trigger, condition in _SOURCE_PATCHES:
            if marker in source and trigger in source:
                source = source.replace(condition, "{%- if false %}")
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        self._template = _compile(_Sandbox(), source)
        self._family = _family(source)
        self.caps: TemplateCaps = _probe_caps(source)
        self.supports_tools: bool = self.caps.supports_tools
        self.supports_thinking, self._think_tags = self._probe_thinking()

    @classmethod
    def from_metadata(cls, metadata: dict) -> "ChatTemplate":
        """The GGUF file's template with its BOS/EOS token texts, or llama-server's ChatML
        fallback when the file has none."""
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        kind = metadata.get("tokenizer.ggml.model", "llama")
        bos_id, eos_id, add_bos, add_eos = _SPECIAL_DEFAULTS.get(kind, (None, None, False, False))
        if kind == "gpt2":
            add_bos = metadata.get("tokenizer.ggml.pre") in _BPE_WITH_BOS
            if metadata.get("tokenizer.ggml.pre") in ("glm4", "chatglm-bpe"):
                bos_id = None

        def piece(key: str, default: int | None) -> str:
            tid = metadata.get(key, default)
            if not isinstance(tid, int) or not 0 <= tid < len(tokens):
                tid = default  # llama.cpp ignores an id past the vocabulary
            return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else ""
        return cls(metadata.get("tokenizer.chat_template") or "",
                   piece("tokenizer.ggml.bos_token_id", bos_id),
                   piece("tokenizer.ggml.eos_token_id", eos_id),
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos)),
                   add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", add_eos)))

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, *, prefill_assistant: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI chat format) with `tools` offered.

        kwargs are the request's chat_template_kwargs (enable_thinking, reasoning_effort, ...).
        As in llama-server, a final assistant message is continued rather than closed
        (prefill_assistant=False turns that off), and the text starts without the BOS token
        when tokenization adds one. Raises ChatTemplateError for what llama-server refuses."""
        thinking = kwargs.get("enable_thinking", self.supports_thinking)
        if isinstance(thinking, str):
            raise ChatTemplateError(
                'invalid type for "enable_thinking" (expected boolean, got string)')
        thinking = thinking if isinstance(thinking, bool) else self.supports_thinking
        trim = "You have access to the following functions in JSONSchema format" in self.source
        parsed = [_parse_message(m, trim) for m in messages]
        last = messages[-1] if messages else None
        if prefill_assistant and parsed and parsed[-1]["role"] == "assistant":
            if len(parsed) > 1 and parsed[-2]["role"] == "assistant":
                raise ChatTemplateError(
                    "Cannot have 2 or more assistant messages at the end of the list.")
            if parsed[-1].get("tool_calls"):
                raise ChatTemplateError(
                    "Cannot continue an assistant message that contains tool calls.")
            parsed, add_generation_prompt = parsed[:-1], False
        else:
            last = None
        ctx = self._context(self._prepare(parsed), _parse_tools(tools), thinking, kwargs)
        prompt = self._apply(ctx, add_generation_prompt)
        family = self._family
        if family in ("gpt_oss", "llm_jp") and not add_generation_prompt and "<|return|>" in prompt:
            head, _, tail = prompt.rpartition("<|return|>")
            prompt = head + "<|end|>" + tail  # gpt-oss ends a past final answer with <|end|>
        if family.startswith("gemma4") and add_generation_prompt and prompt.endswith("<turn|>\n"):
            prompt += "<|turn>model\n"  # Gemma 4 omits it after a tool response; llama.cpp adds it
        if last is not None:
            prompt += self._continuation(ctx, prompt, _parse_message(last, trim))
        return prompt

    # -- llama.cpp's steps, in its order ------------------------------------------------------

    def _prepare(self, messages: list[dict]) -> list[dict]:
        """Normalise content to what the template reads, then llama.cpp's workarounds."""
        caps = self.caps
        only_string = caps.supports_string_content and not caps.supports_typed_content
        only_typed = caps.supports_typed_content and not caps.supports_string_content
        out = []
        for m in messages:
            m = dict(m)
            if only_typed and isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            elif only_string and isinstance(m["content"], list):
                m["content"] = _join_parts(m["content"])
            if m["role"] == "developer" and "<|channel|>" not in self.source:
                m["role"] = "system"
            out.append(m)
        if not caps.supports_system_role and out and out[0]["role"] == "system":
            system = out.pop(0)
            if out:  # folded into the next message, as llama.cpp does
                if not isinstance(system["content"], str) or not isinstance(out[0]["content"], str):
                    raise ChatTemplateError("cannot merge a system message made of parts")
                out[0] = dict(out[0], content=system["content"] + "\n" + out[0]["content"])
        if caps.supports_object_arguments:
            for m in out:
                if m.get("tool_calls"):
                    m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_parse_args(
                        c["function"]["arguments"]))) for c in m["tool_calls"]]
        return _reshape(self._family, out)

    def _context(self, messages: list[dict], tools: list[dict], thinking: bool,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        ctx: dict[str, Any] = {}
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            ctx.update(_preserve_flags(kwargs["preserve_reasoning"]))
        if isinstance(kwargs.get("reasoning_effort"), str) and kwargs["reasoning_effort"]:
            ctx["reasoning_effort"] = ctx["reasoning_strength"] = kwargs["reasoning_effort"]
        ctx.update(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                   enable_thinking=thinking)
        if tools:
            ctx["tools"] = tools
        now = time.localtime()
        ctx["datetime"] = time.strftime("%b %d %Y", now)
        ctx["date_string"] = time.strftime("%d %b %Y", now)
        ctx.update(kwargs)
        return ctx

    def _apply(self, ctx: dict[str, Any], add_generation_prompt: bool) -> str:
        """One render: llama.cpp's direct apply, BOS/EOS stripping included."""
        ctx = _freeze(ctx)
        if add_generation_prompt:
            ctx["add_generation_prompt"] = True
        text = _run(self._template, ctx)
        if self.add_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text

    def _generation_prompt(self, ctx: dict[str, Any]) -> str:
        closed, opened = self._apply(ctx, False), self._apply(ctx, True)
        n = 0
        while n < min(len(closed), len(opened)) and closed[n] == opened[n]:
            n += 1
        return opened[n:]

    def _continuation(self, ctx: dict[str, Any], prompt: str, msg: dict) -> str:
        """What follows the rendered history when the last assistant message is continued:
        an opened assistant turn, the reasoning, and (unless the message stops inside its
        reasoning) the reasoning's end and the content."""
        content = msg["content"] if isinstance(msg["content"], str) else "\n\n".join(
            p["text"] for p in msg["content"] if p["type"] == "text")
        reasoning = msg.get("reasoning_content", "")
        if not (content or reasoning or msg.get("name") or msg.get("tool_call_id")):
            return ""  # llama.cpp has nothing to continue, and no generation prompt either
        whole = bool(content) or not reasoning
        family = self._family
        thinks_in_tags = "<think>" in self.source
        if family in ("functionary", "gigachat") or family == "qwen3_coder" and not thinks_in_tags:
            return _FAMILY_TURNS[family] + content
        if family == "deepseek_v4" and not reasoning:
            return "<｜Assistant｜></think>" + (content if whole else "")
        if family in _FAMILY_TURNS:
            opened, middle = _FAMILY_TURNS[family], _FAMILY_MIDDLES.get(family, "")
            if family == "qwen3_coder":  # the thinking variant (Qwen3.5, Nemotron 3, StepFun)
                opened, middle = opened + "<think>\n", "\n</think>\n\n"
            elif family == "minimax_m3":
                opened = self._generation_prompt(ctx) + opened
            elif family.startswith("gemma4"):
                opened = ("<|turn>model\n" if prompt.endswith("<turn|>\n") else "") + opened
            return opened + reasoning + (middle + content if whole else "")
        text = self._generation_prompt(ctx)
        start, end = self._think_tags
        if start:
            cut = text.find(start)
            text = (text[:cut] if cut >= 0 else text) + start + reasoning + (end if whole else "")
        return text + (content if whole else "")

    def _render_probe(self, messages: list[dict], gen: bool, thinking: bool,
                      tools: list[dict] | None = None) -> str | None:
        try:
            msgs = self._prepare([_parse_message(m, False) for m in messages])
            return self._apply(self._context(msgs, _parse_tools(tools), thinking, {}), gen)
        except ChatTemplateError:
            return None

    def _probe_thinking(self) -> tuple[bool, tuple[str, str]]:
        """Whether the template thinks (llama-server then turns enable_thinking on by default)
        and the reasoning delimiters, whitespace included, that continuations use. Like
        llama.cpp: where the template shows past reasoning, what surrounds it; otherwise what
        enable_thinking adds to the generation prompt; otherwise known older formats."""
        if self._family:
            thinks = self._family in _THINKING_FAMILIES or (
                self._family == "qwen3_coder" and "<think>" in self.source)
            return thinks, ("", "")
        user = {"role": "user", "content": "U_USER_MSG Hello END_U"}
        answer = {"role": "assistant", "content": "A_ASST_MSG I can help END_A"}
        thought = "REASON_PART I am thinking END_R"
        start = end = ""
        shown = self._render_probe([user, dict(answer, reasoning_content=thought)], False, True)
        plain = self._render_probe([user, answer], False, True)
        if shown is not None and plain is not None and thought in shown:
            found = re.search(f"({_MARKER}\\s*){re.escape(thought)}(\\s*{_MARKER}\\s*)", shown)
            if found:
                start, end = found.group(1), found.group(2)
            else:
                found = re.search(f"{re.escape(thought)}\\s*({_MARKER}\\s*)", shown)
                end = found.group(1) if found else ""
        off, on = self._render_probe([user], True, False), self._render_probe([user], True, True)
        if off is not None and on is not None and off != on:
            start, end = _tags_from_switch(off, on, start, end)
        if self.caps.supports_tool_calls:
            start, end = self._tags_from_tool_turn(user, thought) or (start, end)
        src = self.source
        old_qwen = ("content.split('</think>')" in src and "reasoning_content" not in src
                    and "<SPECIAL_12>" not in src)
        granite = "Write your thoughts between <think></think> and write your response" in src
        if not start and not end and (old_qwen or granite):
            start, end = "<think>", "</think>"  # older Qwen / DeepSeek-R1 and Granite 3.3 formats
        if all(t in src for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
                                  "<TOOL_RESPONSE>")):
            start, end = "<think>\n", "</think>"  # Nemotron Nano v2
        if "laguna_glm_thinking" in src:
            start, end = start.strip(), end.strip()
        return bool(start or end), (start, end)

    def _tags_from_tool_turn(self, user: dict, thought: str) -> tuple[str, str] | None:
        """Delimiters of templates that show reasoning only next to tool calls."""
        params = {"type": "object",
                  "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
        tools = [{"type": "function", "function": {"name": "FFF_FIRST_FUN", "parameters": params}}]
        call = {"type": "function", "id": "call00001",
                "function": {"name": "FFF_FIRST_FUN", "arguments": {"a": "VVVV", "b": "XXXX"}}}
        thinking = {"role": "assistant", "reasoning_content": thought}
        plain = self._render_probe([user, dict(thinking, content="A_ASST_MSG I can help END_A")],
                                   False, True, tools)
        shown = self._render_probe([user, dict(thinking, content=None, tool_calls=[call])],
                                   False, True, tools)
        if plain is None or shown is None or thought in plain or thought not in shown:
            return None
        found = re.search(f"({_MARKER}\\s*){re.escape(thought)}\\s*({_MARKER}\\s*)", shown)
        if found:
            return found.group(1), found.group(2)
        found = re.search(f"{re.escape(thought)}\\s*({_MARKER}\\s*)?", shown)
        return "", found.group(1) or ""


_MARKER = r"(?:<[^>]*>|\[[^\]]*\])"  # a special-token-like tag: <...> or [...]


def _tags_from_switch(off: str, on: str, start: str, end: str) -> tuple[str, str]:
    """Reasoning delimiters from what enable_thinking changes in a generation prompt."""
    n = 0
    while n < min(len(off), len(on)) and off[n] == on[n]:
        n += 1
    m = 0
    while m < min(len(off), len(on)) - n and off[-1 - m] == on[-1 - m]:
        m += 1
    only_off, only_on = off[n:len(off) - m], on[n:len(on) - m]
    if not only_off.strip() and only_on:  # thinking opens a block
        if only_on.strip() and on.endswith(only_on.strip()) and not start:
            start = only_on
    elif not only_on.strip() and only_off:  # no thinking closes an empty block
        if only_off.strip() and off.endswith(only_off.strip()) and not end:
            tags = [t for t in re.split(f"({_MARKER})", off) if t.strip()]
            if len(tags) >= 2 and tags[-1] == only_off.strip() and re.fullmatch(_MARKER, tags[-2]):
                start = tags[-2]
            end = only_off
    elif only_off.strip() and only_on.strip():  # the rest changed too: look at the tails
        for base, longer in ((on, off), (off, on)):
            anchor = base[-64:]
            pos = longer.rfind(anchor)
            if pos < 0 or pos + len(anchor) >= len(longer):
                continue
            tail = longer[pos + len(anchor):].strip()
            extra = [t for t in re.split(f"({_MARKER})", tail) if t.strip()]
            if len(extra) == 2 and all(re.fullmatch(_MARKER, t) for t in extra):
                start, end = start or extra[0], end or extra[1]
                break
    return start, end


def _parse_args(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise ChatTemplateError(f"Failed to parse tool call arguments as JSON: {e}") from None
