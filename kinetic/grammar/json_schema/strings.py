"""Strings: JSON string content, `pattern` as a grammar, lengths and formats.

A pattern is parsed by kinetic.grammar.regex into an expression over code points, then
rewritten over JSON string content (a `"` or a control character in the pattern is written as
its escape), with `.*` on an unanchored side. minLength/maxLength with a pattern narrow the
pattern's repetitions so that its matches fit; a pattern that cannot be made to fit is refused.
"""

from __future__ import annotations

import re

from kinetic.grammar.ir import (ANY_CHAR, EMPTY, Alt, Chars, GrammarBuilder, Lit, Ref, Rep, Seq,
                                alt, chars, lit, seq, star)
from kinetic.grammar.matcher import accepts
from kinetic.grammar.json_schema.formats import FORMATS
from kinetic.grammar.json_schema.keywords import UNSUPPORTED_FORMATS
from kinetic.grammar.json_schema.limits import (SchemaLimits, Unsatisfiable, UnsupportedSchema,
                                                too_large)
from kinetic.grammar.json_schema.numbers import HEX, char_range
from kinetic.grammar.regex import RegexUnsupported, parse_regex

_HEX_NO_SURROGATE_LEAD = chars([(48, 57), (65, 67), (69, 70), (97, 99), (101, 102)])
_SPECIAL = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))   # written escaped in a JSON string
_ESCAPES = {ord('"'): '\\"', ord("\\"): "\\\\", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r",
            9: "\\t"}


def json_char():
    """One character of JSON string content: plain, or an escape (no lone surrogates)."""
    plain = chars(list(_SPECIAL), negate=True)
    esc = seq(lit("\\"), alt(Chars(tuple((ord(c), ord(c)) for c in sorted('"\\/bfnrt'))),
                             seq(lit("u"), alt(seq(_HEX_NO_SURROGATE_LEAD, HEX),
                                               seq(chars([(68, 68), (100, 100)]),
                                                   char_range("0", "7"))),
                                 HEX, HEX)))
    return alt(plain, esc)


def _json_chars(ranges) -> object:
    """A code point set as JSON string content: plain characters raw, the others escaped."""
    special = []
    for lo, hi in ranges:
        for sp_lo, sp_hi in _SPECIAL:
            a, b = max(lo, sp_lo), min(hi, sp_hi)
            if a <= b:
                special.extend(range(a, b + 1))
    cut = chars(list(_SPECIAL), negate=True).ranges
    inter = []
    for lo, hi in ranges:
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


def _largest_count(expr) -> int:
    most, work = 0, [expr]
    while work:
        e = work.pop()
        if isinstance(e, Rep):
            most = max(most, e.min, e.max or 0)
            work.append(e.item)
        elif isinstance(e, (Seq, Alt)):
            work.extend(e.items)
    return most


def pattern_expr(pattern: str, path: str, limits: SchemaLimits):
    """A pattern as JSON string content (searched: `.*` where a side is not anchored)."""
    try:
        re.compile(pattern)
        branches = parse_regex(pattern)
        out = []
        any_text = star(Ref("json-char"))
        for expr, start, end in branches:
            n = _largest_count(expr)
            if n > limits.repeat:
                raise too_large(limits, "repeat", "pattern", path, f"repeats {n} times")
            body = _jsonify(expr)
            out.append(seq(*([] if start else [any_text]), body, *([] if end else [any_text])))
        return alt(*out)
    except (RegexUnsupported, re.error) as e:
        raise UnsupportedSchema(f"pattern {pattern!r} ({e})", path) from None


def string(s: dict, path: str, limits: SchemaLimits):
    """The grammar of a string schema's values: minLength, maxLength, pattern, format."""
    lo = s.get("minLength", 0)
    hi = s.get("maxLength")
    fmt = s.get("format") if isinstance(s.get("format"), str) else None
    pattern = s.get("pattern")
    if fmt in UNSUPPORTED_FORMATS:
        raise UnsupportedSchema(f"format {fmt!r}", path + "/format")
    if hi is not None and hi < lo:
        raise Unsatisfiable("maxLength below minLength", path)
    if fmt in FORMATS and pattern is None:
        body = FORMATS[fmt]
        if lo or hi is not None:
            n_lo, n_hi = length_range(body)
            if n_lo < lo or hi is not None and (n_hi is None or n_hi > hi):
                raise UnsupportedSchema(f"format {fmt!r} together with minLength/maxLength",
                                        path)
        return seq(lit('"'), body, lit('"'))
    if pattern is not None:
        if fmt in FORMATS:   # both cannot be enforced at once
            raise UnsupportedSchema(f"format {fmt!r} together with pattern", path + "/format")
        body = pattern_expr(pattern, path + "/pattern", limits)
        if lo or hi is not None:
            body = _fit_length(body, lo, hi)
            n_lo, n_hi = length_range(body)
            if n_lo < lo or hi is not None and (n_hi is None or n_hi > hi):
                raise UnsupportedSchema("pattern together with minLength/maxLength that "
                                        "the pattern does not imply", path)
        return seq(lit('"'), body, lit('"'))
    if hi is not None:
        hi = min(hi, lo + limits.repeat)
    if not lo and hi is None:
        return Ref("json-string")
    return seq(lit('"'), Rep(Ref("json-char"), lo, hi), lit('"'))


def string_rule(conv, s: dict, path: str):
    """string() as a rule made once per shape: a thousand properties of maxLength 2000 lower
    one repetition, not a thousand."""
    key = repr(tuple(s.get(k) for k in ("minLength", "maxLength", "format", "pattern")))
    return conv.named(("string", key), lambda: string(s, path, conv.limits))


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
    n_lo, n_hi = length_range(expr)
    if n_lo < lo:
        done = [False]

        def bump(r):
            a, _ = length_range(r.item)
            if done[0] or r.max is not None or a == 0:
                return r
            done[0] = True
            return Rep(r.item, r.min + -(-(lo - n_lo) // a), None)
        expr = _map_reps(expr, bump)
        n_lo, n_hi = length_range(expr)
    if hi is not None and n_hi is None:
        unbounded = []
        _map_reps(expr, lambda r: (unbounded.append(r) if r.max is None else None) or r)
        widths = [length_range(r.item)[1] for r in unbounded]
        if None in widths or not unbounded or n_lo > hi:
            return expr
        room = (hi - n_lo) // len(unbounded)

        def cap(r):
            if r.max is not None:
                return r
            w = length_range(r.item)[1]
            return Rep(r.item, r.min, r.min + room // max(w, 1))
        expr = _map_reps(expr, cap)
    return expr


def length_range(expr) -> tuple[int, int | None]:
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
            a, b = length_range(e)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if isinstance(expr, Alt):
        rs = [length_range(e) for e in expr.items]
        his = [b for _, b in rs]
        return min(a for a, _ in rs), None if None in his else max(his)
    if isinstance(expr, Rep):
        a, b = length_range(expr.item)
        return a * expr.min, None if expr.max is None or b is None else b * expr.max
    return 0, None


def searcher(pattern: str, path: str, limits: SchemaLimits):
    """A function telling whether `pattern` matches somewhere in a text (a property name, an
    enum value). It runs the pattern's grammar, never Python's backtracking `re`: a client's
    `(a+)+$` must not take the server's time. Raises UnsupportedSchema as pattern_expr does."""
    if not isinstance(pattern, str):
        raise UnsupportedSchema("a pattern that is not a string", path)
    try:
        re.compile(pattern)
        branches = parse_regex(pattern)
    except (RegexUnsupported, re.error) as e:
        raise UnsupportedSchema(f"pattern {pattern!r} ({e})", path) from None
    for expr, _, _ in branches:
        n = _largest_count(expr)
        if n > limits.repeat:
            raise too_large(limits, "repeat", "pattern", path, f"repeats {n} times")
    anything = star(ANY_CHAR)
    b = GrammarBuilder()
    b.define("root", alt(*(seq(*([] if start else [anything]), expr,
                               *([] if end else [anything]))
                           for expr, start, end in branches)))
    g = b.build("root")
    return lambda text: accepts(g, text.encode("utf-8", "surrogatepass"))
