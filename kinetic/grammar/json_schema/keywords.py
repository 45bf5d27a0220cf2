"""The keyword table: every JSON Schema keyword kinetic knows, the type its value must have,
what it does with it, and the limits that bound it. The converter reads it (which keywords
validate, which imply a type, how allOf joins two values, which forms are refused), check.py
reads it (each value's type, where subschemas are), and docs.py renders it into the package
docstring and docs/server.md, so the three agree.

A keyword not in the table is ignored, as JSON Schema ignores unknown keywords.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from urllib.parse import unquote
from typing import Callable

ENFORCED = "enforced"       # the grammar holds the answer to it
PARTIAL = "partial"         # enforced in the forms `enforced` says, refused in the others
REFUSED = "refused"         # always a 400 (UnsupportedSchema naming it and its JSON pointer)
ANNOTATION = "annotation"   # ignored, as JSON Schema ignores it
CONTAINER = "container"     # holds subschemas for `$ref`; no constraint by itself

TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")
FLOAT_MAX = sys.float_info.max   # numbers.py works in floats, so a bound must fit in one


# --- value types -------------------------------------------------------------------------

def _schema(v) -> bool:
    return isinstance(v, (dict, bool))


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v) -> bool:   # (NaN and infinities fail the comparison)
    return isinstance(v, (int, float)) and not isinstance(v, bool) and -FLOAT_MAX <= v <= FLOAT_MAX


def _names(v) -> bool:
    return isinstance(v, list) and all(isinstance(n, str) for n in v)


def _type_name(v) -> bool:
    return isinstance(v, str) and v in TYPES


def _whole(ok: Callable[[object], bool]):
    return lambda v: None if ok(v) else ""


def _items(ok: Callable[[object], bool], empty: bool = True):
    """A list of values that pass `ok`: the fault is "" (not such a list) or "/i"."""
    def fault(v):
        if not isinstance(v, list) or not (v or empty):
            return ""
        return next((f"/{i}" for i, x in enumerate(v) if not ok(x)), None)
    return fault


def _entries(ok: Callable[[object], bool]):
    """An object whose values pass `ok`: the fault is "" (not an object) or "/name"."""
    def fault(v):
        if not isinstance(v, dict):
            return ""
        return next((f"/{esc(k)}" for k, x in v.items() if not ok(x)), None)
    return fault


def _either(ok: Callable[[object], bool], then):
    return lambda v: None if ok(v) else then(v)


@dataclass(frozen=True)
class Value:
    """A keyword's value type, as the meta-schemas of drafts 4 to 2020-12 give it."""
    must: str                                # what the value must be (messages, docs)
    fault: Callable[[object], str | None]    # None if the value is one, else the JSON pointer
                                             # of the fault below the keyword ("": the value)
    holds: str = ""                          # subschemas in it: schema, list, map,
                                             # schema_or_list (check.py walks them)


VALUES = {
    "schema": Value("a schema (an object or a boolean)", _whole(_schema), "schema"),
    "schemas": Value("a non-empty list of schemas (objects or booleans)",
                     _items(_schema, empty=False), "list"),
    "schema_or_schemas": Value("a schema or a list of schemas (objects or booleans)",
                               _either(_schema, _items(_schema)), "schema_or_list"),
    "schema_map": Value("an object of schemas (objects or booleans)", _entries(_schema), "map"),
    "names": Value("a list of property names (strings)", _whole(_names)),
    "names_map": Value("an object of lists of property names", _entries(_names)),
    "names_or_schema_map": Value("an object of lists of property names or schemas",
                                 _entries(lambda x: _names(x) or _schema(x)), "map"),
    "types": Value(f"a type name ({', '.join(TYPES)}) or a non-empty list of them",
                   _either(_type_name, _items(_type_name, empty=False))),
    "count": Value("an integer of at least 0", _whole(_count)),
    "number": Value("a number within the float range", _whole(_number)),
    "number_or_flag": Value("a number within the float range, or draft 4's boolean",
                            _whole(lambda v: isinstance(v, bool) or _number(v))),
    "string": Value("a string", _whole(lambda v: isinstance(v, str))),
    "bool": Value("true or false", _whole(lambda v: isinstance(v, bool))),
    "list": Value("a list", _whole(lambda v: isinstance(v, list))),
    "any": Value("any JSON value", lambda v: None),
}


# --- keywords --------------------------------------------------------------------------

@dataclass(frozen=True)
class Keyword:
    name: str
    kind: str
    type: str | None = None     # the type whose handler reads it; None: the converter core
    infers: bool = False        # whether it makes a schema without `type` of that type
    value: str = field(kw_only=True)  # its value's type: a key of VALUES
    enforced: str = ""          # what is enforced (ENFORCED, PARTIAL)
    refused: str = ""           # what is refused, and why (REFUSED, PARTIAL)
    narrowed: str = ""          # how the grammar may be narrower (every answer still validates)
    merge: str = "same"         # how allOf joins two values: same (else refused), max, min,
                                # union, types, properties, false_wins, branches
    limits: tuple[str, ...] = ()  # SchemaLimits fields that bound it
    refuse: Callable[[dict], str | None] | None = None  # gen's check of a schema: the feature
                                # to name if refused (else its handler refuses)

    def __post_init__(self):
        if self.value not in VALUES:
            raise ValueError(f"keyword {self.name}: no value type {self.value!r}")

    @property
    def validates(self) -> bool:
        return self.kind in (ENFORCED, PARTIAL, REFUSED)

    @property
    def holds(self) -> str:
        """The subschemas in its value: schema, list, map, schema_or_list or ""."""
        return VALUES[self.value].holds

    @property
    def must(self) -> str:
        return VALUES[self.value].must

    def fault(self, v) -> str | None:
        """None if `v` has this keyword's value type, else the JSON pointer of the fault below
        the keyword ("": `v` itself, "/0": its first item...)."""
        return VALUES[self.value].fault(v)


def is_not_required(x) -> bool:
    return (isinstance(x, dict) and set(x) == {"required"} and isinstance(x["required"], list)
            and bool(x["required"]))


def _refuse_not(s: dict):
    if is_not_required(s["not"]) and s.get("type", infer_type(s)) == "object":
        return None   # objects.py tracks it
    return "not"


def _refuse_property_names(s: dict):
    v = s["propertyNames"]
    return None if isinstance(v, dict) and set(v) <= {"pattern"} else "propertyNames"


def _always(name: str):
    return lambda s: name


TABLE = [
    # any value
    Keyword("type", ENFORCED, value="types", enforced="one type or a list", merge="types",
            limits=("alternatives",)),
    Keyword("enum", ENFORCED, value="list", enforced="its values, filtered by the other "
                                                     "keywords",
            limits=("enum_values", "enum_bytes")),
    Keyword("const", ENFORCED, value="any", enforced="filtered by the other keywords",
            limits=("enum_bytes",)),
    Keyword("nullable", ENFORCED, value="bool", enforced="OpenAPI's: or null"),
    Keyword("allOf", ENFORCED, value="schemas", enforced="merged into one schema",
            limits=("alternatives", "steps")),
    Keyword("anyOf", ENFORCED, value="schemas", merge="branches",
            limits=("alternatives", "steps")),
    Keyword("oneOf", PARTIAL, value="schemas", merge="branches", limits=("alternatives",),
            enforced="when no two branches can hold at once, told apart by type, enum or a "
                     "required property, or when every branch only requires properties",
            refused="branches that may overlap: exactly one cannot be checked"),
    Keyword("$ref", PARTIAL, value="string",
            enforced="into the same document: `#/$defs/...`, `#/definitions/...` or any JSON "
                     "pointer, recursion included",
            refused="to another document or by anchor: the server fetches nothing",
            limits=("ref_depth", "depth")),
    Keyword("$defs", CONTAINER, value="schema_map"),
    Keyword("definitions", CONTAINER, value="schema_map"),
    Keyword("if", REFUSED, value="schema", refuse=_always("if"),
            refused="a condition on the value being written"),
    Keyword("then", REFUSED, value="schema", refuse=_always("then"), refused="as `if`"),
    Keyword("else", REFUSED, value="schema", refuse=_always("else"), refused="as `if`"),
    # objects
    Keyword("properties", ENFORCED, "object", True, value="schema_map", merge="properties",
            enforced="in the schema's key order", limits=("properties",),
            narrowed="key order fixed: declared order, then extra keys"),
    Keyword("required", ENFORCED, "object", True, value="names", merge="union",
            limits=("properties",)),
    Keyword("additionalProperties", ENFORCED, "object", True, value="schema",
            merge="false_wins",
            narrowed="extra keys written without escapes and never one of the named "
                     "properties"),
    Keyword("patternProperties", ENFORCED, "object", True, value="schema_map",
            limits=("properties",),
            narrowed="a pattern that matches a named property adds no keys"),
    Keyword("propertyNames", PARTIAL, "object", True, value="schema",
            refuse=_refuse_property_names, enforced="a `pattern`",
            refused="other keywords in it"),
    Keyword("minProperties", ENFORCED, "object", True, value="count", merge="max",
            limits=("combinations",), narrowed="met by extra keys with at most one of them"),
    Keyword("maxProperties", ENFORCED, "object", True, value="count", merge="min",
            limits=("combinations",)),
    Keyword("dependentRequired", ENFORCED, "object", True, value="names_map",
            limits=("combinations",)),
    Keyword("dependencies", PARTIAL, "object", True, value="names_or_schema_map",
            enforced="lists of property names",
            refused="with a schema, as `dependentSchemas`", limits=("combinations",)),
    Keyword("not", PARTIAL, type="object", value="schema", refuse=_refuse_not,
            enforced="`not: {required: [...]}` on an object",
            refused="any other form: the complement of a schema is not built"),
    Keyword("dependentSchemas", REFUSED, "object", value="schema_map",
            refuse=_always("dependentSchemas"),
            refused="a schema that applies when a property is present"),
    Keyword("unevaluatedProperties", REFUSED, "object", value="schema",
            refuse=_always("unevaluatedProperties"),
            refused="depends on what the other keywords evaluated"),
    # arrays
    Keyword("items", ENFORCED, "array", True, value="schema_or_schemas",
            enforced="a schema, or draft 4's list of schemas"),
    Keyword("prefixItems", ENFORCED, "array", True, value="schemas"),
    Keyword("additionalItems", ENFORCED, "array", value="schema",
            enforced="after draft 4's list of `items`"),
    Keyword("minItems", ENFORCED, "array", True, value="count", merge="max",
            limits=("repeat",)),
    Keyword("maxItems", ENFORCED, "array", True, value="count", merge="min",
            limits=("repeat",),
            narrowed="past `minItems` by more than the `repeat` limit, narrowed to that"),
    Keyword("uniqueItems", PARTIAL, "array", value="bool",
            enforced="on items that are an `enum` or `const`",
            refused="on other items: distinct values cannot be checked by a grammar",
            narrowed="the distinct enum values in enum order", limits=("combinations",)),
    Keyword("contains", REFUSED, "array", value="schema", refuse=_always("contains"),
            refused="a count of matching items"),
    Keyword("minContains", REFUSED, "array", value="count", refuse=_always("minContains"),
            refused="as `contains`"),
    Keyword("maxContains", REFUSED, "array", value="count", refuse=_always("maxContains"),
            refused="as `contains`"),
    Keyword("unevaluatedItems", REFUSED, "array", value="schema",
            refuse=_always("unevaluatedItems"),
            refused="depends on what the other keywords evaluated"),
    # strings
    Keyword("minLength", ENFORCED, "string", True, value="count", merge="max",
            limits=("repeat",)),
    Keyword("maxLength", ENFORCED, "string", True, value="count", merge="min",
            limits=("repeat",),
            narrowed="past `minLength` by more than the `repeat` limit, narrowed to that"),
    Keyword("pattern", PARTIAL, "string", True, value="string", limits=("repeat",),
            enforced="the ECMA-262 subset of character classes, groups, alternation and "
                     "counts",
            refused="lookaround, backreferences, word boundaries: not regular",
            narrowed="with `minLength`/`maxLength`, narrowed to fit them"),
    Keyword("format", PARTIAL, "string", value="string",
            enforced="date, time, date-time, uuid, email, hostname, ipv4, ipv6, uri, "
                     "uri-reference; other values such as int64 or url are annotations",
            refused="duration, regex, json-pointer, relative-json-pointer, uri-template, "
                    "iri, iri-reference, idn-email, idn-hostname: not built; a format "
                    "together with `pattern`",
            narrowed="a subset of each format's syntax: ipv6 in full form, dates without 29 "
                     "February, hostnames of up to 4 labels of up to 62 characters"),
    Keyword("contentEncoding", ANNOTATION, value="any"),
    Keyword("contentMediaType", ANNOTATION, value="any"),
    Keyword("contentSchema", ANNOTATION, value="any"),
    # numbers
    Keyword("minimum", ENFORCED, "number", True, value="number", merge="max",
            limits=("number_digits",),
            narrowed="fractional bounds rounded inward to integers, and no exponent in a "
                     "bounded number"),
    Keyword("maximum", ENFORCED, "number", True, value="number", merge="min",
            limits=("number_digits",),
            narrowed="past the `number_digits` limit, narrowed to the largest number of that "
                     "many digits"),
    Keyword("exclusiveMinimum", ENFORCED, "number", True, value="number_or_flag",
            merge="max", enforced="a number, or draft 4's flag"),
    Keyword("exclusiveMaximum", ENFORCED, "number", True, value="number_or_flag",
            merge="min", enforced="a number, or draft 4's flag"),
    Keyword("multipleOf", PARTIAL, "number", value="number",
            enforced="1 on an integer or number",
            refuse=lambda s: None if s["multipleOf"] == 1 and s.get("type") in (
                "integer", "number") else "multipleOf",
            refused="other values: multiples are not built"),
    Keyword("$dynamicRef", REFUSED, value="string", refuse=_always("$dynamicRef"),
            refused="dynamic scopes are not followed"),
    Keyword("$recursiveRef", REFUSED, value="string", refuse=_always("$recursiveRef"),
            refused="as `$dynamicRef`"),
    # annotations: any value, as JSON Schema ignores them (a malformed title harms nothing)
    *(Keyword(k, ANNOTATION, value="any") for k in (
        "title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
        "writeOnly", "$schema", "$id", "$anchor", "$vocabulary")),
]

KEYWORDS: dict[str, Keyword] = {k.name: k for k in TABLE}
VALIDATION = frozenset(k.name for k in TABLE if k.validates)
REFUSALS = tuple(k for k in TABLE if k.refuse is not None)   # checked in gen, in this order
MERGE = {k.name: k.merge for k in TABLE}
_INFERS = {t: tuple(k.name for k in TABLE if k.infers and k.type == t)
           for t in ("object", "array", "string", "number")}
FORMATS = ("date", "time", "date-time", "uuid", "email", "hostname", "ipv4", "ipv6", "uri",
           "uri-reference")
UNSUPPORTED_FORMATS = frozenset({"regex", "json-pointer", "relative-json-pointer",
                                 "uri-template", "idn-email", "idn-hostname", "iri",
                                 "iri-reference", "duration"})


def infer_type(s: dict):
    """The type a schema without `type` is held to: the first of object, array, string, number
    that one of its keywords implies (a narrowing: JSON Schema lets other types through)."""
    for t, names in _INFERS.items():
        if any(k in s for k in names):
            return t
        if t == "string" and s.get("format") in FORMATS:
            return t
    return None


def has_validation(s: dict) -> bool:
    return any(k in VALIDATION for k in s)


def refusal(s: dict) -> tuple[str, str] | None:
    """The first refused keyword of a schema and the feature to name, or None."""
    for kw in REFUSALS:
        if kw.name in s:
            feature = kw.refuse(s)
            if feature is not None:
                return kw.name, feature
    return None


def esc(token: str) -> str:
    """A JSON pointer token."""
    return token.replace("~", "~0").replace("/", "~1")


def unesc(token: str) -> str:
    """A JSON pointer token's text (the inverse of esc)."""
    return token.replace("~1", "/").replace("~0", "~")


MISSING = object()   # what ref_target finds where a pointer leads nowhere


def ref_target(root, ref: str):
    """The node a same-document `$ref` ("#" or a JSON pointer "#/a/b") names in `root`, or
    MISSING. The caller has checked that `ref` starts with "#" and is not an anchor."""
    node = root
    pointer = ref[1:]
    for part in pointer.split("/")[1:] if pointer else []:
        part = unquote(unesc(part))   # a $ref is a URI fragment: percent-escapes too
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node
