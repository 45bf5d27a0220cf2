"""The keyword table: every JSON Schema keyword kinetic knows, what it does with it, and the
limits that bound it. The converter reads it (which keywords validate, which imply a type, how
allOf joins two values, which forms are refused), check_limits reads it (where subschemas are),
and docs.py renders it into the package docstring and docs/server.md, so the three agree.

A keyword not in the table is ignored, as JSON Schema ignores unknown keywords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

ENFORCED = "enforced"       # the grammar holds the answer to it
PARTIAL = "partial"         # enforced in the forms `enforced` says, refused in the others
REFUSED = "refused"         # always a 400 (UnsupportedSchema naming it and its JSON pointer)
ANNOTATION = "annotation"   # ignored, as JSON Schema ignores it
CONTAINER = "container"     # holds subschemas for `$ref`; no constraint by itself

TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")


@dataclass(frozen=True)
class Keyword:
    name: str
    kind: str
    type: str | None = None     # the type whose handler reads it; None: the converter core
    infers: bool = False        # whether it makes a schema without `type` of that type
    enforced: str = ""          # what is enforced (ENFORCED, PARTIAL)
    refused: str = ""           # what is refused, and why (REFUSED, PARTIAL)
    narrowed: str = ""          # how the grammar may be narrower (every answer still validates)
    merge: str = "same"         # how allOf joins two values: same (else refused), max, min,
                                # union, types, properties, false_wins, branches
    holds: str = ""             # subschemas in its value: schema, list, map, schema_or_list
    limits: tuple[str, ...] = ()  # SchemaLimits fields that bound it
    refuse: Callable[[dict], str | None] | None = None  # gen's check of a schema: the feature
                                # to name if refused (else its handler refuses)

    @property
    def validates(self) -> bool:
        return self.kind in (ENFORCED, PARTIAL, REFUSED)


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
    Keyword("type", ENFORCED, enforced="one type or a list", merge="types",
            limits=("alternatives",)),
    Keyword("enum", ENFORCED, enforced="its values, filtered by the other keywords",
            limits=("enum_values", "enum_bytes")),
    Keyword("const", ENFORCED, enforced="filtered by the other keywords",
            limits=("enum_bytes",)),
    Keyword("nullable", ENFORCED, enforced="OpenAPI's: or null"),
    Keyword("allOf", ENFORCED, enforced="merged into one schema", holds="list",
            limits=("alternatives", "steps")),
    Keyword("anyOf", ENFORCED, merge="branches", holds="list",
            limits=("alternatives", "steps")),
    Keyword("oneOf", PARTIAL, merge="branches", holds="list", limits=("alternatives",),
            enforced="when no two branches can hold at once, told apart by type, enum or a "
                     "required property, or when every branch only requires properties",
            refused="branches that may overlap: exactly one cannot be checked"),
    Keyword("$ref", PARTIAL, enforced="into the same document: `#/$defs/...`, "
                                      "`#/definitions/...` or any JSON pointer, recursion "
                                      "included",
            refused="to another document or by anchor: the server fetches nothing",
            limits=("ref_depth", "depth")),
    Keyword("$defs", CONTAINER, holds="map"),
    Keyword("definitions", CONTAINER, holds="map"),
    Keyword("if", REFUSED, holds="schema", refuse=_always("if"),
            refused="a condition on the value being written"),
    Keyword("then", REFUSED, holds="schema", refuse=_always("then"), refused="as `if`"),
    Keyword("else", REFUSED, holds="schema", refuse=_always("else"), refused="as `if`"),
    # objects
    Keyword("properties", ENFORCED, "object", True, merge="properties", holds="map",
            enforced="in the schema's key order", limits=("properties",),
            narrowed="key order fixed: declared order, then extra keys"),
    Keyword("required", ENFORCED, "object", True, merge="union", limits=("properties",)),
    Keyword("additionalProperties", ENFORCED, "object", True, merge="false_wins",
            holds="schema",
            narrowed="extra keys written without escapes and never one of the named "
                     "properties"),
    Keyword("patternProperties", ENFORCED, "object", True, holds="map",
            limits=("properties",),
            narrowed="a pattern that matches a named property adds no keys"),
    Keyword("propertyNames", PARTIAL, "object", True, holds="schema",
            refuse=_refuse_property_names, enforced="a `pattern`",
            refused="other keywords in it"),
    Keyword("minProperties", ENFORCED, "object", True, merge="max", limits=("combinations",),
            narrowed="met by extra keys with at most one of them"),
    Keyword("maxProperties", ENFORCED, "object", True, merge="min", limits=("combinations",)),
    Keyword("dependentRequired", ENFORCED, "object", True, limits=("combinations",)),
    Keyword("dependencies", PARTIAL, "object", True, enforced="lists of property names",
            refused="with a schema, as `dependentSchemas`", limits=("combinations",)),
    Keyword("not", PARTIAL, type="object", holds="schema", refuse=_refuse_not,
            enforced="`not: {required: [...]}` on an object",
            refused="any other form: the complement of a schema is not built"),
    Keyword("dependentSchemas", REFUSED, "object", holds="map",
            refuse=_always("dependentSchemas"),
            refused="a schema that applies when a property is present"),
    Keyword("unevaluatedProperties", REFUSED, "object", holds="schema",
            refuse=_always("unevaluatedProperties"),
            refused="depends on what the other keywords evaluated"),
    # arrays
    Keyword("items", ENFORCED, "array", True, holds="schema_or_list",
            enforced="a schema, or draft 4's list of schemas"),
    Keyword("prefixItems", ENFORCED, "array", True, holds="list"),
    Keyword("additionalItems", ENFORCED, "array", holds="schema",
            enforced="after draft 4's list of `items`"),
    Keyword("minItems", ENFORCED, "array", True, merge="max", limits=("repeat",)),
    Keyword("maxItems", ENFORCED, "array", True, merge="min", limits=("repeat",),
            narrowed="past `minItems` by more than the `repeat` limit, narrowed to that"),
    Keyword("uniqueItems", PARTIAL, "array", enforced="on items that are an `enum` or "
                                                       "`const`",
            refused="on other items: distinct values cannot be checked by a grammar",
            narrowed="the distinct enum values in enum order", limits=("combinations",)),
    Keyword("contains", REFUSED, "array", holds="schema", refuse=_always("contains"),
            refused="a count of matching items"),
    Keyword("minContains", REFUSED, "array", refuse=_always("minContains"),
            refused="as `contains`"),
    Keyword("maxContains", REFUSED, "array", refuse=_always("maxContains"),
            refused="as `contains`"),
    Keyword("unevaluatedItems", REFUSED, "array", holds="schema",
            refuse=_always("unevaluatedItems"),
            refused="depends on what the other keywords evaluated"),
    # strings
    Keyword("minLength", ENFORCED, "string", True, merge="max", limits=("repeat",)),
    Keyword("maxLength", ENFORCED, "string", True, merge="min", limits=("repeat",),
            narrowed="past `minLength` by more than the `repeat` limit, narrowed to that"),
    Keyword("pattern", PARTIAL, "string", True, limits=("repeat",),
            enforced="the ECMA-262 subset of character classes, groups, alternation and "
                     "counts",
            refused="lookaround, backreferences, word boundaries: not regular",
            narrowed="with `minLength`/`maxLength`, narrowed to fit them"),
    Keyword("format", PARTIAL, "string",
            enforced="date, time, date-time, uuid, email, hostname, ipv4, ipv6, uri, "
                     "uri-reference; other values such as int64 or url are annotations",
            refused="duration, regex, json-pointer, relative-json-pointer, uri-template, "
                    "iri, iri-reference, idn-email, idn-hostname: not built; a format "
                    "together with `pattern`",
            narrowed="a subset of each format's syntax: ipv6 in full form, dates without 29 "
                     "February, hostnames of up to 4 labels of up to 62 characters"),
    Keyword("contentEncoding", ANNOTATION),
    Keyword("contentMediaType", ANNOTATION),
    Keyword("contentSchema", ANNOTATION),
    # numbers
    Keyword("minimum", ENFORCED, "number", True, merge="max", limits=("number_digits",),
            narrowed="fractional bounds rounded inward to integers, and no exponent in a "
                     "bounded number"),
    Keyword("maximum", ENFORCED, "number", True, merge="min", limits=("number_digits",),
            narrowed="past the `number_digits` limit, narrowed to the largest number of that "
                     "many digits"),
    Keyword("exclusiveMinimum", ENFORCED, "number", True, merge="max",
            enforced="a number, or draft 4's flag"),
    Keyword("exclusiveMaximum", ENFORCED, "number", True, merge="min",
            enforced="a number, or draft 4's flag"),
    Keyword("multipleOf", PARTIAL, "number", enforced="1 on an integer or number",
            refuse=lambda s: None if s["multipleOf"] == 1 and s.get("type") in (
                "integer", "number") else "multipleOf",
            refused="other values: multiples are not built"),
    Keyword("$dynamicRef", REFUSED, refuse=_always("$dynamicRef"),
            refused="dynamic scopes are not followed"),
    Keyword("$recursiveRef", REFUSED, refuse=_always("$recursiveRef"),
            refused="as `$dynamicRef`"),
    # annotations
    *(Keyword(k, ANNOTATION) for k in ("title", "description", "default", "examples",
                                       "$comment", "deprecated", "readOnly", "writeOnly",
                                       "$schema", "$id", "$anchor", "$vocabulary")),
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
