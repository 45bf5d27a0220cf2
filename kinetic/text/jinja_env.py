"""The Jinja environment chat templates run in, and how a render fails.

Templates run in jinja2's immutable sandbox configured as transformers configures it (trimmed
blocks, loop controls, its tojson, raise_exception and strftime_now), with llama.cpp's leniency
about undefined and null values. Every failure, at compile or render time, comes out as
ChatTemplateError naming the template line where jinja2 can tell it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# tojson of a probe value counts as a use of it (template_caps probes through this sandbox)
from kinetic.text.probe_values import mark


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
    return json.dumps(json_ready(value), ensure_ascii=ensure_ascii, indent=indent, separators=seps,
                      sort_keys=sort_keys)


def json_ready(value: Any) -> Any:
    """JSON-ready data: undefined is null and lazy sequences (the output of map, select, ...)
    are lists, as they are values in llama.cpp. Probe values are marked as used on the way."""
    if isinstance(value, jinja2.Undefined):
        return None
    if isinstance(value, (str, int, float, bool)) or value is None:
        mark(value)
        return str.__str__(value) if isinstance(value, str) else value
    mark(value)
    if isinstance(value, dict):
        return {json_ready(k): json_ready(v) for k, v in dict.items(value)}
    if isinstance(value, list):
        return [json_ready(v) for v in list.__iter__(value)]
    try:
        return [json_ready(v) for v in value]
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


class Sandbox(ImmutableSandboxedEnvironment):
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


def compile_template(env: jinja2.Environment, source: str) -> jinja2.Template:
    """`source` compiled in `env`; a syntax error is a ChatTemplateError naming its line."""
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        message = f"chat template syntax error on line {e.lineno}: {e.message}"
        raise ChatTemplateError(message) from None


def run_template(template: jinja2.Template, context: dict[str, Any]) -> str:
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


def freeze(value: Any) -> Any:
    """Deep copy of JSON-like data whose lists templates cannot mutate (the immutable sandbox
    already guards every dict)."""
    if isinstance(value, dict):
        return {k: freeze(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return _InputList(freeze(v) for v in value)
    return value
