"""JSON Schema to the grammar IR.

`compile_json_schema(schema)` returns a Grammar whose sentences are JSON texts valid under the
schema. The grammar may be narrower than the schema, never wider: every text it accepts
validates. A keyword it cannot enforce raises UnsupportedSchema naming it and its JSON pointer
(the API answers 400), rather than being ignored; so does a keyword whose value does not have
its type (InvalidSchema, saying what it must be) and a schema past a SchemaLimits bound
(SchemaTooLarge, naming the limit and its value). `{"type": "json_object"}` in the API is
`compile_json_schema(True)`: any JSON value.

One schema, in order:
- check.py: check_schema looks at every subschema and `$ref` target before anything is built:
  each keyword's value against its type in the table, and the limits of limits.py;
- converter.py: Converter.gen walks the schema from the root: `$ref` becomes a rule per target
  (recursion is a recursive rule), refused keywords raise, and the rest goes to
- combine.py (allOf merged, anyOf/oneOf as alternations), literals.py (enum/const as a trie of
  their JSON texts), and the type handlers numbers.py, strings.py (with formats.py),
  objects.py, arrays.py;
- the builder lowers the rules to bytes (kinetic.grammar.ir).

keywords.py is the one table of keywords: for each, the type of its value, its handler's type,
what is enforced or why it is refused, how allOf joins it, the limits that bound it. docs.py
renders it here and into docs/server.md (`python -m kinetic.grammar.json_schema.docs --write`);
a test keeps both equal to the table:

<!-- json-schema-keywords -->
- Any value: `type` (one type or a list), `enum` (its values, filtered by the other keywords),
  `const` (filtered by the other keywords), `nullable` (OpenAPI's: or null), `allOf` (merged
  into one schema), `anyOf`, `oneOf` (when no two branches can hold at once, told apart by type,
  enum or a required property, or when every branch only requires properties), `$ref` (into the
  same document: `#/$defs/...`, `#/definitions/...` or any JSON pointer, recursion included),
  `$defs` (`$ref` targets), `definitions` (`$ref` targets).
- Objects: `properties` (in the schema's key order), `required`, `additionalProperties`,
  `patternProperties`, `propertyNames` (a `pattern`), `minProperties`, `maxProperties`,
  `dependentRequired`, `dependencies` (lists of property names), `not` (`not: {required: [...]}`
  on an object).
- Arrays: `items` (a schema, or draft 4's list of schemas), `prefixItems`, `additionalItems`
  (after draft 4's list of `items`), `minItems`, `maxItems`, `uniqueItems` (on items that are an
  `enum` or `const`).
- Strings: `minLength`, `maxLength`, `pattern` (the ECMA-262 subset of character classes,
  groups, alternation and counts), `format` (date, time, date-time, uuid, email, hostname, ipv4,
  ipv6, uri, uri-reference; other values such as int64 or url are annotations).
- Numbers: `minimum`, `maximum`, `exclusiveMinimum` (a number, or draft 4's flag),
  `exclusiveMaximum` (a number, or draft 4's flag), `multipleOf` (1 on an integer or number).
- Refused, a 400 naming the keyword and its JSON pointer: `oneOf` (branches that may overlap:
  exactly one cannot be checked); `$ref` (to another document or by anchor: the server fetches
  nothing); `if` (a condition on the value being written); `then` (as `if`); `else` (as `if`);
  `propertyNames` (other keywords in it); `dependencies` (with a schema, as `dependentSchemas`);
  `not` (any other form: the complement of a schema is not built); `dependentSchemas` (a schema
  that applies when a property is present); `unevaluatedProperties` (depends on what the other
  keywords evaluated); `uniqueItems` (on other items: distinct values cannot be checked by a
  grammar); `contains` (a count of matching items); `minContains` (as `contains`); `maxContains`
  (as `contains`); `unevaluatedItems` (depends on what the other keywords evaluated); `pattern`
  (lookaround, backreferences, word boundaries: not regular); `format` (duration, regex,
  json-pointer, relative-json-pointer, uri-template, iri, iri-reference, idn-email,
  idn-hostname: not built; a format together with `pattern`); `multipleOf` (other values:
  multiples are not built); `$dynamicRef` (dynamic scopes are not followed); `$recursiveRef` (as
  `$dynamicRef`).
- Narrowed (the grammar may accept fewer texts than the schema, never more; numbers are written
  canonically, "0" not "-0", integers without ".0", and, where no bound needs more, with at most
  16 digits before the point, after it and in the exponent, as llama.cpp's converter writes
  them): `properties`: key order fixed: declared order, then extra keys; `additionalProperties`:
  extra keys written without escapes and never one of the named properties; `patternProperties`:
  a pattern that matches a named property adds no keys; `minProperties`: met by extra keys with
  at most one of them; `maxItems`: past `minItems` by more than the `repeat` limit, narrowed to
  that; `uniqueItems`: the distinct enum values in enum order; `maxLength`: past `minLength` by
  more than the `repeat` limit, narrowed to that; `pattern`: with `minLength`/`maxLength`,
  narrowed to fit them; `format`: a subset of each format's syntax: ipv6 in full form, dates
  without 29 February, hostnames of up to 4 labels of up to 62 characters; `minimum`: fractional
  bounds rounded inward to integers, and no exponent in a bounded number; `maximum`: past the
  `number_digits` limit, narrowed to the largest number of that many digits.
- Values, as the meta-schemas of drafts 4 to 2020-12 type them (else a 400 naming the keyword,
  what it must be and the JSON pointer of the value): `if`, `then`, `else`,
  `additionalProperties`, `propertyNames`, `not`, `unevaluatedProperties`, `additionalItems`,
  `contains`, `unevaluatedItems`: a schema (an object or a boolean); `allOf`, `anyOf`, `oneOf`,
  `prefixItems`: a non-empty list of schemas (objects or booleans); `items`: a schema or a list
  of schemas (objects or booleans); `$defs`, `definitions`, `properties`, `patternProperties`,
  `dependentSchemas`: an object of schemas (objects or booleans); `required`: a list of property
  names (strings); `dependentRequired`: an object of lists of property names; `dependencies`: an
  object of lists of property names or schemas; `type`: a type name (string, number, integer,
  boolean, null, object, array) or a non-empty list of them; `minProperties`, `maxProperties`,
  `minItems`, `maxItems`, `minContains`, `maxContains`, `minLength`, `maxLength`: an integer of
  at least 0; `minimum`, `maximum`, `multipleOf`: a number within the float range;
  `exclusiveMinimum`, `exclusiveMaximum`: a number within the float range, or draft 4's boolean;
  `$ref`, `pattern`, `format`, `$dynamicRef`, `$recursiveRef`: a string; `nullable`,
  `uniqueItems`: true or false; `enum`: a list; any value for the others.
- Ignored, as JSON Schema ignores them: `contentEncoding`, `contentMediaType`, `contentSchema`,
  `title`, `description`, `default`, `examples`, `$comment`, `deprecated`, `readOnly`,
  `writeOnly`, `$schema`, `$id`, `$anchor`, `$vocabulary`, and every keyword not listed here.
<!-- /json-schema-keywords -->
"""

from kinetic.grammar.ir import Grammar, GrammarBuilder
from kinetic.grammar.json_schema.check import check_schema, check_types
from kinetic.grammar.json_schema.converter import WS_MAX, Converter
from kinetic.grammar.json_schema.limits import (LIMITS, MAX_REPEAT, InvalidSchema, SchemaLimits,
                                                SchemaTooLarge, UnsupportedSchema)


def compile_json_schema(schema, limits: SchemaLimits = LIMITS) -> Grammar:
    """The grammar of JSON texts valid under `schema` (a dict, or True for any JSON value).
    Raises UnsupportedSchema (InvalidSchema for a keyword value of the wrong type,
    SchemaTooLarge past one of `limits`)."""
    check_schema(schema, limits)
    grammar = Converter(schema, limits).build()
    if limits == LIMITS:   # a receipt's verifier compiles it again with the default limits
        grammar.source = {"type": "json_schema", "schema": schema}
    return grammar


def schema_expr(builder: GrammarBuilder, schema, prefix: str, limits: SchemaLimits = LIMITS):
    """Defines in `builder` the rules of a value of `schema` and returns the expression of one
    such value (no surrounding whitespace), so several schemas can live in one grammar (tool
    calls). The schema's own rules are named with `prefix`; the shared JSON rules (ws, json-*)
    are the same for every schema. Raises UnsupportedSchema as compile_json_schema does."""
    check_schema(schema, limits)
    return Converter(schema, limits, builder, prefix).gen(schema, "")


__all__ = ["LIMITS", "MAX_REPEAT", "InvalidSchema", "SchemaLimits", "SchemaTooLarge",
           "UnsupportedSchema", "WS_MAX", "check_types", "compile_json_schema", "schema_expr"]
