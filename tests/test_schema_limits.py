"""Schema limits: each SchemaLimits bound at its value compiles (or narrows) and one past it is
refused with a SchemaTooLarge naming the limit, its value and the JSON pointer. Plus large enums
as tries, and the hostile inputs the limits exist for."""

from __future__ import annotations

import json
import time

import pytest

from kinetic.grammar.json_schema import (LIMITS, SchemaTooLarge, UnsupportedSchema,
                                         compile_json_schema)
from kinetic.grammar.matcher import accepts
from tests.test_grammar import check_table


def _refused(schema, limit: str, pointer: str) -> SchemaTooLarge:
    with pytest.raises(SchemaTooLarge) as e:
        compile_json_schema(schema)
    err = e.value
    value = getattr(LIMITS, limit)
    assert err.limit == limit and err.path == pointer, str(err)
    assert f"at {pointer} " in str(err) and f"at most {value} allowed" in str(err)
    assert f"(schema limit {limit})" in str(err) and isinstance(err, UnsupportedSchema)
    return err


def _nest(n: int, wrap, leaf):
    for _ in range(n):
        leaf = wrap(leaf)
    return leaf


def test_schema_bytes():
    n = LIMITS.schema_bytes
    pad = n - len(json.dumps({"description": ""}, separators=(",", ":")))
    compile_json_schema({"description": "x" * pad})
    _refused({"description": "x" * (pad + 1)}, "schema_bytes", "/")


def test_depth():
    arrays = lambda n: _nest(n, lambda s: {"type": "array", "items": s}, {"type": "integer"})
    check_table(compile_json_schema(arrays(LIMITS.depth - 1)),
                ["[" * (LIMITS.depth - 1) + "1" + "]" * (LIMITS.depth - 1)], ["1"])
    _refused(arrays(LIMITS.depth), "depth", "/items" * LIMITS.depth)


def test_depth_counts_through_ref():
    # each definition nests 3 deep (object, property, items) before the next $ref
    def chain(n):
        defs = {f"d{i}": {"type": "object", "properties": {"x": {
            "type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}}} for i in range(n)}
        defs[f"d{n}"] = {"type": "integer"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}
    n = (LIMITS.depth - 2) // 3   # d_i compiles at depth 2 + 3 i
    compile_json_schema(chain(n))
    err = _refused(chain(n + 1), "depth", f"/$defs/d{n + 1}")
    assert "through $ref" in str(err)


def test_ref_depth():
    def chain(n):   # d0 -> d1 -> ... -> dn, each a $ref to the next
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        defs[f"d{n}"] = {"type": "boolean"}
        return {"$defs": defs, "$ref": "#/$defs/d0"}
    n = LIMITS.ref_depth
    check_table(compile_json_schema(chain(n - 1)), ["true"], ["1"])
    _refused(chain(n), "ref_depth", f"/$defs/d{n - 1}/$ref")


def test_enum_values():
    values = [f"v{i}" for i in range(LIMITS.enum_values)]
    compile_json_schema({"properties": {"x": {"enum": values}}})
    _refused({"properties": {"x": {"enum": values + ["w"]}}}, "enum_values",
             "/properties/x/enum")


def test_enum_bytes():
    text = "x" * (LIMITS.enum_bytes - 2)   # its JSON: two quotes more
    g = compile_json_schema({"properties": {"x": {"const": text}}})
    assert accepts(g, b'{"x": "' + text.encode() + b'"}')
    assert not accepts(g, b'{"x": "' + text.encode() + b'x"}')
    _refused({"properties": {"x": {"const": text + "x"}}}, "enum_bytes", "/properties/x/const")


def test_alternatives():
    branches = [{"const": i} for i in range(LIMITS.alternatives)]
    check_table(compile_json_schema({"anyOf": branches}), ["0", "255"], ["256"])
    _refused({"anyOf": branches + [{"const": "x"}]}, "alternatives", "/anyOf")


def test_properties():
    props = {f"p{i}": {"type": "integer"} for i in range(LIMITS.properties)}
    compile_json_schema({"type": "object", "properties": props})
    _refused({"type": "object", "properties": {**props, "q": {}}}, "properties", "/properties")


@pytest.mark.parametrize("keyword", ["minLength", "minItems"])
def test_repeat_minimums(keyword):
    compile_json_schema({keyword: LIMITS.repeat})
    _refused({"properties": {"x": {keyword: LIMITS.repeat + 1}}}, "repeat",
             f"/properties/x/{keyword}")


def test_repeat_in_pattern():
    n = LIMITS.repeat
    check_table(compile_json_schema({"type": "string", "pattern": f"^a{{{n}}}$"}),
                ['"' + "a" * n + '"'], ['"' + "a" * (n - 1) + '"'])
    _refused({"type": "string", "pattern": f"^(b|a{{2,{n + 1}}})$"}, "repeat", "/pattern")
    _refused({"patternProperties": {f"^a{{{n + 1}}}$": {}}}, "repeat",
             f"/patternProperties/^a{{{n + 1}}}$")


def test_repeat_narrows_maximums():
    """maxLength and maxItems far past the minimum are narrowed, not refused: the grammar takes
    `repeat` more than the minimum (every answer still valid)."""
    n = LIMITS.repeat
    g = compile_json_schema({"type": "string", "minLength": 1, "maxLength": 10 ** 9})
    assert accepts(g, b'"' + b"a" * (n + 1) + b'"') and not accepts(g, b'"' + b"a" * (n + 2) + b'"')
    g = compile_json_schema({"type": "array", "maxItems": 10 ** 9})
    assert accepts(g, ("[" + ",".join(["0"] * n) + "]").encode())
    assert not accepts(g, ("[" + ",".join(["0"] * (n + 1)) + "]").encode())


def test_number_digits():
    big = 10 ** LIMITS.number_digits - 1
    check_table(compile_json_schema({"type": "integer", "maximum": big}),
                [str(big), "-5"], [str(big + 1)])
    # a bound that widens the range past it is narrowed: 1.8e308 (a double's maximum) to big
    for schema in ({"type": "integer", "maximum": big + 1},
                   {"type": "number", "maximum": 1.7976931348623157e308},
                   {"type": "integer", "minimum": -(big + 1)}):
        g = compile_json_schema(schema)
        assert accepts(g, str(big if "maximum" in schema else -big).encode())
        assert not accepts(g, str(big + 1 if "maximum" in schema else -(big + 1)).encode())
    compile_json_schema({"type": "integer", "minimum": big})
    err = _refused({"type": "integer", "minimum": big + 1}, "number_digits", "/minimum")
    assert f"has {LIMITS.number_digits + 1} digits" in str(err)
    _refused({"type": "number", "exclusiveMaximum": -(big + 1)}, "number_digits",
             "/exclusiveMaximum")


def test_steps():
    # steps: the object (1), its 5 names (5), each property (5) and each enum value
    sizes = [4096] * 4 + [LIMITS.steps - 11 - 4 * 4096]
    props = lambda sizes: {"type": "object", "properties": {
        f"p{i}": {"enum": [f"{i}.{j}" for j in range(n)]} for i, n in enumerate(sizes)}}
    compile_json_schema(props(sizes))
    err = _refused(props(sizes[:-1] + [sizes[-1] + 1]), "steps", "/")
    assert "at /properties/p4" in str(err)


def test_steps_stop_allof_over_anyof():
    """allOf of anyOfs multiplies the branches (4^10 here): refused, and quickly."""
    schema = {"allOf": [{"anyOf": [{"type": "object", "properties": {f"p{j}{i}": {}}}
                                   for i in range(4)]} for j in range(10)]}
    _refused(schema, "steps", "/")


def test_combinations():
    # 211 optional properties, at most 24 present: 325 + 25 * 187 = 5000 states
    def obj(n):
        return {"type": "object", "maxProperties": 24,
                "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}
    compile_json_schema(obj(211))
    _refused(obj(212), "combinations", "/")


def test_large_enum_is_refused_quickly():
    schema = {"enum": [f"v{i}" for i in range(100_000)]}
    start = time.perf_counter()
    _refused(schema, "enum_values", "/enum")
    assert time.perf_counter() - start < 1.0


def test_large_enum_is_a_trie():
    """A 4000-string enum compiles to a grammar that accepts exactly its values."""
    values = [f"v{i}" for i in range(4000)]
    g = compile_json_schema({"enum": values})
    for v in values:
        assert accepts(g, json.dumps(v).encode()), v
    for text in ['"v4000"', '"v"', '""', '"v01"', '"v3999 "', '"w1"', '"v1', 'v1', '"v12345"',
                 '"v39990"', "1", "null"]:
        assert not accepts(g, text.encode()), text


def test_enum_trie_shares_prefixes_of_any_value():
    """Values that are prefixes of others, numbers and objects, and long values sharing a
    prefix, in one trie."""
    values = ["a", "ab", "abc", "b", 1, 12, 1.5, None, True, {"k": [1]}, ["x"],
              "p" * 3000 + "1", "p" * 3000 + "2"]
    check_table(compile_json_schema({"enum": values}),
                [json.dumps(v, separators=(",", ":")) for v in values],
                ['"abcd"', '"ac"', "2", "123", "1.", "false", '{"k":[2]}', '["x","y"]',
                 '"' + "p" * 3000 + '"', '"' + "p" * 3000 + '3"'])


def test_pattern_properties_do_not_backtrack():
    """Property names are matched against patterns by the pattern's grammar: Python's re takes
    time doubling with each "a" to find that `^(a+)+$` does not match "aaa...!" (0.2 s at 22,
    half a day at 40)."""
    name = "a" * 40 + "!"
    schema = {"type": "object", "properties": {name: {"type": "integer"}},
              "patternProperties": {"^(a+)+$": {"type": "string"}}, "required": [name]}
    key = '{"' + name + '": '
    check_table(compile_json_schema(schema), [key + "1}", key + '1, "aa": "x"}'],
                [key + '"x"}', key + '1, "aa": 2}'])
