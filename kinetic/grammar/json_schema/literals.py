"""`enum` and `const`: a set of exact JSON texts, as a trie (ir.literal_trie: an alternation
of n literals would give the matcher a parser state of n stacks; 100,000 strings wedged the
server).
"""

from __future__ import annotations

import json
from kinetic.grammar.json_schema.keywords import TYPES


def literal_bytes(value) -> bytes:
    """The JSON text a value is written as (compact, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def json_key(value) -> str:
    """A canonical text of a value, for JSON equality (1 and 1.0 apart, as json.dumps has it)."""
    return json.dumps(value, sort_keys=True)


def same_json(v, values) -> bool:
    """Whether v is among values by JSON equality."""
    key = json_key(v)
    return any(json_key(u) == key for u in values)


def is_type(v, t: str) -> bool:
    if t == "string":
        return isinstance(v, str)
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool) or (
            isinstance(v, float) and v.is_integer())
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == "boolean":
        return isinstance(v, bool)
    if t == "null":
        return v is None
    if t == "object":
        return isinstance(v, dict)
    if t == "array":
        return isinstance(v, list)
    return False


def of_types(values: list, types) -> list:
    """The values of one of `types` (a type name or a list of them)."""
    tl = types if isinstance(types, list) else [types]
    return [v for v in values if any(is_type(v, t) for t in tl)]


def value_types(values: list) -> set:
    return {t for v in values for t in TYPES if is_type(v, t)}
