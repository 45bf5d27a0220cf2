"""Arrays: prefixItems (or draft 4's list of items), then items, between minItems and maxItems;
uniqueItems where the items are an enum (the distinct values, in enum order)."""

from __future__ import annotations

from kinetic.grammar.ir import EMPTY, Ref, Rep, alt, lit, opt, seq
from kinetic.grammar.json_schema.limits import Unsatisfiable, UnsupportedSchema, too_large
from kinetic.grammar.json_schema.literals import json_key, of_types

_WS = Ref("ws")
_SEP = seq(lit(","), _WS)
_PLAIN_ENUM = {"enum", "const", "type", "description", "title"}


def array_value(conv, s: dict, path: str):
    """The grammar of an array schema's values."""
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
        values = _enum_values(conv, rest) if not prefix else None
        if values is None:
            raise UnsupportedSchema("uniqueItems (on items that are not an enum)",
                                    path + "/uniqueItems")
        return _unique_enum_array(conv, values, lo, hi, path)
    if hi is not None and hi < lo:
        raise Unsatisfiable("maxItems below minItems", path)
    if hi is not None:
        hi = min(hi, max(lo, len(prefix)) + conv.limits.repeat)
        prefix = prefix[:hi]
    elems = [conv.gen(p, f"{path}/prefixItems/{i}") for i, p in enumerate(prefix)]
    if rest is False:
        if lo > len(prefix):
            raise UnsupportedSchema("minItems above the number of items allowed", path)
        rest_g = None
    else:
        rest_g = conv.gen(rest, path + "/items")
    k = len(elems)
    # the items from index k on
    if rest_g is None or (hi is not None and hi <= k):
        tail = EMPTY
    else:
        elem = conv.share(seq(rest_g, _WS))   # used twice: nested arrays must not double
        n_max = None if hi is None else hi - k
        n_min = max(lo - k, 0)
        if k == 0:
            tail = seq(elem, Rep(seq(_SEP, elem), max(n_min - 1, 0),
                                 None if n_max is None else n_max - 1))
            if n_min == 0:
                tail = opt(tail)
        else:
            tail = Rep(seq(_SEP, elem), n_min, n_max)
    for j in range(k - 1, -1, -1):
        part = seq(*([] if j == 0 else [_SEP]), elems[j], _WS, tail)
        tail = part if j < lo else opt(part)
    return seq(lit("["), _WS, tail, lit("]"))


def _enum_values(conv, items):
    """The distinct values of an items schema that is a plain enum (or const), else None."""
    if not isinstance(items, dict):
        return None
    items = conv.deref(items, "")
    if not isinstance(items, dict) or not set(items) <= _PLAIN_ENUM:
        return None
    values = [items["const"]] if "const" in items else items.get("enum")
    if not isinstance(values, list):
        return None
    if items.get("type") is not None:
        values = of_types(values, items["type"])
    distinct: dict[str, object] = {}
    for v in values:
        distinct.setdefault(json_key(v), v)
    return list(distinct.values())


def _unique_enum_array(conv, values, lo: int, hi: int | None, path: str):
    """Arrays of distinct values in enum order: a rule per (next value, items so far), made
    from the last value back. The count is kept only as far as a bound can still tell."""
    n = len(values)
    hi = n if hi is None else min(hi, n)
    if lo > hi:
        raise Unsatisfiable("uniqueItems with more items than values", path)
    cap = hi if hi < n else max(lo, 1)   # counts above cap behave alike
    if (n + 1) * (cap + 1) > conv.limits.combinations:
        raise too_large(conv.limits, "combinations", "uniqueItems", path + "/uniqueItems",
                        f"needs {(n + 1) * (cap + 1)} states for {n} values")
    conv.spend(n, path)
    after: dict[int, object] = {c: EMPTY if c >= lo else None for c in range(cap + 1)}
    for i in range(n - 1, -1, -1):
        item = conv.literal(values[i])
        here = {}
        for c in range(min(i, cap) + 1):
            opts = []
            if c >= lo:
                opts.append(EMPTY)
            if c < hi and n - i + c >= lo:
                nxt = after[min(c + 1, cap)]
                if nxt is not None:
                    opts.append(seq(*([_SEP] if c else []), item, _WS, nxt))
                if n - i - 1 + c >= lo and after[c] is not None:
                    opts.append(after[c])
            here[c] = conv.share(alt(*opts)) if opts else None
        after = here
    body = after[0]
    if body is None:
        raise Unsatisfiable("uniqueItems with more items than values", path)
    return seq(lit("["), _WS, body, lit("]"))
