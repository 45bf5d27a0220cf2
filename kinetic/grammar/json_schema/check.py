"""A schema checked before anything is built: every subschema and every `$ref` target, each
once, so in time linear in the schema's size.

In each, every keyword of the table must have its value type (the table's `value`: `required`
a list of strings, `minLength` an integer of at least 0, `anyOf` a non-empty list of schemas...),
or it is an InvalidSchema naming the keyword, what it must be and the JSON pointer of the value
at fault; and the schema must stay within the SchemaLimits, or it is a SchemaTooLarge. After
check_schema, the converter may read each keyword as its type: a `required` of 5 or a
`maxItems` of 1.5 never reaches a handler. check_types is the first half alone, for a schema
checked before it is compiled, or that is never compiled (the API checks each tool's
parameters as it parses a request).
"""

from __future__ import annotations

from collections.abc import Iterator

from kinetic.grammar.json_schema.keywords import KEYWORDS, MISSING, esc, ref_target
from kinetic.grammar.json_schema.limits import (InvalidSchema, SchemaLimits, json_size,
                                                too_large)


def check_schema(root, limits: SchemaLimits) -> None:
    """Raises InvalidSchema for the first keyword of `root` whose value does not have its type
    and SchemaTooLarge for the first limit it passes; returns None when neither is found."""
    for s, path, depth in subschemas(root):
        if depth > limits.depth:
            raise too_large(limits, "depth", "a subschema", path, f"is nested {depth} deep")
        _check_node(s, path, limits)
    size = json_size(root)   # (after the walk: a huge enum is named as such)
    if size > limits.schema_bytes:
        raise too_large(limits, "schema_bytes", "the schema", "", f"is {size} bytes of JSON")


def check_types(root) -> None:
    """Raises InvalidSchema as check_schema does; checks no limit."""
    for _ in subschemas(root):
        pass


def subschemas(root) -> Iterator[tuple[dict, str, int]]:
    """(subschema, its JSON pointer, its depth) for `root`, for each subschema the keyword table
    says a keyword holds and for each same-document `$ref` target, each once (objects only: a
    boolean schema has no keywords). Each one's values are type-checked before it is yielded
    and before its subschemas are looked at: InvalidSchema for the first that is wrong."""
    if not isinstance(root, (dict, bool)):
        raise InvalidSchema("the schema", "an object or a boolean", "")
    # the document's subschemas first, with their depth; then the $ref targets no keyword
    # holds (a pointer may name any node), each as a root of its own
    work = [(root, "", 1)]
    refs: list[tuple[str, str]] = []
    seen: set[int] = set()
    while work or refs:
        if not work:
            ref, at = refs.pop()
            target = ref_target(root, ref)
            if target is MISSING:
                continue
            if not isinstance(target, (dict, bool)):
                raise InvalidSchema("$ref", "a pointer to a schema, an object or a boolean", at)
            work.append((target, ref[1:], 1))
        s, path, depth = work.pop()
        if not isinstance(s, dict) or id(s) in seen:
            continue
        seen.add(id(s))
        _check_values(s, path)
        yield s, path, depth
        for k, v in s.items():
            kw = KEYWORDS.get(k)
            if kw is None or not kw.holds:
                continue
            at = f"{path}/{esc(k)}"
            if isinstance(v, dict) and kw.holds in ("schema", "schema_or_list"):
                work.append((v, at, depth + 1))
            elif isinstance(v, list) and kw.holds in ("list", "schema_or_list"):
                work.extend((x, f"{at}/{i}", depth + 1) for i, x in enumerate(v))
            elif isinstance(v, dict) and kw.holds == "map":
                work.extend((x, f"{at}/{esc(n)}", depth + 1) for n, x in v.items())
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            refs.append((ref, f"{path}/$ref"))


def _check_values(s: dict, path: str) -> None:
    for k, v in s.items():
        kw = KEYWORDS.get(k)
        fault = kw.fault(v) if kw is not None else None
        if fault is not None:
            raise InvalidSchema(k, kw.must, f"{path}/{esc(k)}{fault}")


def _check_node(s: dict, path: str, limits: SchemaLimits) -> None:
    values = s.get("enum")
    if isinstance(values, list):
        if len(values) > limits.enum_values:
            raise too_large(limits, "enum_values", "enum", f"{path}/enum",
                            f"has {len(values)} values")
    for k in ("enum", "const"):
        if k in s:
            n = json_size(s[k])
            if n > limits.enum_bytes:
                raise too_large(limits, "enum_bytes", k, f"{path}/{k}", f"is {n} bytes of JSON")
    for k in ("anyOf", "oneOf", "allOf", "type"):
        if isinstance(s.get(k), list) and len(s[k]) > limits.alternatives:
            raise too_large(limits, "alternatives", k, f"{path}/{k}",
                            f"has {len(s[k])} branches")
    for k in ("properties", "patternProperties", "required"):
        if isinstance(s.get(k), (dict, list)) and len(s[k]) > limits.properties:
            raise too_large(limits, "properties", k, f"{path}/{k}", f"has {len(s[k])} names")
    for k in ("minLength", "minItems"):   # (counts: _check_values saw them)
        if s.get(k, 0) > limits.repeat:
            raise too_large(limits, "repeat", k, f"{path}/{k}", f"is {s[k]}")
