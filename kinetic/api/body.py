"""Request bodies decoded strictly, once, before any route reads a field (app.json_body).

A body must be:
- UTF-8 (RFC 8259; a leading BOM is skipped), so an invalid byte or an encoded surrogate is a
  400 here and never a UnicodeError later;
- JSON, with finite numbers only: NaN, Infinity and numbers past the float range (1e999) are
  refused, as are integers of more than Python's 4300 digits;
- nested at most MAX_DEPTH arrays and objects deep, counted before parsing, so that a deep
  body is a 400 and never a RecursionError in the parser, the grammar compiler or a template;
- an object none of whose strings, keys included, holds a lone surrogate (U+D800..U+DFFF):
  JSON's `\\ud800` escape can write one, but no UTF-8 text can hold it, so the tokenizer, the
  template and the answer could not encode it.

Each failure is a 400. One inside the body names the value in `param` by its path: keys
joined by dots, list indices in brackets (`messages[0].content[1].text`), a top-level field by
its name, as every other 400 does (params.py).
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any

from kinetic.api.errors import bad_request

MAX_DEPTH = 128     # arrays and objects; JSON Schemas of tests/data/jsonschemabench reach 16

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# a surrogate can only come as a \uD800..\uDFFF escape (strict UTF-8 refuses encoded ones);
# a valid pair is joined by the parser, so finding the escape only means looking closer
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 saying what is wrong (and where) otherwise."""
    if not raw.strip():
        raise bad_request("the body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise bad_request(f"the body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    # fewer brackets than the limit cannot nest past it (counting them is cheap; the scan is
    # not, on a body of many small arrays)
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH else 0
    if depth > MAX_DEPTH:
        raise bad_request(f"the body nests arrays and objects {depth} deep; the server takes "
                          f"at most {MAX_DEPTH}")
    try:
        body = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        where = lone_surrogate(body, "")
        if where is not None:
            path, is_key = where
            what = f"a key of {path or 'the body'}" if is_key else path
            raise bad_request(f"{what} is not valid Unicode: it holds a lone surrogate (a "
                              f"\\ud800-\\udfff escape that is not half of a pair)",
                              path or None)
    return body


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in a JSON text (brackets inside strings not counted)."""
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def lone_surrogate(value: Any, path: str) -> tuple[str, bool] | None:
    """(the path of the first string holding a lone surrogate, whether it is a key), or None.
    Recursive: the depth is bounded by MAX_DEPTH."""
    if isinstance(value, str):
        return (path, False) if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return path, True
            found = lone_surrogate(item, f"{path}.{key}" if path else key)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is out of range")
    return value
