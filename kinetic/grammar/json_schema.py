"""JSON Schema to the grammar IR.

`compile_json_schema(schema)` returns a Grammar whose sentences are JSON texts valid under the
schema. The grammar may be narrower than the schema (a fixed key order: properties in the order
the schema declares them, then any additional ones; canonical spellings for pattern strings;
no exponents in bounded numbers; keys outside `properties` are not allowed unless
`additionalProperties` or `patternProperties` says so), never wider: a keyword it cannot enforce
raises UnsupportedSchema naming it and where it is, rather than being ignored. Annotations
(title, description, default, examples, ...) and unknown keywords are ignored, as JSON Schema
itself ignores them. `{"type": "json_object"}` in the API is `compile_json_schema(True)`: any
JSON value.

Supported: type (one or a list), properties, required, additionalProperties, patternProperties,
enum, const, items / prefixItems (and draft-4 tuple items with additionalItems), minItems,
maxItems, minLength, maxLength, pattern, format (date, time, date-time, uuid, email, hostname,
ipv4, ipv6, uri, uri-reference; non-standard formats are annotations), minimum, maximum,
exclusiveMinimum, exclusiveMaximum (integer bounds for numbers), anyOf, oneOf (as anyOf),
allOf (merged), $ref into the same document (#/$defs/..., #/definitions/..., any JSON pointer,
recursion included), nullable.

Narrowings (sound: every answer still validates): key order fixed; maxLength/maxItems above
MAX_REPEAT capped; fractional number bounds rounded inward to integers; dependencies and
minProperties met by requiring more properties; `not: {required: [a, ...]}` by leaving a out;
uniqueItems as enum values in enum order, otherwise at most one item; a pattern with lengths
narrowed to fit them; with a pattern, format is left as an annotation; oneOf is treated as
anyOf (exclusivity not checked).
"""

from __future__ import annotations

import json
import math
import re

from kinetic.grammar.ir import (EMPTY, Alt, Chars, Grammar, GrammarBuilder, Lit, Rep, Ref, Seq,
                                alt, chars, lit, opt, seq, star)
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


_DATE = seq(_digits(4), lit("-"), alt(
    seq(alt(*(lit(m) for m in ("01", "03", "05", "07", "08", "10", "12"))), lit("-"),
        _two("01", "31")),
    seq(alt(*(lit(m) for m in ("04", "06", "09", "11"))), lit("-"), _two("01", "30")),
    seq(lit("02-"), _two("01", "28"))))
_TIME = seq(_two("00", "23"), lit(":"), _two("00", "59"), lit(":"), _two("00", "59"),
            opt(seq(lit("."), Rep(_DIGIT, 1, 9))),
            alt(lit("Z"), seq(chars([(43, 43), (45, 45)]), _two("00", "23"), lit(":"),
                              _two("00", "59"))))
_ALNUM = chars([(48, 57), (65, 90), (97, 122)])
_LABEL = seq(Rep(_ALNUM, 1, None), star(seq(lit("-"), Rep(_ALNUM, 1, None))))
_HOSTNAME = seq(_LABEL, star(seq(lit("."), _LABEL)))
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
# URI characters (RFC 3986 unreserved, reserved and percent-encodings), '/' written as is
_URI_CHAR = alt(chars([(48, 57), (65, 90), (97, 122)] + [(ord(c), ord(c)) for c in
                                                          "-._~:/?#[]@!$&'()*+,;="]),
                seq(lit("%"), _HEX, _HEX))
_SCHEME = seq(chars([(65, 90), (97, 122)]), star(chars([(48, 57), (65, 90), (97, 122),
                                                         (43, 43), (45, 46)])))
_URI = seq(_SCHEME, lit(":"), star(_URI_CHAR))
_URI_REF = star(_URI_CHAR)
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
        if "dependencies" in s or "dependentRequired" in s:
            s = self.dependencies(s, path)
        for k in _UNSUPPORTED_KEYWORDS:
            if k in s:
                if k == "maxProperties" and self.max_properties_ok(s):
                    continue
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
                out = []
                for i, br in enumerate(branches):
                    if _has_validation(rest):
                        out.append(self.gen({"allOf": [rest, br]}, f"{path}/{key}/{i}"))
                    else:
                        out.append(self.gen(br, f"{path}/{key}/{i}"))
                return alt(*out)
        if "const" in s:
            return self.literal(s["const"])
        if "enum" in s:
            values = s["enum"]
            if not isinstance(values, list) or not values:
                raise UnsupportedSchema("enum that is not a non-empty list", path + "/enum")
            types = s.get("type")
            if types is not None:
                tl = types if isinstance(types, list) else [types]
                values = [v for v in values if any(_is_type(v, t) for t in tl)]
                if not values:
                    raise _Unsatisfiable("enum with no value of the given type", path)
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

    def dependencies(self, s, path):
        """Property dependencies ("if a is present, b must be too") are enforced by requiring
        the dependent properties always, a narrowing that keeps every answer valid."""
        out = {k: v for k, v in s.items() if k not in ("dependencies", "dependentRequired")}
        req = list(out.get("required") or [])
        for key in ("dependencies", "dependentRequired"):
            for name, dep in (s.get(key) or {}).items():
                if isinstance(dep, dict) and set(dep) <= {"required"}:
                    dep = dep.get("required", [])
                if not isinstance(dep, list):
                    raise UnsupportedSchema(f"{key} with a schema", f"{path}/{key}/{_esc(name)}")
                req.extend(d for d in dep if d not in req)
        out["required"] = req
        return out

    def max_properties_ok(self, s) -> bool:
        """maxProperties holds by construction when the object cannot have more keys."""
        if s.get("type") not in (None, "object"):
            return True
        extras = s.get("additionalProperties") not in (None, False) or s.get("patternProperties")
        names = set(s.get("properties") or {}) | set(s.get("required") or [])
        return not extras and bool(names) and len(names) <= s["maxProperties"]

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
            # with a pattern, format is left as the annotation JSON Schema makes it by default
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
        items = [(k, v) for k, v in props.items()]
        names = set(props)
        excluded = set()
        if "not" in s:   # not: {required: [a, b]}: leave out a, so they are never all there
            excluded.add(s["not"]["required"][0])
        name_pattern = (s.get("propertyNames") or {}).get("pattern")
        if name_pattern is not None:
            try:
                rx = re.compile(name_pattern)
            except re.error as e:
                raise UnsupportedSchema(f"propertyNames pattern ({e})", path) from None
            excluded |= {k for k in names | set(required) if not rx.search(k)}
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

        items = [(k, schema_of(k, v)) for k, v in items]
        for k in required:
            if k not in names:
                items.append((k, schema_of(k, None)))
                names.add(k)
        req = set(required)
        if excluded & req:
            raise _Unsatisfiable("a required property that is not allowed", path)
        if excluded and (addl not in (None, False) or pattern_props) and "not" in s:
            raise UnsupportedSchema("not together with additional properties", path + "/not")
        items = [(k, v) for k, v in items if k not in excluded]
        # minProperties: optional properties are made required, in order, until enough
        for k, _ in items:
            if len(req) >= min_props:
                break
            req.add(k)
        force_one = min_props > len(req)
        if min_props > len(req) + 1 or (force_one and addl in (None, False)
                                        and not pattern_props):
            raise UnsupportedSchema("minProperties", path + "/minProperties")
        kvs = []
        for k, v in items:
            try:
                sub = self.gen(v, f"{path}/properties/{_esc(k)}")
            except _Unsatisfiable:
                if k in req:
                    raise
                continue   # an optional property no value fits is left out
            kvs.append((seq(self.literal(k), _WS, lit(":"), _WS, sub), k in req))
        extra = []
        any_key = Ref("json-string")
        if name_pattern is not None:
            any_key = seq(lit('"'), self.pattern(name_pattern, path + "/propertyNames"), lit('"'))
        for pat, sub in pattern_props.items():
            if name_pattern is None:
                key = seq(lit('"'), self.pattern(pat, f"{path}/patternProperties/{_esc(pat)}"),
                          lit('"'))
            elif pat in ("", ".*", "^.*$", ".+", "^.+$") or pat == name_pattern:
                key = any_key
            else:
                raise UnsupportedSchema("propertyNames with patternProperties",
                                        path + "/propertyNames")
            try:
                val = self.gen(sub, f"{path}/patternProperties/{_esc(pat)}")
            except _Unsatisfiable:
                continue   # no value fits: no such key
            extra.append(seq(key, _WS, lit(":"), _WS, val))
        if addl not in (None, False) and not pattern_props:
            # (with patternProperties, extra keys are only those the patterns allow)
            try:
                val = self.gen(addl if addl is not True else True, path + "/additionalProperties")
                extra.append(seq(any_key, _WS, lit(":"), _WS, val))
            except _Unsatisfiable:
                pass
        extra_kv = alt(*extra) if extra else None
        sep = seq(lit(","), _WS)
        # after[i]: items i.. when something came before; none[i]: when nothing did
        after = star(seq(sep, extra_kv, _WS)) if extra_kv is not None else EMPTY
        none = (opt(seq(extra_kv, _WS, star(seq(sep, extra_kv, _WS))))
                if extra_kv is not None else EMPTY)
        if force_one:
            none = seq(extra_kv, _WS, star(seq(sep, extra_kv, _WS)))
        for kv, is_req in reversed(kvs):
            a = seq(sep, kv, _WS, after)
            n = seq(kv, _WS, after)
            if not is_req:
                a = alt(a, after)
                n = alt(n, none)
            after, none = self.share(a), self.share(n)
        return seq(lit("{"), _WS, none, lit("}"))

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
            # Distinct items cannot be checked by a grammar; an array of distinct values of an
            # enum is (the values in enum order), anything else is narrowed to one item.
            values = self.enum_values(rest) if not prefix else None
            if values is not None:
                return self.unique_enum_array(values, lo, hi, path)
            if lo > 1:
                raise UnsupportedSchema("uniqueItems with minItems above 1", path + "/uniqueItems")
            hi = 1
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
                            "patternProperties", "minProperties")):
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
