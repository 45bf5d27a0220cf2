"""allOf, anyOf and oneOf.

allOf is merged into one schema (the keyword table says how two values of a keyword join).
anyOf is an alternation of its branches, each joined with the keywords beside it. oneOf is an
anyOf when no two branches can hold at once, as far as a simple look proves it (different
types, an enum none of whose values meets the other branch, objects told apart by a required
property); a oneOf whose branches only require properties becomes an ExactlyOne rule of the
object. Any other oneOf is refused: "exactly one" cannot be checked by a grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kinetic.grammar.ir import Alt, Chars, Lit, Rep, Seq, alt
from kinetic.grammar.json_schema.keywords import (MERGE, TYPES, VALIDATION, has_validation,
                                                  infer_type, is_not_required)
from kinetic.grammar.json_schema.limits import Unsatisfiable, UnsupportedSchema
from kinetic.grammar.json_schema.literals import is_type, json_key, value_types
from kinetic.grammar.json_schema.objects import ExactlyOne
from kinetic.grammar.json_schema.strings import searcher
from kinetic.grammar.regex import RegexUnsupported, parse_regex


def merge_all(conv, s: dict, path: str) -> dict:
    """A schema with `allOf` as one schema holding all its parts."""
    parts = s["allOf"]
    out = {k: v for k, v in s.items() if k != "allOf"}
    for i, p in enumerate(parts):
        p = conv.deref(p, f"{path}/allOf/{i}")
        if p is True or p == {}:
            continue
        if p is False:
            raise UnsupportedSchema("false (a schema that matches nothing)", path)
        if not isinstance(p, dict):
            raise UnsupportedSchema(f"a schema of type {type(p).__name__}", f"{path}/allOf/{i}")
        if "allOf" in p:
            p = merge_all(conv, p, f"{path}/allOf/{i}")
        out = merge(out, p, f"{path}/allOf/{i}")
    return out


def merge(a: dict, b: dict, path: str) -> dict:
    """One schema whose values are those of both (a keyword only one has is copied; annotations
    and unknown keywords of b win)."""
    out = dict(a)
    for k, v in b.items():
        if k not in out or k not in VALIDATION:
            out[k] = v
            continue
        w = out[k]
        if w == v:
            continue
        how = MERGE[k]
        if how == "properties" and isinstance(w, dict) and isinstance(v, dict):
            props = dict(w)
            for name, sub in v.items():
                props[name] = {"allOf": [props[name], sub]} if name in props else sub
            out[k] = props
        elif how == "union" and isinstance(w, list) and isinstance(v, list):
            out[k] = list(dict.fromkeys(list(w) + list(v)))
        elif how == "types":
            wl = w if isinstance(w, list) else [w]
            vl = v if isinstance(v, list) else [v]
            both = [x for x in wl if x in vl or (x == "integer" and "number" in vl)]
            both += [x for x in vl if x == "integer" and "number" in wl and x not in both]
            if not both:
                raise Unsatisfiable("allOf with types that exclude each other", path)
            out[k] = both if len(both) > 1 else both[0]
        elif how == "max":
            out[k] = max(w, v) if not isinstance(w, bool) else v
        elif how == "min":
            out[k] = min(w, v) if not isinstance(w, bool) else v
        elif how == "false_wins" and (w is False or v is False):
            out[k] = False
        elif how == "branches" and isinstance(w, list) and w:
            # one of w and one of v: each branch of w joined with all of v
            out[k] = [{"allOf": [br, {k: v}]} for br in w]
        else:
            raise UnsupportedSchema(f"allOf with two different {k!r}", path)
    return out


def any_of(conv, s: dict, key: str, path: str, one_of: tuple):
    """The values of an anyOf (or a oneOf) and the keywords beside it."""
    branches = s[key]
    if not isinstance(branches, list) or not branches:
        raise UnsupportedSchema(f"{key} that is not a non-empty list", path)
    rest = {k: v for k, v in s.items() if k != key}
    if key == "oneOf" and not disjoint(conv, branches, path):
        # exactly one: enforced when the branches only require properties
        sets = [conv.deref(b, path) for b in branches]
        if not all(isinstance(b, dict) and not set(b) & VALIDATION - {"required"}
                   and isinstance(b.get("required"), list) for b in sets):
            raise UnsupportedSchema("oneOf (branches that may overlap)", path + "/oneOf")
        t = rest.get("type", "object")
        if t != "object" and "object" not in (t if isinstance(t, list) else []):
            raise Unsatisfiable("oneOf of required properties on a non-object", path)
        rule = ExactlyOne(tuple(frozenset(_names(b["required"])) for b in sets))
        return conv.gen({**rest, "type": "object"}, path, (*one_of, rule))
    out = []
    for i, br in enumerate(branches):
        try:
            if has_validation(rest):
                out.append(conv.gen({"allOf": [rest, br]}, f"{path}/{key}/{i}", one_of))
            else:
                out.append(conv.gen(br, f"{path}/{key}/{i}", one_of))
        except Unsatisfiable:
            continue
    if not out:
        raise Unsatisfiable(f"{key} with no branch that can be met", path)
    return alt(*out)


def disjoint(conv, branches: list, path: str) -> bool:
    """Whether no value can meet two of the branches (so oneOf is anyOf)."""
    bs = [conv.deref(b, path) for b in branches]
    return all(_apart(conv, a, b, 0) for i, a in enumerate(bs) for b in bs[:i])


@dataclass
class _Summary:
    """What the disjointness look needs of a schema, computed once per schema."""
    types: set
    values: dict | None    # json key -> value: its enum or const, or the few strings its
                           # pattern matches
    exact: bool            # values is the enum or const (no other value is valid)
    search: object         # its pattern's searcher, if any
    min_len: int | None
    max_len: int | None


def _summary(conv, s: dict) -> _Summary:
    cached = conv.summaries.get(id(s))
    if cached is not None:
        return cached[1]
    types = _types(s)
    own = [s["const"]] if "const" in s else s.get("enum")
    values = own if isinstance(own, list) else _pattern_values(s, types)
    search = None
    if isinstance(s.get("pattern"), str):
        try:
            search = searcher(s["pattern"], "", conv.limits)
        except UnsupportedSchema:
            pass   # unsure; compiling the pattern says why it cannot be used
    ints = {k: s[k] if isinstance(s.get(k), int) and not isinstance(s[k], bool) else None
            for k in ("minLength", "maxLength")}
    out = _Summary(types, None if values is None else {json_key(v): v for v in values},
                   isinstance(own, list), search, ints["minLength"], ints["maxLength"])
    conv.summaries[id(s)] = (s, out)   # (s kept alive: its id is not reused)
    return out


def _apart(conv, a, b, depth: int) -> bool:
    if a is False or b is False:
        return True
    if not isinstance(a, dict) or not isinstance(b, dict) or depth > 8:
        return False
    a, b = conv.deref(a, ""), conv.deref(b, "")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return a is False or b is False
    sa, sb = _summary(conv, a), _summary(conv, b)
    if not sa.types & sb.types:
        return True
    if sa.exact and sb.exact:
        # two enums: only the values they share can meet both
        common = sa.values.keys() & sb.values.keys()
        if all(_fails(sa, sa.values[key], key) or _fails(sb, sa.values[key], key)
               for key in common):
            return True
    else:
        for sx, sy in ((sa, sb), (sb, sa)):
            if sx.values is not None and all(_fails(sy, v, key)
                                             for key, v in sx.values.items()):
                return True
    for x, y, sx, sy in ((a, b, sa, sb), (b, a, sb, sa)):
        if not {"object"} >= sx.types & sy.types:
            continue
        req_x = set(_names(x.get("required")))
        req_y = set(_names(y.get("required")))
        px = x.get("properties") if isinstance(x.get("properties"), dict) else {}
        py = y.get("properties") if isinstance(y.get("properties"), dict) else {}
        for k in req_x:
            if k in req_y and k in px and k in py and _apart(conv, px[k], py[k], depth + 1):
                return True
            if (y.get("additionalProperties") is False and k not in py
                    and not y.get("patternProperties")):
                return True
        if is_not_required(y.get("not")) and set(y["not"]["required"]) <= req_x:
            return True
    return False


def _names(x) -> list:
    return [k for k in x if isinstance(k, str)] if isinstance(x, list) else []


def _fails(s: _Summary, v, key: str) -> bool:
    """Whether the value is surely invalid under the summarized schema (False when unsure)."""
    if not any(is_type(v, t) for t in s.types):
        return True
    if s.exact and key not in s.values:
        return True
    if isinstance(v, str):
        if s.search is not None and not s.search(v):
            return True
        if s.min_len is not None and len(v) < s.min_len:
            return True
        if s.max_len is not None and len(v) > s.max_len:
            return True
    return False


def _types(s: dict) -> set:
    """The JSON types a schema's values can have (integer counted as number too)."""
    out = set(TYPES)
    if "const" in s or "enum" in s:
        values = [s["const"]] if "const" in s else s["enum"]
        if isinstance(values, list):
            out &= value_types(values)
    t = s.get("type") or infer_type(s)
    if t is not None:
        tl = set(t if isinstance(t, list) else [t])
        if tl & {"number", "integer"}:
            tl |= {"number", "integer"}
        out &= tl
    return out


def _pattern_values(s: dict, types: set):
    """A string schema whose pattern matches few strings, as those strings (else None)."""
    if not isinstance(s.get("pattern"), str) or "string" not in types:
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

