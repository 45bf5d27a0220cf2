"""A client's JSON Schema (json_schema, response_format, a tool's parameters), its keywords
type-checked before the grammar compiler reads them.

The compiler (kinetic/grammar/json_schema.py) refuses what it cannot enforce with
UnsupportedSchema, but it reads each keyword as the type JSON Schema gives it: a `required`
of 5, a `pattern` of 5 or `maxItems: 1.5` would be a TypeError there, and a bound past the
float range an OverflowError. Here each keyword kinetic knows must have its meta-schema type
(drafts 4 to 2020-12), or it is a 400 whose `param` is the keyword's path in the body
(`json_schema.properties.name.minLength`). Keywords kinetic does not know are not looked at,
as the compiler ignores them. Recursive: the body's depth is bounded (body.MAX_DEPTH).
"""

from __future__ import annotations

import sys
from typing import Any

from kinetic.api.errors import bad_request

SCHEMA = ("additionalProperties", "additionalItems", "not", "contains", "propertyNames", "if",
          "then", "else", "unevaluatedProperties", "unevaluatedItems")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
STRINGS = ("$ref", "pattern", "format", "$dynamicRef", "$recursiveRef")
COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
          "minContains", "maxContains")
NUMBERS = ("minimum", "maximum", "multipleOf")


def check_schema(schema: Any, at: str) -> None:
    """400 naming the first keyword of `schema` (at path `at`) whose value has the wrong
    type; None when every keyword it knows is well typed."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise bad_request(f"{at} must be a JSON Schema (an object or a boolean)", at)
    for key, value in schema.items():
        where = f"{at}.{key}"
        if key in SCHEMA:
            check_schema(value, where)
        elif key in SCHEMA_LISTS:
            _list_of(value, where, "schemas")
            for i, item in enumerate(value):
                check_schema(item, f"{where}[{i}]")
        elif key in SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise bad_request(f"{where} must be an object of schemas", where)
            for name, item in value.items():
                check_schema(item, f"{where}.{name}")
        elif key == "items":  # a schema, or draft 4's list of them
            if isinstance(value, list):
                for i, item in enumerate(value):
                    check_schema(item, f"{where}[{i}]")
            else:
                check_schema(value, where)
        elif key == "type":  # which names: the compiler's to say
            if not isinstance(value, str) and not (
                    isinstance(value, list) and all(isinstance(n, str) for n in value)):
                raise bad_request(f"{where} must be a type name or a list of them", where)
        elif key == "enum":
            _list_of(value, where, "values")
        elif key == "required":  # (not draft 3's boolean: the compiler cannot read it)
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise bad_request(f"{where} must be a list of property names", where)
        elif key in ("dependentRequired", "dependencies"):
            _dependencies(value, where, schemas=key == "dependencies")
        elif key in STRINGS and not isinstance(value, str):
            raise bad_request(f"{where} must be a string", where)
        elif key in COUNTS and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 0):
            raise bad_request(f"{where} must be an integer of at least 0", where)
        elif key in NUMBERS and (isinstance(value, bool) or not _number(value)):
            raise bad_request(f"{where} must be a number within the float range", where)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") \
                and not (isinstance(value, bool) or _number(value)):  # a bool in draft 4
            raise bad_request(f"{where} must be a number within the float range", where)
        elif key == "uniqueItems" and not isinstance(value, bool):
            raise bad_request(f"{where} must be true or false", where)


def _number(value: Any) -> bool:
    # the compiler works in floats: an integer past 1.8e308 cannot become one
    return isinstance(value, (int, float)) and -sys.float_info.max <= value <= sys.float_info.max


def _list_of(value: Any, where: str, what: str) -> None:
    if not isinstance(value, list):
        raise bad_request(f"{where} must be a list of {what}", where)


def _dependencies(value: Any, where: str, schemas: bool) -> None:
    """dependentRequired: property -> names; dependencies: the same, or -> a schema."""
    if not isinstance(value, dict):
        raise bad_request(f"{where} must be an object", where)
    for name, item in value.items():
        if schemas and not isinstance(item, list):
            check_schema(item, f"{where}.{name}")
        elif not isinstance(item, list) or not all(isinstance(n, str) for n in item):
            raise bad_request(f"{where}.{name} must be a list of property names",
                              f"{where}.{name}")
