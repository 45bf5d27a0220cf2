"""The converter core: one schema walked into grammar rules.

`gen(schema, path)` returns the expression of one value of the schema (no surrounding
whitespace). In order: `$ref` (a rule per target, so recursion is a recursive rule), the
refused keywords (the table's order), nullable, allOf (merged), anyOf / oneOf, enum / const,
then the handler of each type the schema allows. `path` is the JSON pointer of the schema, so
every refusal names where it is; the nesting depth, the `$ref` depth and the number of
subschemas compiled are counted here against the SchemaLimits.
"""

from __future__ import annotations


from kinetic.grammar.ir import (Alt, Chars, Grammar, GrammarBuilder, Lit, Ref, Rep, alt, chars,
                                lit, literal_trie, opt, seq, star)
from kinetic.grammar.json_schema.arrays import array_value
from kinetic.grammar.json_schema.combine import any_of, merge, merge_all
from kinetic.grammar.json_schema.keywords import (MISSING, VALIDATION, has_validation,
                                                  infer_type, ref_target, refusal)
from kinetic.grammar.json_schema.limits import (SchemaLimits, Unsatisfiable, UnsupportedSchema,
                                                too_large)
from kinetic.grammar.json_schema.literals import literal_bytes, of_types, same_json
from kinetic.grammar.json_schema.numbers import DIGIT, FRAC_ANY, INTEGRAL, MAX_DIGITS, number
from kinetic.grammar.json_schema.objects import ExactlyOne, object_value
from kinetic.grammar.json_schema.strings import json_char, searcher, string_rule
from kinetic.grammar.matcher import accepts

WS_MAX = 20   # whitespace between tokens, at most (a model must not pad forever)
_NEVER = Alt(())   # the rule of a $ref target no value can meet


def define_json_rules(b: GrammarBuilder) -> None:
    """The rules every schema shares: ws, json-char, json-string, json-number, json-integer,
    json-object, json-array, json-value (any JSON value)."""
    b.define("ws", Rep(chars([(9, 10), (13, 13), (32, 32)]), 0, WS_MAX))
    b.define("json-char", json_char())
    b.define("json-string", seq(lit('"'), star(Ref("json-char")), lit('"')))
    integer = seq(opt(lit("-")), INTEGRAL)   # at most MAX_DIGITS digits, as llama.cpp's
    b.define("json-number", seq(integer, FRAC_ANY,
                                opt(seq(chars([(69, 69), (101, 101)]),
                                        opt(chars([(43, 43), (45, 45)])),
                                        Rep(DIGIT, 1, MAX_DIGITS)))))
    b.define("json-integer", integer)
    ws = Ref("ws")
    kv = seq(Ref("json-string"), ws, lit(":"), ws, Ref("json-value"))
    b.define("json-object", seq(lit("{"), ws, opt(seq(kv, star(seq(lit(","), ws, kv)))),
                                lit("}")))
    item = seq(Ref("json-value"), ws)
    b.define("json-array", seq(lit("["), ws, opt(seq(item, star(seq(lit(","), ws, item)))),
                               lit("]")))
    b.define("json-value", alt(Ref("json-object"), Ref("json-array"), Ref("json-string"),
                               Ref("json-number"), lit("true"), lit("false"), lit("null")))


class Converter:
    """The rules of one schema in `builder` (a fresh one by default), named with `prefix`."""

    def __init__(self, root, limits: SchemaLimits, builder: GrammarBuilder | None = None,
                 prefix: str = "", budget: list[int] | None = None):
        self.root = root
        self.limits = limits
        self.b = builder or GrammarBuilder()
        self.prefix = prefix
        self.refs: dict[str, str] = {}          # $ref -> rule name
        self.dead: set[str] = set()             # $refs whose target no value meets
        self.key_class: dict[str, object] = {}  # key_not_in's classes, by excluded characters
        self.summaries: dict[int, tuple] = {}   # combine.py's disjointness summaries
        self.searches: dict[str, object] = {}   # pattern -> searcher
        self.rules: dict[tuple, str] = {}       # named(): key -> rule name
        self.depth = 0        # gen calls on the stack
        self.ref_depth = 0    # $ref targets being expanded
        self.budget = budget if budget is not None else [limits.steps]   # shared
        define_json_rules(self.b)

    def build(self) -> Grammar:
        body = self.gen(self.root, "")
        self.b.define("root", seq(Ref("ws"), body, Ref("ws")))
        return self.b.build("root")

    def gen(self, s, path: str, one_of: tuple[ExactlyOne, ...] = ()):
        """The expression of one value of `s`; `one_of` are ExactlyOne rules of the object
        it must be (from a oneOf beside it)."""
        self.spend(1, path)
        self.depth += 1
        try:
            if self.depth > self.limits.depth:
                raise too_large(self.limits, "depth", "a subschema", path,
                                f"is nested {self.depth} deep, counting through $ref")
            return self._gen(s, path, one_of)
        finally:
            self.depth -= 1

    def spend(self, steps: int, path: str) -> None:
        """Counts compiling steps (a subschema, an enum value, a property) against the limit."""
        self.budget[0] -= steps
        if self.budget[0] < 0:
            raise too_large(self.limits, "steps", "the schema", "",
                            f"takes more than {self.limits.steps} steps to compile "
                            f"(subschemas, enum values, properties; at {path or '/'})")

    def _gen(self, s, path: str, one_of: tuple):
        if s is True or s == {}:
            if not one_of:
                return Ref("json-value")
            s = {"type": "object"}
        if s is False:
            raise Unsatisfiable("false (a schema that matches nothing)", path)
        if not isinstance(s, dict):
            raise UnsupportedSchema(f"a schema of type {type(s).__name__}", path)
        if "$ref" in s:
            target = self.ref(s["$ref"], path + "/$ref")
            rest = {k: v for k, v in s.items() if k in VALIDATION and k != "$ref"}
            if not rest and not one_of:
                return target
            return self.gen({"allOf": [{"$ref": s["$ref"]}, rest]}, path, one_of)
        if "multipleOf" in s and s["multipleOf"] == 1 and s.get("type") in ("integer", "number"):
            s = {**{k: v for k, v in s.items() if k != "multipleOf"}, "type": "integer"}
        refused = refusal(s)
        if refused is not None:
            keyword, feature = refused
            raise UnsupportedSchema(feature, f"{path}/{keyword}")
        if s.get("nullable") is True:
            inner = {k: v for k, v in s.items() if k != "nullable"}
            return alt(self.gen(inner, path, one_of), lit("null"))
        if "allOf" in s:
            return self.gen(merge_all(self, s, path), path, one_of)
        for key in ("anyOf", "oneOf"):
            if key in s:
                return any_of(self, s, key, path, one_of)
        if "const" in s or "enum" in s:
            return self.enum(s, path, one_of)
        t = s.get("type")
        if t is None:
            t = infer_type(s)
        if isinstance(t, list):
            return alt(*(self.typed(s, x, path, one_of) for x in dict.fromkeys(t)))
        if t is None:
            return Ref("json-value")
        return self.typed(s, t, path, one_of)

    def typed(self, s: dict, t, path: str, one_of: tuple):
        if t == "string":
            return string_rule(self, s, path)
        if t in ("integer", "number"):
            return number(s, path, t == "integer", self.limits)
        if t == "boolean":
            return alt(lit("true"), lit("false"))
        if t == "null":
            return lit("null")
        if t == "object":
            return object_value(self, s, path, one_of)
        if t == "array":
            return array_value(self, s, path)
        raise UnsupportedSchema(f"type {t!r}", path + "/type")

    def enum(self, s: dict, path: str, one_of: tuple):
        """The values of an enum or const that the keywords beside it allow, as a trie."""
        values = [s["const"]] if "const" in s else s["enum"]
        if not isinstance(values, list) or not values:
            raise UnsupportedSchema("enum that is not a non-empty list", path + "/enum")
        if "const" in s and isinstance(s.get("enum"), list):
            values = [v for v in values if same_json(v, s["enum"])]
        if s.get("type") is not None:
            values = of_types(values, s["type"])
        rest = {k: v for k, v in s.items() if k in VALIDATION and k not in ("enum", "const")}
        if (set(rest) - {"type"} or one_of) and values:
            # other keywords: keep the values their grammar accepts
            sub = Converter(self.root, self.limits, budget=self.budget)
            sub.depth = self.depth
            try:
                sub.b.define("root", sub.gen(rest, path, one_of))
                g = sub.b.build("root")
                values = [v for v in values if accepts(g, literal_bytes(v))]
            except Unsatisfiable:
                values = []
        if not values:
            raise Unsatisfiable("enum with no value that fits the other keywords", path)
        self.spend(len(values), path)
        return literal_trie([literal_bytes(v) for v in values], self.share)

    def literal(self, value) -> Lit:
        return lit(literal_bytes(value))

    def share(self, expr):
        """Names a sizable expression so later uses refer to it instead of copying it."""
        if isinstance(expr, (Ref, Lit, Chars)) or expr == seq():
            return expr
        name = self.b.fresh("obj")
        self.b.define(name, expr)
        return Ref(name)

    def named(self, key, make):
        """A reference to the rule `make()` returns, made once per key."""
        name = self.rules.get(key)
        if name is None:
            expr = make()
            if isinstance(expr, Ref):
                return expr
            name = self.rules[key] = self.b.fresh("str")
            self.b.define(name, expr)
        return Ref(name)

    def search(self, pattern: str, path: str):
        """A cached strings.searcher of `pattern`."""
        fn = self.searches.get(pattern)
        if fn is None:
            fn = self.searches[pattern] = searcher(pattern, path, self.limits)
        return fn

    # --- $ref ---------------------------------------------------------------------------

    def ref(self, ref, path: str):
        """A reference to the rule of a $ref target, made on first use."""
        self._check_ref(ref, path)
        if ref in self.dead:
            raise Unsatisfiable(f"$ref to a schema no value meets ({ref!r})", path)
        name = self.refs.get(ref)
        if name is None:
            name = f"{self.prefix}ref-{len(self.refs)}"
            self.refs[ref] = name
            target = self.resolve(ref, path)
            self.ref_depth += 1
            try:
                if self.ref_depth > self.limits.ref_depth:
                    raise too_large(self.limits, "ref_depth", "$ref", path,
                                    f"is expanded inside {self.ref_depth - 1} other $ref "
                                    f"targets")
                self.b.define(name, self.gen(target, ref[1:] or "/"))
            except Unsatisfiable:
                self.dead.add(ref)
                self.b.define(name, _NEVER)   # rules made meanwhile may refer to it
                raise
            finally:
                self.ref_depth -= 1
        return Ref(name)

    def _check_ref(self, ref, path: str) -> None:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema(f"$ref to another document ({ref!r})", path)

    def resolve(self, ref: str, path: str):
        self._check_ref(ref, path)
        if ref[1:] and not ref.startswith("#/"):
            raise UnsupportedSchema(f"$ref by anchor ({ref!r})", path)
        node = ref_target(self.root, ref)
        if node is MISSING:
            raise UnsupportedSchema(f"$ref to a missing target ({ref!r})", path)
        return node

    def deref(self, s, path: str):
        """`s` with its $ref chain followed (a $ref beside other keywords merged into them)."""
        seen: list[str] = []
        while isinstance(s, dict) and "$ref" in s:
            ref = s["$ref"]
            self._check_ref(ref, path)
            if ref in seen:
                raise UnsupportedSchema("a $ref cycle", path)
            seen.append(ref)
            if len(seen) > self.limits.ref_depth:
                raise too_large(self.limits, "ref_depth", "a $ref chain", path,
                                f"is {len(seen)} long")
            rest = {k: v for k, v in s.items() if k != "$ref"}
            target = self.resolve(ref, path)
            if has_validation(rest):
                if target is True:
                    target = {}
                if not isinstance(target, dict):
                    raise UnsupportedSchema("$ref with other keywords", path)
                s = merge(target, rest, path)
            else:
                s = target
        return s
