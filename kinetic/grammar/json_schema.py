"""JSON Schema to the grammar IR.

`compile_json_schema(schema)` returns a Grammar whose sentences are JSON texts valid under the
schema. The grammar may be narrower than the schema, never wider: every text it accepts
validates. A keyword it cannot enforce raises UnsupportedSchema naming it and where it is (the
API answers 400), rather than being ignored. Annotations (title, description, default,
examples, $comment, deprecated, readOnly, writeOnly, $schema, $id, contentMediaType, ...) and
unknown keywords are ignored, as JSON Schema itself ignores them; so are `format` values outside
the standard ones (int64, url, ... : annotations, as JSON Schema makes every format by default).
`{"type": "json_object"}` in the API is `compile_json_schema(True)`: any JSON value.

Enforced: type (one or a list), properties, required, additionalProperties, patternProperties,
propertyNames (pattern), minProperties, maxProperties, dependencies / dependentRequired (lists),
`not: {required: [...]}`, enum, const (filtered by the other keywords), items / prefixItems (and
draft-4 tuple items with additionalItems), minItems, maxItems, uniqueItems on enum items,
minLength, maxLength, pattern, format (date, time, date-time, uuid, email, hostname, ipv4, ipv6,
uri, uri-reference), minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf 1, anyOf,
oneOf (when the branches are provably disjoint, or only require properties: exactly one then),
allOf (merged), $ref into the same document (#/$defs/..., #/definitions/..., any JSON pointer,
recursion included), nullable.

Refused (UnsupportedSchema): not (other than not-required), if/then/else, dependentSchemas and
dependencies with a schema, contains, unevaluated*, multipleOf other than 1, uniqueItems on
items that are not an enum, oneOf whose branches may overlap, a format together with a pattern,
formats such as duration or regex, $ref to another document, $dynamicRef.

Narrowings (every answer still validates): key order fixed (declared order, then extra keys);
keys outside `properties` only when additionalProperties / patternProperties allow them, written
without escapes and never repeating a named property (a patternProperties pattern that matches
a named property adds no keys); minProperties met by extra keys needs at most one of them;
unique enum items in enum order; maxLength/maxItems above MAX_REPEAT capped; fractional number
bounds rounded inward to integers; no exponents in bounded numbers; canonical spellings ("0",
not "-0"; integers without ".0"); a pattern with lengths narrowed to fit them; formats as a
subset of their syntax (ipv6 in full form, dates without 29 February, hostnames of up to 4
labels of up to 62 characters).
"""

from __future__ import annotations

import json
import math
import re

from kinetic.grammar.ir import (EMPTY, Alt, Chars, Grammar, GrammarBuilder, Lit, Rep, Ref, Seq,
                                alt, chars, lit, opt, seq, star)
from kinetic.grammar.matcher import accepts
from kinetic.grammar.regex import RegexUnsupported, parse_regex


class UnsupportedSchema(ValueError):
    """A schema the grammar cannot enforce; `path` is the JSON pointer of the keyword."""

    def __init__(self, feature: str, path: str):
        self.feature = feature
        self.path = path or "/"
        super().__init__(f"unsupported JSON Schema feature {feature} at {self.path}")


class _Unsatisfiable(UnsupportedSchema):
    """A (sub)schema no value can satisfy."""


MAX_REPEAT = 2000   # maxLength / maxItems above this are narrowed to it (sound: fewer values)

_UNSUPPORTED_FORMATS = {"regex", "json-pointer", "relative-json-pointer", "uri-template",
                        "idn-email", "idn-hostname", "iri", "iri-reference", "duration"}
_UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependencies", "dependentRequired",
                         "dependentSchemas", "contains", "minContains", "maxContains",
                         "propertyNames", "unevaluatedProperties", "unevaluatedItems",
                         "maxProperties", "multipleOf", "$dynamicRef", "$recursiveRef")
_TYPES = ("string", "number", "integer", "boolean", "null", "object", "array")

WS_MAX = 20


def compile_json_schema(schema) -> Grammar:
    """The grammar of JSON texts valid under `schema` (a dict, or True for any JSON value)."""
    return _Converter(schema).build()


def schema_expr(builder: GrammarBuilder, schema, prefix: str):
    """Defines in `builder` the rules of a value of `schema` and returns the expression of one
    such value (no surrounding whitespace), so several schemas can live in one grammar (tool
    calls). The schema's own rules are named with `prefix`; the shared JSON rules (ws, json-*)
    are the same for every schema. Raises UnsupportedSchema as compile_json_schema does."""
    return _Converter(schema, builder, prefix).gen(schema, "")


# --- fixed pieces --------------------------------------------------------------------------

def _r(a: str, b: str | None = None):
    return Chars(((ord(a), ord(b or a)),))


_DIGIT = _r("0", "9")
_NZ_DIGIT = _r("1", "9")
_HEX = chars([(48, 57), (65, 70), (97, 102)])
_HEX_NO_SURROGATE_LEAD = chars([(48, 57), (65, 67), (69, 70), (97, 99), (101, 102)])
_WS = Ref("ws")


def _str_char():
    plain = chars([(0, 0x1F), (ord('"'), ord('"')), (ord("\\"), ord("\\"))], negate=True)
    esc = seq(lit("\\"), alt(Chars(tuple((ord(c), ord(c)) for c in sorted('"\\/bfnrt'))),
                             seq(lit("u"), alt(seq(_HEX_NO_SURROGATE_LEAD, _HEX),
                                               seq(chars([(68, 68), (100, 100)]), _r("0", "7"))),
                                 _HEX, _HEX)))
    return alt(plain, esc)


_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r",
            9: "\\t"}


def _json_chars(ranges) -> object:
    """A code point set as JSON string content: plain characters raw, the others escaped."""
    plain, special = [], []
    for lo, hi in ranges:
        for sp_lo, sp_hi in ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)):
            a, b = max(lo, sp_lo), min(hi, sp_hi)
            if a <= b:
                special.extend(range(a, b + 1))
        plain.append((lo, hi))
    cut = chars([(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)], negate=True).ranges
    inter = []
    for lo, hi in plain:
        for a, b in cut:
            x, y = max(lo, a), min(hi, b)
            if x <= y:
                inter.append((x, y))
    items = [Chars(tuple(inter))] if inter else []
    items += [lit(_ESCAPES.get(c, f"\\u{c:04x}")) for c in special]
    return alt(*items) if items else None


def _jsonify(expr):
    """A regex expression over code points as an expression over JSON string content."""
    if isinstance(expr, Chars):
        out = _json_chars(expr.ranges)
        if out is None:
            raise RegexUnsupported("an empty character class")
        return out
    if isinstance(expr, Seq):
        return seq(*(_jsonify(e) for e in expr.items)) if expr.items else EMPTY
    if isinstance(expr, Alt):
        return alt(*(_jsonify(e) for e in expr.items))
    if isinstance(expr, Rep):
        return Rep(_jsonify(expr.item), expr.min, expr.max)
    return expr


def _digits(n: int):
    return Rep(_DIGIT, n, n)


def _same_len_range(a: str, b: str):
    """Digit strings of len(a) == len(b) between a and b (leading zeros allowed)."""
    if not a:
        return EMPTY
    if a[0] == b[0]:
        return seq(lit(a[0]), _same_len_range(a[1:], b[1:]))
    rest = len(a) - 1
    out = []
    lo_d, hi_d = int(a[0]), int(b[0])
    if a[1:] == "0" * rest:
        first = lo_d
    else:
        out.append(seq(lit(a[0]), _same_len_range(a[1:], "9" * rest)))
        first = lo_d + 1
    if b[1:] == "9" * rest:
        last = hi_d
        tail = None
    else:
        last = hi_d - 1
        tail = seq(lit(b[0]), _same_len_range("0" * rest, b[1:]))
    if first <= last:
        out.append(seq(_r(str(first), str(last)), _digits(rest)))
    if tail is not None:
        out.append(tail)
    return alt(*out)


def _nonneg_int(lo: int, hi: int | None):
    """Canonical decimal integers in lo..hi (hi None: unbounded), lo >= 0."""
    if hi is not None and hi < lo:
        return None
    out = []
    n_lo = len(str(lo))
    top = hi if hi is not None else 10 ** n_lo - 1
    for n in range(n_lo, len(str(top)) + 1):
        a = max(lo, 10 ** (n - 1) if n > 1 else 0)
        b = min(top, 10 ** n - 1)
        if a <= b:
            out.append(_same_len_range(str(a).zfill(n), str(b)))
    if hi is None:
        out.append(seq(_NZ_DIGIT, Rep(_DIGIT, n_lo, None)))
    return alt(*out)


def _int_range(lo: int | None, hi: int | None):
    out = []
    if lo is None or lo <= -1:
        neg_top = -1 if hi is None else min(hi, -1)
        if lo is None or lo <= neg_top:
            body = _nonneg_int(-neg_top, None if lo is None else -lo)
            if body is not None:
                out.append(seq(lit("-"), body))
    if hi is None or hi >= 0:
        body = _nonneg_int(max(lo, 0) if lo is not None else 0, hi)
        if body is not None:
            out.insert(0, body)
    return alt(*out) if out else None


_FRAC_ANY = opt(seq(lit("."), Rep(_DIGIT, 1, None)))
_FRAC_NONZERO = seq(lit("."), star(_DIGIT), _NZ_DIGIT, star(_DIGIT))
_FRAC_ZERO = opt(seq(lit("."), Rep(lit("0"), 1, None)))


def _nonneg_real(lo: int, lo_excl: bool, hi: int | None, hi_excl: bool):
    """Decimal numbers x >= 0 (no exponent) with lo <(=) x <(=) hi, lo and hi integers."""
    out = []
    start = lo
    if lo_excl:
        if hi is None or lo < hi:
            out.append(seq(lit(str(lo)), _FRAC_NONZERO))
        start = lo + 1
    if hi is None:
        out.append(seq(_nonneg_int(start, None), _FRAC_ANY))
    else:
        if start <= hi - 1:
            out.append(seq(_nonneg_int(start, hi - 1), _FRAC_ANY))
        if not hi_excl and hi >= start and hi >= lo:
            out.append(seq(lit(str(hi)), _FRAC_ZERO))
    return alt(*out) if out else None


def _real_range(lo, lo_excl, hi, hi_excl):
    out = []
    # x >= 0 part
    if hi is None or hi > 0 or (hi == 0 and not hi_excl):
        if lo is None or lo < 0:
            part = _nonneg_real(0, False, hi, hi_excl)
        else:
            part = _nonneg_real(lo, lo_excl, hi, hi_excl)
        if part is not None:
            out.append(part)
    # x < 0 part, as -y with y > 0
    if lo is None or lo < 0:
        if hi is None or hi >= 0:
            y_lo, y_lo_excl = 0, True
        else:
            y_lo, y_lo_excl = -hi, hi_excl
        part = _nonneg_real(y_lo, y_lo_excl, None if lo is None else -lo, lo_excl)
        if part is not None:
            out.append(seq(lit("-"), part))
    return alt(*out) if out else None


def _two(lo: str, hi: str):
    return _same_len_range(lo, hi)


_DATE = seq(_same_len_range("0001", "9999"), lit("-"), alt(
    seq(alt(*(lit(m) for m in ("01", "03", "05", "07", "08", "10", "12"))), lit("-"),
        _two("01", "31")),
    seq(alt(*(lit(m) for m in ("04", "06", "09", "11"))), lit("-"), _two("01", "30")),
    seq(lit("02-"), _two("01", "28"))))
_TIME = seq(_two("00", "23"), lit(":"), _two("00", "59"), lit(":"), _two("00", "59"),
            opt(seq(lit("."), Rep(_DIGIT, 1, 9))),
            alt(lit("Z"), seq(chars([(43, 43), (45, 45)]), _two("00", "23"), lit(":"),
                              _two("00", "59"))))
_ALNUM = chars([(48, 57), (65, 90), (97, 122)])
_LABEL = seq(_ALNUM, opt(seq(Rep(chars([(45, 45), (48, 57), (65, 90), (97, 122)]), 0, 60),
                             _ALNUM)))   # 1 to 62 characters
_HOSTNAME = seq(_LABEL, Rep(seq(lit("."), _LABEL), 0, 3))   # at most 251 characters
_LOCAL = Rep(chars([(48, 57), (65, 90), (97, 122), (95, 95), (37, 37), (43, 43), (45, 45)]), 1,
             None)
_EMAIL = seq(_LOCAL, star(seq(lit("."), _LOCAL)), lit("@"), _LABEL,
             Rep(seq(lit("."), _LABEL), 1, None))
_OCTET = alt(seq(lit("25"), _r("0", "5")), seq(lit("2"), _r("0", "4"), _DIGIT),
             seq(lit("1"), _DIGIT, _DIGIT), seq(_NZ_DIGIT, _DIGIT), _DIGIT)
_IPV4 = seq(_OCTET, Rep(seq(lit("."), _OCTET), 3, 3))
_H16 = Rep(_HEX, 1, 4)
_IPV6 = seq(_H16, Rep(seq(lit(":"), _H16), 7, 7))
_UUID = seq(Rep(_HEX, 8, 8), lit("-"), Rep(_HEX, 4, 4), lit("-"), Rep(_HEX, 4, 4), lit("-"),
            Rep(_HEX, 4, 4), lit("-"), Rep(_HEX, 12, 12))
# URIs (RFC 3986), a subset: a host is a registered name (no user or port)
_SUB = [(48, 57), (65, 90), (97, 122)] + [(ord(c), ord(c)) for c in "-._~!$&'()*+,;="]
_PCT = seq(lit("%"), _HEX, _HEX)
_PCHAR_NC = alt(chars(_SUB + [(64, 64)]), _PCT)               # no ':'
_PCHAR = alt(chars(_SUB + [(58, 58), (64, 64)]), _PCT)
_SEGMENTS = star(seq(lit("/"), star(_PCHAR)))
_AUTHORITY_PATH = seq(lit("//"), star(alt(chars(_SUB), _PCT)), _SEGMENTS)
_ABSOLUTE_PATH = seq(lit("/"), opt(seq(Rep(_PCHAR, 1, None), _SEGMENTS)))
_QUERY_FRAGMENT = seq(opt(seq(lit("?"), star(alt(_PCHAR, chars([(47, 47), (63, 63)]))))),
                      opt(seq(lit("#"), star(alt(_PCHAR, chars([(47, 47), (63, 63)]))))))
_SCHEME = seq(chars([(65, 90), (97, 122)]), star(chars([(48, 57), (65, 90), (97, 122),
                                                         (43, 43), (45, 46)])))
_URI = seq(_SCHEME, lit(":"), alt(_AUTHORITY_PATH, _ABSOLUTE_PATH,
                                  opt(seq(Rep(_PCHAR, 1, None), _SEGMENTS))), _QUERY_FRAGMENT)
_URI_REF = alt(_URI, seq(alt(_AUTHORITY_PATH, _ABSOLUTE_PATH,
                             opt(seq(Rep(_PCHAR_NC, 1, None), _SEGMENTS))), _QUERY_FRAGMENT))
_FORMATS = {"date": _DATE, "time": _TIME, "date-time": seq(_DATE, lit("T"), _TIME),
            "uuid": _UUID, "email": _EMAIL, "hostname": _HOSTNAME, "ipv4": _IPV4,
            "ipv6": _IPV6, "uri": _URI, "uri-reference": _URI_REF}


# --- the converter -------------------------------------------------------------------------

def _esc(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


class _Converter:
    def __init__(self, schema, builder: GrammarBuilder | None = None, prefix: str = ""):
        self.root = schema
        self.b = builder or GrammarBuilder()
        self.prefix = prefix
        self.refs: dict[str, str] = {}   # $ref -> rule name
        self.key_class: dict[str, object] = {}   # key_not_in's classes, by excluded characters
        self.b.define("ws", Rep(chars([(9, 10), (13, 13), (32, 32)]), 0, WS_MAX))
        self.b.define("json-char", _str_char())
        self.b.define("json-string", seq(lit('"'), star(Ref("json-char")), lit('"')))
        self.b.define("json-number", seq(opt(lit("-")), alt(lit("0"), seq(_NZ_DIGIT, star(_DIGIT))),
                                         _FRAC_ANY, opt(seq(chars([(69, 69), (101, 101)]),
                                                            opt(chars([(43, 43), (45, 45)])),
                                                            Rep(_DIGIT, 1, None)))))
        self.b.define("json-integer", seq(opt(lit("-")),
                                          alt(lit("0"), seq(_NZ_DIGIT, star(_DIGIT)))))
        kv = seq(Ref("json-string"), _WS, lit(":"), _WS, Ref("json-value"))
        self.b.define("json-object", seq(lit("{"), _WS, opt(seq(kv, star(seq(
            lit(","), _WS, kv)))), lit("}")))
        item = seq(Ref("json-value"), _WS)
        self.b.define("json-array", seq(lit("["), _WS, opt(seq(item, star(seq(
            lit(","), _WS, item)))), lit("]")))
        self.b.define("json-value", alt(Ref("json-object"), Ref("json-array"),
                                        Ref("json-string"), Ref("json-number"), lit("true"),
                                        lit("false"), lit("null")))

    def build(self) -> Grammar:
        body = self.gen(self.root, "")
        self.b.define("root", seq(_WS, body, _WS))
        return self.b.build("root")

    # value grammars do not include surrounding whitespace

    def gen(self, s, path: str):
        if s is True or s == {}:
            return Ref("json-value")
        if s is False:
            raise _Unsatisfiable("false (a schema that matches nothing)", path)
        if not isinstance(s, dict):
            raise UnsupportedSchema(f"a schema of type {type(s).__name__}", path)
        if "$ref" in s:
            target = self.ref(s["$ref"], path + "/$ref")
            rest = {k: v for k, v in s.items() if k in _VALIDATION and k != "$ref"}
            if not rest:
                return target
            return self.gen({"allOf": [{"$ref": s["$ref"]}, rest]}, path)
        if "multipleOf" in s and s["multipleOf"] == 1 and s.get("type") in ("integer", "number"):
            s = {**{k: v for k, v in s.items() if k != "multipleOf"}, "type": "integer"}
        for k in _UNSUPPORTED_KEYWORDS:
            if k in s:
                if k in ("maxProperties", "dependencies", "dependentRequired"):
                    continue   # object() (vacuous for other types)
                if (k == "not" and _is_not_required(s["not"])
                        and s.get("type", _infer_type(s)) == "object"):
                    continue   # handled by object()
                if k == "propertyNames" and set(s[k]) <= {"pattern"}:
                    continue
                raise UnsupportedSchema(k, f"{path}/{k}")
        if s.get("nullable") is True:
            inner = {k: v for k, v in s.items() if k != "nullable"}
            return alt(self.gen(inner, path), lit("null"))
        if "allOf" in s:
            return self.gen(self.merge_all(s, path), path)
        for key in ("anyOf", "oneOf"):
            if key in s:
                branches = s[key]
                if not isinstance(branches, list) or not branches:
                    raise UnsupportedSchema(f"{key} that is not a non-empty list", path)
                rest = {k: v for k, v in s.items() if k != key}
                if key == "oneOf" and not self.disjoint(branches, path):
                    # exactly one: enforced when the branches only require properties
                    sets = [self.deref(b, path) for b in branches]
                    if not all(isinstance(b, dict) and not set(b) & _VALIDATION - {"required"}
                               and isinstance(b.get("required"), list) for b in sets):
                        raise UnsupportedSchema("oneOf (branches that may overlap)",
                                                path + "/oneOf")
                    t = rest.get("type", "object")
                    if t != "object" and "object" not in (t if isinstance(t, list) else []):
                        raise _Unsatisfiable("oneOf of required properties on a non-object",
                                             path)
                    groups = [*rest.get("_one_of_required", []),
                              [frozenset(b["required"]) for b in sets]]
                    return self.gen({**rest, "type": "object", "_one_of_required": groups},
                                    path)
                out = []
                for i, br in enumerate(branches):
                    try:
                        if _has_validation(rest):
                            out.append(self.gen({"allOf": [rest, br]}, f"{path}/{key}/{i}"))
                        else:
                            out.append(self.gen(br, f"{path}/{key}/{i}"))
                    except _Unsatisfiable:
                        continue
                if not out:
                    raise _Unsatisfiable(f"{key} with no branch that can be met", path)
                return alt(*out)
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            if not isinstance(values, list) or not values:
                raise UnsupportedSchema("enum that is not a non-empty list", path + "/enum")
            if "const" in s and "enum" in s:
                values = [v for v in values if _same_json(v, s["enum"])]
            types = s.get("type")
            if types is not None:
                tl = types if isinstance(types, list) else [types]
                values = [v for v in values if any(_is_type(v, t) for t in tl)]
            rest = {k: v for k, v in s.items() if k in _VALIDATION and k not in ("enum", "const")}
            if set(rest) - {"type"} and values:
                # other keywords: keep the values their grammar accepts
                sub = _Converter(self.root)
                try:
                    sub.b.define("root", sub.gen(rest, path))
                    g = sub.b.build("root")
                    values = [v for v in values if accepts(g, self.literal(v).data)]
                except _Unsatisfiable:
                    values = []
            if not values:
                raise _Unsatisfiable("enum with no value that fits the other keywords", path)
            return alt(*(self.literal(v) for v in values))
        t = s.get("type")
        if t is None:
            t = _infer_type(s)
        if isinstance(t, list):
            if not t:
                raise UnsupportedSchema("an empty type list", path + "/type")
            return alt(*(self.typed(s, x, path) for x in dict.fromkeys(t)))
        if t is None:
            return Ref("json-value")
        return self.typed(s, t, path)

    def disjoint(self, branches, path) -> bool:
        """Whether no value can meet two of the branches (so oneOf is anyOf), as far as a
        simple look can prove it: different types, an enum none of whose values meets the
        other branch, or objects told apart by a required property."""
        bs = [self.deref(b, path) for b in branches]
        return all(self.apart(a, b, 0) for i, a in enumerate(bs) for b in bs[:i])

    def apart(self, a, b, depth: int) -> bool:
        if a is False or b is False:
            return True
        if not isinstance(a, dict) or not isinstance(b, dict) or depth > 8:
            return False
        a, b = self.deref(a, ""), self.deref(b, "")
        if not _types(a) & _types(b):
            return True
        for x, y in ((a, b), (b, a)):
            values = [x["const"]] if "const" in x else x.get("enum", _pattern_values(x))
            if isinstance(values, list) and all(_fails(y, v) for v in values):
                return True
        for x, y in ((a, b), (b, a)):
            if not {"object"} >= _types(x) & _types(y):
                continue
            req_x = set(x.get("required") or [])
            req_y = set(y.get("required") or [])
            px, py = x.get("properties") or {}, y.get("properties") or {}
            for k in req_x:
                if k in req_y and k in px and k in py and self.apart(px[k], py[k], depth + 1):
                    return True
                if (y.get("additionalProperties") is False and k not in py
                        and not y.get("patternProperties")):
                    return True
            if _is_not_required(y.get("not")) and set(y["not"]["required"]) <= req_x:
                return True
        return False

    def literal(self, value):
        return lit(json.dumps(value, ensure_ascii=False, separators=(",", ":")))

    def ref(self, ref: str, path: str):
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise UnsupportedSchema(f"$ref to another document ({ref!r})", path)
        name = self.refs.get(ref)
        if name is None:
            name = f"{self.prefix}ref-{len(self.refs)}"
            self.refs[ref] = name
            target = self.resolve(ref, path)
            self.b.define(name, self.gen(target, ref[1:] or "/"))
        return Ref(name)

    def resolve(self, ref: str, path: str):
        node = self.root
        pointer = ref[1:]
        if pointer and not pointer.startswith("/"):
            raise UnsupportedSchema(f"$ref by anchor ({ref!r})", path)
        for part in pointer.split("/")[1:] if pointer else []:
            part = part.replace("~1", "/").replace("~0", "~")
            from urllib.parse import unquote
            part = unquote(part)
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise UnsupportedSchema(f"$ref to a missing target ({ref!r})", path)
        return node

    def deref(self, s, path):
        seen = 0
        while isinstance(s, dict) and "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            target = self.resolve(s["$ref"], path)
            if _has_validation(rest):
                if target is True:
                    target = {}
                if not isinstance(target, dict):
                    raise UnsupportedSchema("$ref with other keywords", path)
                s = self.merge(target, rest, path)
            else:
                s = target
            seen += 1
            if seen > 50:
                raise UnsupportedSchema("a $ref cycle", path)
        return s

    def merge_all(self, s, path):
        parts = s["allOf"]
        if not isinstance(parts, list):
            raise UnsupportedSchema("allOf that is not a list", path + "/allOf")
        out = {k: v for k, v in s.items() if k != "allOf"}
        for i, p in enumerate(parts):
            p = self.deref(p, f"{path}/allOf/{i}")
            if p is True or p == {}:
                continue
            if p is False:
                raise UnsupportedSchema("false (a schema that matches nothing)", path)
            if "allOf" in p:
                p = self.merge_all(p, f"{path}/allOf/{i}")
            out = self.merge(out, p, f"{path}/allOf/{i}")
        return out

    def merge(self, a: dict, b: dict, path: str) -> dict:
        out = dict(a)
        for k, v in b.items():
            if k not in out or k not in _VALIDATION:
                out[k] = v
                continue
            w = out[k]
            if w == v:
                continue
            if k == "properties":
                props = dict(w)
                for name, sub in v.items():
                    props[name] = ({"allOf": [props[name], sub]} if name in props else sub)
                out[k] = props
            elif k == "required":
                out[k] = list(dict.fromkeys(list(w) + list(v)))
            elif k == "type":
                wl = w if isinstance(w, list) else [w]
                vl = v if isinstance(v, list) else [v]
                both = [x for x in wl if x in vl or (x == "integer" and "number" in vl)]
                both += [x for x in vl if x == "integer" and "number" in wl and x not in both]
                if not both:
                    raise UnsupportedSchema("allOf with types that exclude each other", path)
                out[k] = both if len(both) > 1 else both[0]
            elif k in ("minLength", "minItems", "minimum", "exclusiveMinimum", "minProperties"):
                out[k] = max(w, v) if not isinstance(w, bool) else v
            elif k in ("maxLength", "maxItems", "maximum", "exclusiveMaximum"):
                out[k] = min(w, v) if not isinstance(w, bool) else v
            elif k == "additionalProperties" and (w is False or v is False):
                out[k] = False
            elif k in ("anyOf", "oneOf"):
                out["allOf"] = [{k: w}, {k: v}]
                out.pop(k)
                return self.merge_all(out, path)
            else:
                raise UnsupportedSchema(f"allOf with two different {k!r}", path)
        return out

    def typed(self, s: dict, t: str, path: str):
        if t == "string":
            return self.string(s, path)
        if t == "integer":
            return self.number(s, path, integer=True)
        if t == "number":
            return self.number(s, path, integer=False)
        if t == "boolean":
            return alt(lit("true"), lit("false"))
        if t == "null":
            return lit("null")
        if t == "object":
            return self.object(s, path)
        if t == "array":
            return self.array(s, path)
        raise UnsupportedSchema(f"type {t!r}", path + "/type")

    def string(self, s, path):
        lo = s.get("minLength", 0)
        hi = s.get("maxLength")
        fmt = s.get("format")
        pattern = s.get("pattern")
        if fmt in _UNSUPPORTED_FORMATS:
            raise UnsupportedSchema(f"format {fmt!r}", path + "/format")
        if hi is not None and hi < lo:
            raise _Unsatisfiable("maxLength below minLength", path)
        if fmt in _FORMATS and pattern is None:
            body = _FORMATS[fmt]
            if lo or hi is not None:
                n_lo, n_hi = _length_range(body)
                if n_lo < lo or hi is not None and (n_hi is None or n_hi > hi):
                    raise UnsupportedSchema(f"format {fmt!r} together with minLength/maxLength",
                                            path)
            return seq(lit('"'), body, lit('"'))
        if pattern is not None:
            if fmt in _FORMATS:   # both cannot be enforced at once
                raise UnsupportedSchema(f"format {fmt!r} together with pattern", path + "/format")
            body = self.pattern(pattern, path + "/pattern")
            if lo or hi is not None:
                body = _fit_length(body, lo, hi)
                n_lo, n_hi = _length_range(body)
                if n_lo < lo or hi is not None and (n_hi is None or n_hi > hi):
                    raise UnsupportedSchema("pattern together with minLength/maxLength that "
                                            "the pattern does not imply", path)
            return seq(lit('"'), body, lit('"'))
        if hi is not None:
            hi = min(hi, lo + MAX_REPEAT)
        if not lo and hi is None:
            return Ref("json-string")
        return seq(lit('"'), Rep(Ref("json-char"), lo, hi), lit('"'))

    def pattern(self, pattern: str, path: str):
        try:
            re.compile(pattern)
            branches = parse_regex(pattern)
            out = []
            any_text = star(Ref("json-char"))
            for expr, start, end in branches:
                body = _jsonify(expr)
                out.append(seq(*([] if start else [any_text]), body,
                               *([] if end else [any_text])))
            return alt(*out)
        except (RegexUnsupported, re.error) as e:
            raise UnsupportedSchema(f"pattern {pattern!r} ({e})", path) from None

    def number(self, s, path, integer: bool):
        lo, lo_excl = s.get("minimum"), False
        hi, hi_excl = s.get("maximum"), False
        emin, emax = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
        if isinstance(emin, bool):   # draft 4: a flag on minimum
            lo_excl = emin and lo is not None
        elif emin is not None and (lo is None or emin >= lo):
            lo, lo_excl = emin, True
        if isinstance(emax, bool):
            hi_excl = emax and hi is not None
        elif emax is not None and (hi is None or emax <= hi):
            hi, hi_excl = emax, True
        for v, k in ((lo, "minimum"), (hi, "maximum")):
            if v is not None and not isinstance(v, (int, float)) or isinstance(v, bool):
                raise UnsupportedSchema(f"{k} that is not a number", path)
        if lo is None and hi is None:
            return Ref("json-integer" if integer else "json-number")
        if integer:
            ilo = None if lo is None else (math.floor(lo) + 1 if lo_excl else math.ceil(lo))
            ihi = None if hi is None else (math.ceil(hi) - 1 if hi_excl else math.floor(hi))
            r = _int_range(ilo, ihi)
            if r is None:
                raise _Unsatisfiable("integer bounds that admit no value", path)
            return r
        # fractional bounds are narrowed inward to integers: every answer stays valid
        if lo is not None and not float(lo).is_integer():
            lo, lo_excl = math.ceil(lo), False
        if hi is not None and not float(hi).is_integer():
            hi, hi_excl = math.floor(hi), False
        r = _real_range(None if lo is None else int(lo), lo_excl,
                        None if hi is None else int(hi), hi_excl)
        if r is None:
            raise _Unsatisfiable("number bounds that admit no value", path)
        return r

    def object(self, s, path):
        """Declared properties in declaration order, then any extra keys. The counts and
        presence rules (minProperties, maxProperties, dependencies, not-required) are tracked
        exactly: a rule per (position, properties so far, relevant properties present)."""
        props = s.get("properties") or {}
        if not isinstance(props, dict):
            raise UnsupportedSchema("properties that is not an object", path + "/properties")
        required = list(s.get("required") or [])
        if isinstance(s.get("required"), bool):
            required = []
        addl = s.get("additionalProperties")
        pattern_props = s.get("patternProperties") or {}
        if addl is None and not props and not pattern_props:
            addl = True
        min_props = s.get("minProperties", 0)
        max_props = s.get("maxProperties")
        for k, v in (("minProperties", min_props), ("maxProperties", max_props)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise UnsupportedSchema(f"{k} that is not a count", f"{path}/{k}")
        deps: dict[str, list[str]] = {}
        for key in ("dependencies", "dependentRequired"):
            for name, dep in (s.get(key) or {}).items():
                if isinstance(dep, dict) and set(dep) <= {"required"}:
                    dep = dep.get("required", [])
                if not isinstance(dep, list):
                    raise UnsupportedSchema(f"{key} with a schema", f"{path}/{key}/{_esc(name)}")
                deps.setdefault(name, []).extend(d for d in dep if d != name)
        not_sets = [frozenset(s["not"]["required"])] if "not" in s else []
        one_of = s.get("_one_of_required", [])   # oneOf of required sets: exactly one holds
        names = list(props)
        for k in [*required, *deps, *(d for ds in deps.values() for d in ds),
                  *(k for group in one_of for ns in group for k in ns)]:
            if k not in names:
                names.append(k)
        excluded = set()
        name_pattern = (s.get("propertyNames") or {}).get("pattern")
        if name_pattern is not None:
            try:
                rx = re.compile(name_pattern)
            except re.error as e:
                raise UnsupportedSchema(f"propertyNames pattern ({e})", path) from None
            excluded |= {k for k in names if not rx.search(k)}
        compiled_patterns = []
        for pat, sub in pattern_props.items():
            try:
                compiled_patterns.append((re.compile(pat), sub))
            except re.error as e:
                raise UnsupportedSchema(f"patternProperties pattern ({e})", path) from None

        def schema_of(k, declared):
            """A property's schema: its own and those of the patterns its name matches."""
            parts = [] if declared is None else [declared]
            parts += [sub for rx, sub in compiled_patterns if rx.search(k)]
            if declared is None and not parts:
                if addl is False:
                    return False
                parts = [addl if addl not in (None, True) else True]
            return parts[0] if len(parts) == 1 else {"allOf": parts}

        req = set(required)
        if excluded & req:
            raise _Unsatisfiable("a required property that is not allowed", path)
        items = []   # (name, key: value expression, required)
        for k in names:
            if k in excluded:
                continue
            try:
                sub = self.gen(schema_of(k, props.get(k)), f"{path}/properties/{_esc(k)}")
            except _Unsatisfiable:
                if k in req:
                    raise
                continue   # an optional property no value fits is left out
            items.append((k, seq(self.literal(k), _WS, lit(":"), _WS, sub), k in req))
        # extra keys: never one of the names above (a repeated key would be checked against
        # the wrong schema), so they are written without escapes
        known = set(names) | {k for ns in not_sets for k in ns}
        extra = []
        if name_pattern is not None:
            any_key = seq(lit('"'), self.pattern(name_pattern, path + "/propertyNames"), lit('"'))
            if any(rx.search(k) for k in known):
                any_key = None   # it could repeat a known name: no extra keys (narrower)
        else:
            any_key = self.key_not_in(known)
        for (prx, sub), pat in zip(compiled_patterns, pattern_props):
            if any(prx.search(k) for k in known):
                continue   # could repeat a known name: these keys are left out (narrower)
            if name_pattern is None:
                key = seq(lit('"'), self.pattern(pat, f"{path}/patternProperties/{_esc(pat)}"),
                          lit('"'))
            elif pat in ("", ".*", "^.*$", ".+", "^.+$") or pat == name_pattern:
                key = any_key
            else:
                raise UnsupportedSchema("propertyNames with patternProperties",
                                        path + "/propertyNames")
            if key is None:
                continue
            try:
                val = self.gen(sub, f"{path}/patternProperties/{_esc(pat)}")
            except _Unsatisfiable:
                continue   # no value fits: no such key
            extra.append(seq(key, _WS, lit(":"), _WS, val))
        if addl not in (None, False) and not pattern_props and any_key is not None:
            # (with patternProperties, extra keys are only those the patterns allow)
            try:
                val = self.gen(addl if addl is not True else True, path + "/additionalProperties")
                extra.append(seq(any_key, _WS, lit(":"), _WS, val))
            except _Unsatisfiable:
                pass
        extra_kv = self.share(alt(*extra)) if extra else None
        sep = seq(lit(","), _WS)
        present = {k for k, _, _ in items}
        relevant = ({k for k in deps if k in present}
                    | {d for k in deps if k in present for d in deps[k]}
                    | {k for ns in not_sets for k in ns}
                    | {k for group in one_of for ns in group for k in ns}) & present
        cap = max(min_props, max_props + 1 if max_props is not None else 0, 1)
        memo: dict = {}

        def tail(c, seen):
            """Extra keys after the declared ones, c properties so far."""
            if any(not set(deps[k]) <= seen for k in seen if k in deps):
                return None
            if any(ns <= seen for ns in not_sets):
                return None
            if any(sum(ns <= seen for ns in group) != 1 for group in one_of):
                return None
            lo = max(min_props - c, 0)
            hi = None if max_props is None else max_props - c
            if extra_kv is None or hi == 0:
                return EMPTY if lo == 0 else None
            if lo > 1:
                return None   # repeated extra keys would count twice: not attempted
            item = seq(extra_kv, _WS)
            if c:
                return Rep(seq(sep, item), lo, hi)
            more = Rep(seq(sep, item), 0, None if hi is None else hi - 1)
            return seq(item, more) if lo else opt(seq(item, more))

        def rest(i, c, seen):
            key = (i, c, seen)
            if key in memo:
                return memo[key]
            if len(memo) > 5000:
                raise UnsupportedSchema("too many combinations of minProperties, "
                                        "maxProperties, dependencies and not", path)
            if i == len(items):
                out = tail(c, seen)
            else:
                k, kv, is_req = items[i]
                opts = []
                if max_props is None or c < max_props:
                    after = rest(i + 1, min(c + 1, cap), seen | {k} if k in relevant else seen)
                    if after is not None:
                        opts.append(seq(*([sep] if c else []), kv, _WS, after))
                if not is_req:
                    after = rest(i + 1, c, seen)
                    if after is not None:
                        opts.append(after)
                out = self.share(alt(*opts)) if opts else None
            memo[key] = out
            return out

        body = rest(0, 0, frozenset())
        if body is None:
            for k in ("minProperties", "maxProperties", "dependencies", "dependentRequired",
                      "not", "oneOf"):
                if k in s:
                    raise UnsupportedSchema(k, f"{path}/{k}")
            raise _Unsatisfiable("an object no properties fit", path)
        return seq(lit("{"), _WS, body, lit("}"))

    def key_not_in(self, known):
        """A JSON string key, written without escapes, that is none of `known`."""
        special = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
        if not known:
            return Ref("json-string")
        trie: dict = {}
        for k in known:
            node = trie
            for ch in k:
                node = node.setdefault(ch, {})
            node[None] = {}

        if "key-char" not in self.b.exprs:
            self.b.define("key-char", chars(special, negate=True))
            self.b.define("key-non-ascii", chars([(0x80, 0x10FFFF)]))
        free = star(Ref("key-char"))

        def walk(node):
            out = [] if None in node else [EMPTY]
            kids = [ch for ch in node if ch is not None]
            for ch in kids:
                if ord(ch) > 0x1F and ch not in '"\\':
                    out.append(seq(lit(ch), walk(node[ch])))
            taken = "".join(sorted(kids))
            other = self.key_class.get(taken)   # the characters that leave every name
            if other is None:
                cut = [(ord(ch), ord(ch)) for ch in taken]
                if any(ord(ch) >= 0x80 for ch in kids):   # (rare: one big class)
                    cls = chars(special + cut, negate=True)
                else:
                    cls = alt(chars(special + cut + [(0x80, 0x10FFFF)], negate=True),
                              Ref("key-non-ascii"))
                other = self.key_class[taken] = self.share(seq(cls, free))
            out.append(other)
            return self.share(alt(*out))

        name = self.b.fresh("key")
        self.b.define(name, seq(lit('"'), walk(trie), lit('"')))
        return Ref(name)

    def enum_values(self, items):
        """The values of an items schema that is a plain enum (or const), else None."""
        if not isinstance(items, dict):
            return None
        items = self.deref(items, "")
        if not isinstance(items, dict) or not set(items) <= {"enum", "const", "type",
                                                            "description", "title"}:
            return None
        values = [items["const"]] if "const" in items else items.get("enum")
        if not isinstance(values, list):
            return None
        t = items.get("type")
        if t is not None:
            tl = t if isinstance(t, list) else [t]
            values = [v for v in values if any(_is_type(v, x) for x in tl)]
        uniq = []
        for v in values:
            if not any(json.dumps(v, sort_keys=True) == json.dumps(u, sort_keys=True)
                       for u in uniq):
                uniq.append(v)
        return uniq

    def unique_enum_array(self, values, lo, hi, path):
        n = len(values)
        hi = n if hi is None else min(hi, n)
        if lo > hi:
            raise _Unsatisfiable("uniqueItems with more items than values", path)
        sep = seq(lit(","), _WS)
        # chain[i][c]: values i.. given c chosen so far
        memo = {}

        def rest(i, c):
            if (i, c) in memo:
                return memo[(i, c)]
            opts = []
            if c >= lo:
                opts.append(EMPTY)
            if i < n and c < hi and n - i + c >= lo:
                item = seq(*([sep] if c else []), self.literal(values[i]), _WS)
                opts.append(seq(item, rest(i + 1, c + 1)))
                if n - i - 1 + c >= lo:
                    opts.append(rest(i + 1, c))
            out = self.share(alt(*opts)) if opts else None
            memo[(i, c)] = out
            return out

        body = rest(0, 0)
        if body is None:
            raise _Unsatisfiable("uniqueItems with more items than values", path)
        return seq(lit("["), _WS, body, lit("]"))

    def share(self, expr):
        """Names a sizable expression so later uses refer to it instead of copying it."""
        if isinstance(expr, (Ref, Lit, Chars)) or expr == EMPTY:
            return expr
        name = self.b.fresh("obj")
        self.b.define(name, expr)
        return Ref(name)

    def array(self, s, path):
        items = s.get("items")
        prefix = s.get("prefixItems")
        rest = items
        if isinstance(items, list):   # draft 4-7 tuple form
            prefix, rest = items, s.get("additionalItems", True)
        elif prefix is None:
            prefix = []
        if rest is None:
            rest = True
        lo = s.get("minItems", 0)
        hi = s.get("maxItems")
        if s.get("uniqueItems") is True and (hi is None or hi > 1):
            # Distinct items cannot be checked by a grammar in general; distinct values of an
            # enum can (the values in enum order).
            values = self.enum_values(rest) if not prefix else None
            if values is None:
                raise UnsupportedSchema("uniqueItems (on items that are not an enum)",
                                        path + "/uniqueItems")
            return self.unique_enum_array(values, lo, hi, path)
        if hi is not None and hi < lo:
            raise _Unsatisfiable("maxItems below minItems", path)
        if hi is not None:
            hi = min(hi, max(lo, len(prefix)) + MAX_REPEAT)
        if hi is not None:
            prefix = prefix[:hi]
        elems = [self.gen(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
        if rest is False:
            if lo > len(prefix):
                raise UnsupportedSchema("minItems above the number of items allowed", path)
            rest_g = None
        else:
            rest_g = self.gen(rest, path + "/items")
        sep = seq(lit(","), _WS)
        k = len(elems)
        # the items from index k on
        if rest_g is None or (hi is not None and hi <= k):
            tail = EMPTY
        else:
            elem = seq(rest_g, _WS)
            n_max = None if hi is None else hi - k
            n_min = max(lo - k, 0)
            if k == 0:
                tail = seq(elem, Rep(seq(sep, elem), max(n_min - 1, 0), None if n_max is None
                                     else n_max - 1))
                if n_min == 0:
                    tail = opt(tail)
            else:
                tail = Rep(seq(sep, elem), n_min, n_max)
        for j in range(k - 1, -1, -1):
            part = seq(*([] if j == 0 else [sep]), elems[j], _WS, tail)
            tail = part if j < lo else opt(part)
        return seq(lit("["), _WS, tail, lit("]"))


_VALIDATION = {"type", "properties", "required", "additionalProperties", "patternProperties",
               "enum", "const", "items", "prefixItems", "additionalItems", "minItems",
               "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format",
               "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "oneOf",
               "allOf", "$ref", "nullable", "minProperties", *_UNSUPPORTED_KEYWORDS}


def _types(s: dict) -> set:
    """The JSON types a schema's values can have (integer counted as number too)."""
    out = set(_TYPES)
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if isinstance(values, list):
            out &= {t for v in values for t in _TYPES if _is_type(v, t)}
    t = s.get("type") or _infer_type(s)
    if t is not None:
        tl = set(t if isinstance(t, list) else [t])
        if tl & {"number", "integer"}:
            tl |= {"number", "integer"}
        out &= tl
    return out


def _finite_strings(expr, limit: int = 64):
    """The strings a regex expression matches, if few (else None)."""
    if isinstance(expr, Chars):
        n = sum(hi - lo + 1 for lo, hi in expr.ranges)
        return [chr(c) for lo, hi in expr.ranges for c in range(lo, hi + 1)] if n <= limit else None
    if isinstance(expr, Lit):
        return [expr.data.decode("utf-8")]
    if isinstance(expr, Seq):
        out = [""]
        for e in expr.items:
            part = _finite_strings(e, limit)
            if part is None or len(out) * len(part) > limit:
                return None
            out = [a + b for a in out for b in part]
        return out
    if isinstance(expr, Alt):
        out = []
        for e in expr.items:
            part = _finite_strings(e, limit)
            if part is None or len(out) + len(part) > limit:
                return None
            out += part
        return out
    if isinstance(expr, Rep) and expr.max is not None and expr.max <= 8:
        return _finite_strings(alt(*(Seq((expr.item,) * n) for n in range(expr.min,
                                                                          expr.max + 1))), limit)
    return None


def _pattern_values(s: dict):
    """A string schema whose pattern matches few strings, as those strings (else None)."""
    if not isinstance(s.get("pattern"), str) or "string" not in _types(s):
        return None
    try:
        out = []
        for expr, start, end in parse_regex(s["pattern"]):
            part = _finite_strings(expr) if start and end else None
            if part is None:
                return None
            out += part
        return out
    except (RegexUnsupported, re.error):
        return None


def _fails(s: dict, v) -> bool:
    """Whether the value is surely invalid under s (False when unsure)."""
    if not any(_is_type(v, t) for t in _types(s)):
        return True
    if ("const" in s or isinstance(s.get("enum"), list)) and not _same_json(
            v, [s["const"]] if "const" in s else s["enum"]):
        return True
    if isinstance(v, str):
        if isinstance(s.get("pattern"), str):
            try:
                if not re.search(s["pattern"], v):
                    return True
            except re.error:
                pass
        if isinstance(s.get("minLength"), int) and len(v) < s["minLength"]:
            return True
        if isinstance(s.get("maxLength"), int) and len(v) > s["maxLength"]:
            return True
    return False


def _same_json(v, values) -> bool:
    """Whether v is among values by JSON equality."""
    key = json.dumps(v, sort_keys=True)
    return any(json.dumps(u, sort_keys=True) == key for u in values)


def _is_not_required(x) -> bool:
    return (isinstance(x, dict) and set(x) == {"required"} and isinstance(x["required"], list)
            and bool(x["required"]))


def _map_reps(expr, f):
    if isinstance(expr, Rep):
        return f(Rep(_map_reps(expr.item, f), expr.min, expr.max))
    if isinstance(expr, Seq):
        return Seq(tuple(_map_reps(e, f) for e in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(_map_reps(e, f) for e in expr.items))
    return expr


def _fit_length(expr, lo: int, hi: int | None):
    """Narrows a pattern's expression so that its matches have lo..hi characters: the first
    unbounded repetition takes more items to reach lo, unbounded ones get a cap to stay within
    hi. Returns the expression unchanged if it cannot (the caller checks)."""
    n_lo, n_hi = _length_range(expr)
    if n_lo < lo:
        done = [False]

        def bump(r):
            a, _ = _length_range(r.item)
            if done[0] or r.max is not None or a == 0:
                return r
            done[0] = True
            return Rep(r.item, r.min + -(-(lo - n_lo) // a), None)
        expr = _map_reps(expr, bump)
        n_lo, n_hi = _length_range(expr)
    if hi is not None and n_hi is None:
        unbounded = []
        _map_reps(expr, lambda r: (unbounded.append(r) if r.max is None else None) or r)
        widths = [_length_range(r.item)[1] for r in unbounded]
        if None in widths or not unbounded or n_lo > hi:
            return expr
        room = (hi - n_lo) // len(unbounded)

        def cap(r):
            if r.max is not None:
                return r
            w = _length_range(r.item)[1]
            return Rep(r.item, r.min, r.min + room // max(w, 1))
        expr = _map_reps(expr, cap)
    return expr


def _length_range(expr) -> tuple[int, int | None]:
    """The fewest and most characters of string content that `expr` matches (an escape counts
    as one character)."""
    if isinstance(expr, Chars):
        return 1, 1
    if isinstance(expr, Lit):
        text = expr.data.decode("utf-8")
        return (1, 1) if text.startswith("\\") else (len(text), len(text))
    if isinstance(expr, Ref):
        return (1, 1) if expr.name == "json-char" else (0, None)
    if isinstance(expr, Seq):
        lo, hi = 0, 0
        for e in expr.items:
            a, b = _length_range(e)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if isinstance(expr, Alt):
        rs = [_length_range(e) for e in expr.items]
        his = [b for _, b in rs]
        return min(a for a, _ in rs), None if None in his else max(his)
    if isinstance(expr, Rep):
        a, b = _length_range(expr.item)
        return a * expr.min, None if expr.max is None or b is None else b * expr.max
    return 0, None


def _has_validation(s: dict) -> bool:
    return any(k in _VALIDATION for k in s)


def _infer_type(s: dict):
    if any(k in s for k in ("properties", "additionalProperties", "required",
                            "patternProperties", "minProperties", "maxProperties",
                            "dependencies", "dependentRequired", "propertyNames")):
        return "object"
    if any(k in s for k in ("items", "prefixItems", "minItems", "maxItems")):
        return "array"
    if any(k in s for k in ("minLength", "maxLength", "pattern")):
        return "string"
    if s.get("format") in _FORMATS:
        return "string"
    if any(k in s for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        return "number"
    return None


def _is_type(v, t: str) -> bool:
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
