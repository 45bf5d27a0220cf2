"""What a client's schema may ask for, and the errors of a schema the grammar cannot hold.

A schema comes from the client, so everything that makes its grammar big or slow to build is
bounded by a SchemaLimits field: how large and how deep it is, how many values an enum lists,
how many branches or properties a subschema has, how many times a pattern or a length repeats.
check.py looks at every subschema (and every `$ref` target) before any grammar is built, so a
hostile schema is refused in time linear in its size; the converter checks the limits that only
show while it builds (nesting through `$ref`, compiling steps). Every refusal is a SchemaTooLarge
naming the limit, its value and the JSON pointer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

MAX_REPEAT = 2000   # the default `repeat` limit: maxLength / maxItems more than this past the
                    # minimum are narrowed to it (sound: fewer values)


class UnsupportedSchema(ValueError):
    """A schema the grammar cannot enforce; `path` is the JSON pointer of the keyword."""

    def __init__(self, feature: str, path: str):
        self.feature = feature
        self.path = path or "/"
        super().__init__(f"unsupported JSON Schema feature {feature} at {self.path}")


class InvalidSchema(UnsupportedSchema):
    """A keyword whose value does not have its type (the keyword table's `value`); `path` is
    the JSON pointer of the value at fault (`/anyOf/0` for an item of anyOf that is no schema),
    `must` what the value must be."""

    def __init__(self, keyword: str, must: str, path: str):
        self.feature = keyword
        self.path = path or "/"
        self.must = must
        ValueError.__init__(self, f"{keyword} must be {must}, at {self.path}")


class SchemaTooLarge(UnsupportedSchema):
    """A schema past one of the SchemaLimits; `limit` is the field's name, `path` the JSON
    pointer of the keyword (of the subschema, for depth and the object-wide counts)."""

    def __init__(self, limit: str, value: int, what: str, path: str, amount: str):
        self.feature = what
        self.path = path or "/"
        self.limit = limit
        ValueError.__init__(self, f"{what} at {self.path} {amount}; at most {value} allowed "
                                  f"(schema limit {limit})")


class Unsatisfiable(UnsupportedSchema):
    """A (sub)schema no value can satisfy (an anyOf branch of this kind is dropped)."""


@dataclass(frozen=True)
class SchemaLimits:
    """Bounds on a client's schema (the values admit every JSONSchemaBench schema in
    tests/data/jsonschemabench with a margin; docs/server.md lists them)."""
    schema_bytes: int = field(default=256 * 1024, metadata={
        "doc": "the schema as compact JSON, in bytes"})
    depth: int = field(default=64, metadata={
        "doc": "subschemas nested inside each other, counting through `$ref`"})
    ref_depth: int = field(default=32, metadata={
        "doc": "`$ref` targets being expanded inside each other (and `$ref` chains)"})
    enum_values: int = field(default=4096, metadata={"doc": "values in one `enum`"})
    enum_bytes: int = field(default=128 * 1024, metadata={
        "doc": "the JSON of one `enum` or `const`, in bytes"})
    alternatives: int = field(default=256, metadata={
        "doc": "branches of one `anyOf`, `oneOf` or `allOf`, or types in a `type` list"})
    properties: int = field(default=1024, metadata={
        "doc": "names in one object's `properties`, `patternProperties` or `required`"})
    repeat: int = field(default=MAX_REPEAT, metadata={
        "doc": "`minLength`, `minItems` and a count in a pattern "
               "(`a{n}`, `a{n,m}`); `maxLength`, `maxItems` more than it past the minimum "
               "are narrowed"})
    number_digits: int = field(default=64, metadata={
        "doc": "digits of a number bound: one that widens the range past it is narrowed "
               "(`maximum` 1.8e308 to 10^64 - 1), one that needs longer numbers refused"})
    steps: int = field(default=20_000, metadata={
        "doc": "compiling steps for one schema: one per subschema, enum value and property "
               "compiled (`allOf` over `anyOf` multiplies them)"})
    combinations: int = field(default=5000, metadata={
        "doc": "states one object needs to count properties and track dependencies"})

    def __post_init__(self):
        for f in fields(self):
            if not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1:
                raise ValueError(f"SchemaLimits.{f.name} must be a positive integer")


LIMITS = SchemaLimits()


def too_large(limits: SchemaLimits, limit: str, what: str, path: str, amount: str):
    return SchemaTooLarge(limit, getattr(limits, limit), what, path, amount)


def json_size(value) -> int:
    """The bytes of a value as compact JSON (UTF-8)."""
    try:
        return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"))
    except (TypeError, ValueError) as e:   # (from Python callers: a set, a NaN...)
        raise UnsupportedSchema(f"a schema that is not JSON ({e})", "") from None
