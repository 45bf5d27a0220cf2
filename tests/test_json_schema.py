"""JSON Schema grammars as (schema, valid JSON texts, invalid ones) tables: every text is first
checked against the `jsonschema` package (so the table itself is right), then through the
matcher byte by byte and through the masks of a byte-level vocabulary. Plus the refusals, the
compile rate on the JSONSchemaBench sample, and the keyword table: each refused, partly
enforced and ignored keyword of it, and the docs that list it."""

from __future__ import annotations

import glob
import json
import os

import jsonschema
import numpy as np
import pytest

from kinetic.grammar import Matcher, UnsupportedSchema, compile_json_schema
from kinetic.grammar import matcher as M
from kinetic.grammar.json_schema import keywords as K
from tests.test_grammar import check_table


def random_sentence(grammar, rng, max_len: int = 3000,
                    prefer_ascii: bool = False) -> bytes | None:
    """A random sentence of the grammar (for tests and benchmarks): a walk over bytes picking
    at each step one of the bytes the state accepts, `rng` a random.Random; biased toward
    closing characters as it grows so most walks end, and with `prefer_ascii` toward printable
    ASCII (text that tokenizes roughly like a model's). None when the walk gets too long."""
    s = M._states(grammar)
    sid, out, every = s.start, bytearray(), np.arange(256)
    while len(out) < max_len:
        if s.can_end[sid] and rng.random() < 0.5:
            return bytes(out)
        allowed = np.flatnonzero(s.fill(np.full(256, sid), every) != M.DEAD).tolist()
        if not allowed:
            return bytes(out) if s.can_end[sid] else None
        short = [b for b in allowed if b in b'"}]0123456789tfn']
        ascii_ = [b for b in allowed if 0x20 <= b < 0x7F and b != 0x5C] if prefer_ascii else []
        if short and (len(out) > 100 or rng.random() < 0.3):
            b = rng.choice(short)
        elif ascii_ and rng.random() < 0.9:
            b = rng.choice(ascii_)
        else:
            b = rng.choice(allowed)
        out.append(b)
        sid = s.step(sid, b)
    return None


BENCH = os.path.join(os.path.dirname(__file__), "data", "jsonschemabench")

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}

# valid under the schema but outside the grammar by design (fixed key order; no keys beyond
# `properties` unless additionalProperties says so)
NARROWED = {'{"age": 25, "name": "x"}', '{"name": "x", "age": 25, "x": 1}', "-0",
            "1.0", '"a@b"', '{"x": "y", "z": "w"}'}

TABLE = [
    (PERSON, ['{"name": "Ethan", "age": 25}', '{\n"name": "Ethan",\n"age": 25\n}',
              '{"name":"","age":-3}', '  {"name": "a\\"\\u00e9\\n", "age": 0}  '],
     ['{"name": "Ethan"}', '{"age": 25, "name": "x"}', '{"name": "x", "age": 2.5}',
      '{"name": "x", "age": 25, "x": 1}', '{"name": "x", "age": 01}', '{"name": 1, "age": 1}']),
    ({"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                       "c": {"type": "number"}}, "required": ["b"]},
     ['{"b": null}', '{"a": true, "b": null}', '{"b": null, "c": -1.5e3}',
      '{"a": false, "b": null, "c": 0}'],
     ['{}', '{"a": true}', '{"b": null,}', '{, "b": null}', '{"b": nul}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}},
     ['{}', '{"a": 1}', '{"a": 1, "x": "y", "z": ""}', '{"x": "y"}'],
     ['{"a": 1, "x": 2}', '{"x": null}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
     ['{}', '{"a": 5}'], ['{"b": 5}', '{"a": 5, "b": 1}']),
    ({"enum": ["red", "green", 3, None, {"k": [1]}]},
     ['"red"', '"green"', '3', 'null', '{"k":[1]}'], ['"blue"', '4', '"Red"', 'true']),
    ({"const": "x\"y"}, ['"x\\"y"'], ['"xy"', '"x\\"yz"']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
     ['[1]', '[1, 2, 3]', '[ 1 ,2 ]'], ['[]', '[1, 2, 3, 4]', '[1,]', '["a"]']),
    ({"type": "array", "prefixItems": [{"type": "string"}, {"type": "boolean"}],
      "items": False},
     ['[]', '["a"]', '["a", true]'], ['["a", true, 1]', '[true]']),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "null"},
      "minItems": 2},
     ['["a", null]', '["a", null, null]'], ['["a"]', '["a", 1]']),
    ({"type": "string", "minLength": 2, "maxLength": 4},
     ['"ab"', '"abcd"', '"\\n\\u00e9"', '"éé"'], ['"a"', '"abcde"', '""']),
    ({"type": "string", "pattern": "^[A-Z]{2}-\\d+$"},
     ['"AB-1"', '"XY-123"'], ['"ab-1"', '"AB-"', '"AB-1x"']),
    ({"type": "string", "pattern": "b+c"},
     ['"bc"', '"xbbcx"', '"abc"'], ['"b"', '"cb"']),
    ({"type": "string", "pattern": "^(cat|dog)s?$", "maxLength": 4},
     ['"cat"', '"dogs"'], ['"cats!"', '"bird"']),
    ({"type": "string", "format": "date"}, ['"2024-02-28"', '"1999-12-31"'],
     ['"2024-13-01"', '"2024-1-01"', '"2024-04-31"']),
    ({"type": "string", "format": "date-time"},
     ['"2024-02-28T13:45:00Z"', '"2024-02-28T13:45:00.123+02:00"'],
     ['"2024-02-28 13:45:00Z"', '"2024-02-28T25:00:00Z"']),
    ({"type": "string", "format": "time"}, ['"23:59:59Z"'], ['"24:00:00Z"']),
    ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'],
     ['"123e4567e89b12d3a456426614174000"']),
    ({"type": "string", "format": "email"}, ['"a.b@example.com"'], ['"ab.example.com"', '"a@b"']),
    ({"type": "integer", "minimum": -15, "maximum": 120},
     ['-15', '-9', '0', '7', '99', '120'], ['-16', '121', '200', '-0', '007', '1.0']),
    ({"type": "integer", "exclusiveMinimum": 0}, ['1', '10', '123456789'], ['0', '-1']),
    ({"type": "integer", "minimum": 18}, ['18', '19', '99', '100', '123456'], ['17', '9', '0']),
    ({"type": "number", "minimum": 0, "exclusiveMaximum": 1},
     ['0', '0.5', '0.999'], ['1', '1.0', '-0.1', '1.5']),
    ({"type": "number", "minimum": -2.5, "maximum": 3},
     ['-2', '0', '3', '3.0', '2.75'], ['-3', '3.5', '4']),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, ['"a"', '1'], ['true', '1.5']),
    ({"oneOf": [{"type": "boolean"}, {"type": "null"}]}, ['true', 'null'], ['"x"']),
    ({"type": ["string", "null"]}, ['"x"', 'null'], ['1']),
    ({"type": "string", "nullable": True}, ['"x"', 'null'], ['1']),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     ['{"a": 1, "b": "x"}'], ['{"a": 1}', '{"b": "x"}']),
    ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"},
     ['{"v": 1, "next": null}', '{"v": 1, "next": {"v": 2, "next": {"v": 3, "next": null}}}'],
     ['{"v": 1}', '{"v": 1, "next": {"v": 2}}']),
    ({"definitions": {"x": {"type": "boolean"}}, "properties": {"f": {"$ref": "#/definitions/x"}},
      "required": ["f"]}, ['{"f": true}'], ['{"f": 1}']),
    ({"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
      "additionalProperties": False},
     ['{}', '{"x-a": 1, "x-bc": 2}'], ['{"y": 1}', '{"x-a": "s"}']),
    ({"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
     ['[]', '["a", "c"]', '["a", "b", "c"]'], ['["a", "a"]', '["a", "b", "c", "a"]']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "dependentRequired": {"a": ["b"]}, "maxProperties": 1},
     ['{}', '{"b": "x"}'], ['{"a": 1}', '{"a": 1, "b": "x"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
     ['{"a": 1}', '{"b": 2}'], ['{}', '{"a": 1, "b": 2}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "string"}, "minProperties": 2},
     ['{"a": 1, "x": "y"}'], ['{"a": 1}', '{"a": 1, "a": "y"}', '{"x": "y", "z": "w"}']),
    ({"oneOf": [{"type": "string", "pattern": "^a+$"}, {"enum": ["b", "c"]}]},
     ['"aa"', '"b"'], ['"d"']),
    ({"enum": ["a", "bbb", 3], "maxLength": 2}, ['"a"'], ['"bbb"']),
    ({"type": "string", "format": "uri"}, ['"http://example.com/a/b?c=d#e"', '"urn:isbn:123"'],
     ['"a:##"', '"http://a:b:c"', '"a:[x]"', '"//x"']),
    ({"type": "string", "format": "uri-reference"}, ['"../a?b"', '"http://x/y"', '""'],
     ['"a b"', '"#a#b"']),
    ({"type": "string", "format": "hostname"}, ['"a-b.example"'], ['"' + "a" * 64 + '"']),
    (True, ['{"a": [1, 2.5e-3, "x", null, true, {}]}', '"s"', '-0.5', '[]'],
     ['{"a" 1}', '[1,]', "'x'", '01', '{"a": tru}']),
]


V = jsonschema.Draft202012Validator
# formats the jsonschema package checks only with optional dependencies
_UNCHECKED_FORMATS = {f for f in ("date", "time", "date-time", "uuid", "email", "hostname", "uri",
                                    "uri-reference")
                      if f not in V.FORMAT_CHECKER.checkers}


def _validator(schema):
    if isinstance(schema, dict) and schema.get("nullable"):   # OpenAPI's, not JSON Schema's
        schema = {"anyOf": [{k: v for k, v in schema.items() if k != "nullable"},
                            {"type": "null"}]}
    return V(schema, format_checker=V.FORMAT_CHECKER)


@pytest.mark.parametrize("schema,valid,invalid", TABLE)
def test_schema_table(schema, valid, invalid):
    validator = _validator(schema)
    for text in valid:   # the table is right
        validator.validate(json.loads(text))
    for text in invalid:
        try:
            value = json.loads(text)
        except ValueError:
            continue
        fmt = schema.get("format") if isinstance(schema, dict) else None
        if text not in NARROWED and fmt not in _UNCHECKED_FORMATS:
            assert not validator.is_valid(value), text
    check_table(compile_json_schema(schema), valid, invalid)


@pytest.mark.parametrize("schema,feature", [
    ({"type": "string", "pattern": "^(?=a)b"}, "/pattern"),
    ({"type": "string", "pattern": "(a)\\1"}, "backreference"),
    ({"not": {"type": "string"}}, "not at /not"),
    ({"type": "object", "properties": {"x": {"if": {"type": "string"}}}}, "if at /properties/x/if"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"type": "object", "properties": {"a": {"$ref": "other.json#/x"}}}, "another document"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "format": "duration"}, "format 'duration'"),
    ({"type": "string", "pattern": "^a+$", "minLength": 0, "maxLength": 3}, None),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "string", "format": "date", "pattern": "^2"}, "format 'date' together with pattern"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf (branches that may overlap)"),
    ({"type": "object", "dependencies": {"a": {"properties": {"b": {"type": "null"}}}}},
     "dependencies with a schema"),
    ({"type": "tuple"}, "type must be a type name"),
    (False, "false"),
])
def test_unsupported_features_are_refused(schema, feature):
    if feature is None:   # supported: the pattern is narrowed to fit the length
        check_table(compile_json_schema(schema), ['"aaa"'], ['"aaaa"', '""'])
        return
    with pytest.raises(UnsupportedSchema) as e:
        compile_json_schema(schema)
    assert feature in str(e.value) and isinstance(e.value, ValueError)


def test_narrowings_stay_valid():
    """Where the grammar is narrower than the schema, what it accepts is still valid."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "dependencies": {"a": ["b"]}, "minProperties": 1}
    g = compile_json_schema(schema)
    check_table(g, ['{"a": 1, "b": "x"}', '{"b": "x"}'], ['{"a": 1}', '{}'])
    for text in ['{"a": 1, "b": "x"}', '{"b": "x"}']:
        jsonschema.validate(json.loads(text), schema)


def test_numbers_run_to_16_digits_as_llama_cpps():
    """An integral part and a fraction of at most 16 digits each where no bound says
    otherwise (llama.cpp's converter bounds them alike): a model cannot write digits until
    max_tokens inside one number."""
    check_table(compile_json_schema({"type": "integer"}),
                ["0", "1234567890123456", "-9999999999999999"],
                ["12345678901234567", "-12345678901234567", "01"])
    check_table(compile_json_schema({"type": "number"}),
                ["1.1234567890123456", "1234567890123456.5e10", "-0.5"],
                ["1.12345678901234567", "12345678901234567", "1e12345678901234567"])
    check_table(compile_json_schema({"type": "integer", "minimum": 5}),
                ["5", "1234567890123456"], ["4", "12345678901234567"])
    check_table(compile_json_schema({"type": "number", "exclusiveMinimum": 0}),
                ["0.0000000000000001", "7"], ["0.00000000000000001", "0"])


def test_jsonschemabench_compile_rate():
    files = sorted(glob.glob(os.path.join(BENCH, "*.json")))
    assert len(files) == 178
    failed = {}
    for path in files:
        with open(path) as f:
            schema = json.load(f)
        try:
            compile_json_schema(schema)
        except UnsupportedSchema as e:
            failed[os.path.basename(path)] = str(e)
    assert len(files) - len(failed) >= 0.95 * len(files), failed
    # what is refused is refused naming a feature the grammar cannot enforce
    assert {k: v.split(" at ")[0].removeprefix("unsupported JSON Schema feature ")
            for k, v in failed.items()} == REFUSED


REFUSED = {
    "Github_hard--o38435.json": "dependencies with a schema",
    "JsonSchemaStore--0.5.2.json": "format 'email' together with pattern",
    "JsonSchemaStore--backportrc.json": "uniqueItems (on items that are not an enum)",
    "JsonSchemaStore--codeship-steps.json": "if",
    "JsonSchemaStore--nodemon.json": "dependencies with a schema",
    "JsonSchemaStore--package.manifest.json": "uniqueItems (on items that are not an enum)",
    "JsonSchemaStore--rust-project.json": "uniqueItems (on items that are not an enum)",
    "JsonSchemaStore--vs-nesting.json": "uniqueItems (on items that are not an enum)",
}


def _no_repeated_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def _checker():
    """jsonschema's format checker, plus the formats it checks only with optional packages."""
    import datetime
    import re
    checker = jsonschema.FormatChecker()
    checker.checks("date-time")(lambda v: not isinstance(v, str) or bool(
        re.fullmatch(r"\d{4}-\d\d-\d\dT.*", v)) and bool(datetime.datetime.fromisoformat(v)))
    checker.checks("time")(lambda v: not isinstance(v, str) or bool(
        re.fullmatch(r"\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", v))
        and bool(datetime.time.fromisoformat(v)))
    checker.checks("hostname")(lambda v: not isinstance(v, str) or (
        len(v) <= 253 and all(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?", p)
                              for p in v.split("."))))
    checker.checks("uri")(lambda v: not isinstance(v, str) or bool(re.fullmatch(
        r"[A-Za-z][A-Za-z0-9+.-]*:(//[A-Za-z0-9._~!$&'()*+,;=%-]*)?"
        r"[A-Za-z0-9._~!$&'()*+,;=:@%/-]*(\?[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?"
        r"(#[A-Za-z0-9._~!$&'()*+,;=:@%/?-]*)?", v)))
    return checker


def test_jsonschemabench_random_answers_validate():
    """Every document the grammar accepts validates: a few random walks of each benchmark
    schema's grammar, parsed (no repeated keys) and checked with jsonschema, formats included."""
    import random
    rng = random.Random(1)
    checker = _checker()
    checked = schemas = 0
    for path in sorted(glob.glob(os.path.join(BENCH, "*.json"))):
        with open(path) as f:
            schema = json.load(f)
        try:
            g = compile_json_schema(schema)
        except UnsupportedSchema:
            continue
        validator = jsonschema.validators.validator_for(schema)(schema, format_checker=checker)
        done = 0
        for _ in range(2):
            text = random_sentence(g, rng)
            if text is None:
                continue
            value = json.loads(text.decode("utf-8"), object_pairs_hook=_no_repeated_keys)
            errors = list(validator.iter_errors(value))
            assert not errors, (os.path.basename(path), text[:300], errors[0].message)
            done += 1
        checked += done
        schemas += done > 0
    assert schemas >= 150 and checked >= 280, (schemas, checked)


def test_schema_masks_match_brute_force():
    """Masks at every prefix of an answer (strings in several contexts, numbers, nesting)
    equal token-by-token checking, for two grammars sharing the vocabulary's cached walks."""
    import numpy as np
    from tests.test_grammar import VOCAB, brute_force_mask, mask_bits
    schema = {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "string"}},
        "c": {"type": "object", "properties": {"d": {"type": "string", "maxLength": 3},
                                               "e": {"type": "number"}}}},
        "required": ["a", "b"]}
    text = '{"a": "x\\"y", "b": ["", "ab"], "c": {"d": "é", "e": -1.5}}'
    jsonschema.validate(json.loads(text), schema)
    for _ in range(2):
        m = Matcher(compile_json_schema(schema), VOCAB)
        for b in text.encode():
            np.testing.assert_array_equal(mask_bits(m, VOCAB), brute_force_mask(m, VOCAB))
            assert m.accept_bytes(bytes([b]))
        np.testing.assert_array_equal(mask_bits(m, VOCAB), brute_force_mask(m, VOCAB))
        assert m.can_end()


# --- the keyword table -------------------------------------------------------------------

REFUSED_SAMPLES = {"if": {}, "then": {}, "else": {}, "dependentSchemas": {"a": {}},
                   "unevaluatedProperties": False, "contains": {}, "minContains": 1,
                   "maxContains": 1, "unevaluatedItems": False, "$dynamicRef": "#x",
                   "$recursiveRef": "#"}

# keyword: (a schema where it is enforced, texts it accepts and rejects, a schema where it is
# refused, the feature the refusal names)
PARTIAL_SAMPLES = {
    "oneOf": ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ['"a"', "1"], ["true"],
              {"oneOf": [{"type": "string"}, {"maxLength": 2}]}, "oneOf (branches that may"),
    "$ref": ({"$defs": {"a": {"type": "null"}}, "$ref": "#/$defs/a"}, ["null"], ["1"],
             {"$ref": "https://example.com/s.json"}, "$ref to another document"),
    "not": ({"type": "object", "properties": {"a": {}}, "not": {"required": ["a"]}}, ["{}"],
            ['{"a": 1}'], {"not": {"type": "null"}}, "not at /not"),
    "propertyNames": ({"propertyNames": {"pattern": "^x"}, "additionalProperties": True},
                      ['{"xa": 1}'], ['{"a": 1}'], {"propertyNames": {"maxLength": 2}},
                      "propertyNames at /propertyNames"),
    "dependencies": ({"properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
                     ['{"a": 1, "b": 2}', '{"b": 2}'], ['{"a": 1}'],
                     {"dependencies": {"a": {"type": "object"}}}, "dependencies with a schema"),
    "uniqueItems": ({"items": {"enum": [1, 2]}, "uniqueItems": True}, ["[1, 2]"], ["[1, 1]"],
                    {"items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems (on"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, ['"aa"'], ['"ab"'],
                {"type": "string", "pattern": "(?=a)a"}, "pattern '(?=a)a'"),
    "format": ({"type": "string", "format": "ipv4"}, ['"10.0.0.1"'], ['"10.0.0"'],
               {"type": "string", "format": "duration"}, "format 'duration'"),
    "multipleOf": ({"type": "number", "multipleOf": 1}, ["3"], ["3.5"],
                   {"type": "number", "multipleOf": 2}, "multipleOf at /multipleOf"),
}


@pytest.mark.parametrize("keyword", [k.name for k in K.TABLE if k.kind == K.REFUSED])
def test_refused_keywords_are_refused_where_they_are(keyword):
    assert set(REFUSED_SAMPLES) == {k.name for k in K.TABLE if k.kind == K.REFUSED}
    schema = {"properties": {"x": {keyword: REFUSED_SAMPLES[keyword]}}}
    with pytest.raises(UnsupportedSchema) as e:
        compile_json_schema(schema)
    assert e.value.path == f"/properties/x/{keyword}", str(e.value)
    assert str(e.value).startswith(f"unsupported JSON Schema feature {keyword} at ")


@pytest.mark.parametrize("keyword", sorted(PARTIAL_SAMPLES))
def test_partial_keywords_enforce_one_form_and_refuse_the_others(keyword):
    assert set(PARTIAL_SAMPLES) == {k.name for k in K.TABLE if k.kind == K.PARTIAL}
    schema, valid, invalid, refused, feature = PARTIAL_SAMPLES[keyword]
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
    check_table(compile_json_schema(schema), valid, invalid)
    with pytest.raises(UnsupportedSchema) as e:
        compile_json_schema(refused)
    assert feature in str(e.value)


@pytest.mark.parametrize("keyword", [k.name for k in K.TABLE if k.kind == K.ANNOTATION])
def test_annotations_are_ignored(keyword):
    schema = {**PERSON, keyword: {"type": "string"}}
    check_table(compile_json_schema(schema), ['{"name": "a", "age": 1}'], ['{"name": "a"}'])


# value type: (a value of it, values of other types), each list of the JSON types a value may be
# in some draft's meta-schema, so that a keyword typed anything else is found by the test below
_VALUES_OF = {
    "schema": ({}, [5, "a", None, [{}]]),
    "schemas": ([{}, True], [{}, [], [5], [{}, "a"], "a"]),
    "schema_or_schemas": ({}, [5, "a", None, [5], [{}, 1]]),
    "schema_map": ({"a": {}}, [[], "a", {"a": 5}, {"a": {}, "b": []}]),
    "names": (["a"], ["a", 5, [5], {"a": 1}]),
    "names_map": ({"a": ["b"]}, [[], {"a": "b"}, {"a": [5]}, {"a": {}}]),
    "names_or_schema_map": ({"a": ["b"], "c": {}}, [[], {"a": "b"}, {"a": [5]}]),
    "types": ("string", [5, "strin", [], ["string", "strin"], [["string"]], {}]),
    "count": (3, [-1, 1.5, "3", True, None, [3]]),
    "number": (1.5, ["1", True, None, 10**400, -10**400, float("nan"), float("inf")]),
    "number_or_flag": (True, ["1", None, 10**400, [1]]),
    "string": ("a", [5, None, ["a"], {}]),
    "bool": (True, [1, "true", None]),
    "list": ([1], ["a", {}, 5]),
    "any": ({}, []),
}


@pytest.mark.parametrize("keyword", [k.name for k in K.TABLE if k.value != "any"])
def test_keyword_values_of_the_wrong_type_are_refused(keyword):
    """Every typed keyword of the table, given values of other types inside a subschema, is an
    InvalidSchema naming it, what it must be and the JSON pointer of the value at fault, from
    the compiler itself (not only from the API)."""
    from kinetic.grammar.json_schema import InvalidSchema
    kw = K.KEYWORDS[keyword]
    good, bad = _VALUES_OF[kw.value]
    assert kw.fault(good) is None
    for value in bad:
        with pytest.raises(InvalidSchema) as e:
            compile_json_schema({"properties": {"x": {"anyOf": [{}, {keyword: value}]}}})
        at = f"/properties/x/anyOf/1/{K.esc(keyword)}"
        assert e.value.feature == keyword and e.value.path.startswith(at), (value, e.value)
        assert e.value.path == at + kw.fault(value)
        assert str(e.value) == f"{keyword} must be {kw.must}, at {e.value.path}"


def test_value_types_are_checked_in_ref_targets_and_at_the_root():
    from kinetic.grammar.json_schema import InvalidSchema
    for schema, pointer in [
            ({"$ref": "#/$defs/a", "$defs": {"a": {"maxItems": -1}}}, "/$defs/a/maxItems"),
            ({"$ref": "#/x/y", "x": {"y": {"required": "a"}}}, "/x/y/required"),
            ({"$ref": "#/x", "x": 5}, "/$ref"), (5, "/"), ([{}], "/"), (None, "/")]:
        with pytest.raises(InvalidSchema) as e:
            compile_json_schema(schema)
        assert e.value.path == pointer, (schema, e.value)


def test_jsonschemabench_values_have_their_types():
    """The value types refuse no real schema: every one of tests/data/jsonschemabench passes
    (the compile rate test above then holds their refusals to the same 8 features)."""
    from kinetic.grammar.json_schema import check_types
    files = sorted(glob.glob(os.path.join(BENCH, "*.json")))
    assert len(files) == 178
    for path in files:
        with open(path) as f:
            check_types(json.load(f))


def test_keyword_table_is_consistent():
    from dataclasses import fields

    from kinetic.grammar.json_schema.formats import FORMATS
    from kinetic.grammar.json_schema.limits import SchemaLimits
    assert K.FORMATS == tuple(FORMATS)
    names = {f.name for f in fields(SchemaLimits)}
    for k in K.TABLE:
        assert set(k.limits) <= names, k.name
        assert k.kind in (K.ENFORCED, K.PARTIAL, K.REFUSED, K.ANNOTATION, K.CONTAINER)
        assert k.merge in ("same", "max", "min", "union", "types", "properties",
                           "false_wins", "branches"), k.name
        assert bool(k.refused) == (k.kind in (K.REFUSED, K.PARTIAL)), k.name
        assert k.value in K.VALUES and k.value in _VALUES_OF, k.name
        assert (k.value == "any") == (k.kind == K.ANNOTATION or k.name == "const"), k.name
    assert len(K.KEYWORDS) == len(K.TABLE)


def test_docs_list_the_keyword_table_and_the_limits():
    """docs/server.md and the package docstring hold the rendering of the table (regenerate
    with `python -m kinetic.grammar.json_schema.docs --write`)."""
    from pathlib import Path

    import kinetic.grammar.json_schema as package
    from kinetic.grammar.json_schema.docs import keyword_list, limit_list, marked
    docs = (Path(__file__).parents[1] / "docs" / "server.md").read_text()
    assert marked(docs, "json-schema-keywords") == keyword_list()
    assert marked(docs, "json-schema-limits") == limit_list()
    assert marked(package.__doc__, "json-schema-keywords") == keyword_list()


def test_private_looking_names_are_plain_names():
    """A keyword or property named `_one_of_required` (the converter once used that key to pass
    a oneOf rule along) is an unknown keyword and an ordinary property."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "_one_of_required": [[["a"]]]}
    check_table(compile_json_schema(schema), ["{}", '{"a": 1, "b": 2}', '{"b": 2}'], ['{"a": "x"}'])
    schema = {"type": "object", "properties": {"_one_of_required": {"type": "string"}},
              "required": ["_one_of_required"]}
    check_table(compile_json_schema(schema), ['{"_one_of_required": "x"}'],
                ["{}", '{"_one_of_required": 1}'])


def test_one_of_required_holds_beside_ref_and_enum():
    """The exactly-one rule of a oneOf of required sets is a typed record passed to the object:
    it is kept beside a $ref and filters an enum (whose values once escaped it)."""
    one_of = [{"required": ["a"]}, {"required": ["b"]}]
    props = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
    schema = {"$defs": {"o": props}, "$ref": "#/$defs/o", "oneOf": one_of}
    check_table(compile_json_schema(schema), ['{"a": 1}', '{"b": 2}'], ["{}", '{"a": 1, "b": 2}'])
    schema = {"enum": [{"a": 1}, {"a": 1, "b": 2}, {"b": 2}, {}], "oneOf": one_of}
    check_table(compile_json_schema(schema), ['{"a":1}', '{"b":2}'], ['{"a":1,"b":2}', "{}"])


def test_allof_of_anyofs():
    """Two anyOfs under allOf: each branch of one is joined with the other (this recursed
    without end)."""
    schema = {"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]},
                        {"anyOf": [{"type": "integer", "minimum": 1},
                                   {"type": "string", "maxLength": 2}]}]}
    for text in ["5", '"ab"']:
        jsonschema.validate(json.loads(text), schema)
    check_table(compile_json_schema(schema), ["5", '"ab"'], ["0", '"abc"', "null"])
