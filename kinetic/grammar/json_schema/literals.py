"""`enum` and `const`: a set of exact JSON texts, as a trie.

An alternation of n literals would give the matcher a parser state of n stacks at the start of
the value (one per literal still possible), and every mask would walk them all: 100,000 strings
wedged the server. Left-factored, the values share their prefixes: each branching point of the
trie is one rule whose alternatives are its next bytes, so a state holds at most one stack per
distinct next byte (plus one where a value may end), whatever the enum's size.
"""

from __future__ import annotations

import json
from typing import Callable

from kinetic.grammar.ir import EMPTY, Lit, alt, seq
from kinetic.grammar.json_schema.keywords import TYPES


def literal_bytes(value) -> bytes:
    """The JSON text a value is written as (compact, UTF-8)."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def json_key(value) -> str:
    """A canonical text of a value, for JSON equality (1 and 1.0 apart, as json.dumps has it)."""
    return json.dumps(value, sort_keys=True)


def same_json(v, values) -> bool:
    """Whether v is among values by JSON equality."""
    key = json_key(v)
    return any(json_key(u) == key for u in values)


def literal_trie(texts, name: Callable[[object], object]):
    """The alternation of the byte strings `texts`, left-factored: each branching point is an
    expression passed to `name` (which makes it a rule and returns a reference to it), so the
    expression and the rules stay shallow however long the values are. Built without recursion
    over the sorted texts: a group of texts sharing a prefix is a range of them."""
    texts = sorted(set(texts))
    if not texts:
        return None
    # Each frame is a branching node: texts[lo:hi] share texts[lo][:depth]. Its children are
    # made first (post-order), then its alternation.
    done: dict[tuple[int, int, int], object] = {}
    work = [(0, len(texts), 0, False)]
    while work:
        lo, hi, depth, ready = work.pop()
        groups = _groups(texts, lo, hi, depth)
        if not ready:
            work.append((lo, hi, depth, True))
            work.extend((a, b, e, False) for a, b, e in groups if b - a > 1)
            continue
        items = [EMPTY] if len(texts[lo]) == depth else []
        for a, b, e in groups:
            head = Lit(texts[a][depth:e])
            items.append(head if b - a == 1 else seq(head, done.pop((a, b, e))))
        done[(lo, hi, depth)] = alt(*items) if depth == 0 else name(alt(*items))
    return done[(0, len(texts), 0)]


def _groups(texts, lo: int, hi: int, depth: int):
    """The children of a node: (first, end, depth of the next branching point) per next byte.
    Texts are sorted, so a prefix comes before its extensions and a group's common prefix is
    that of its first and last text."""
    out = []
    i = lo + (len(texts[lo]) == depth)
    while i < hi:
        byte = texts[i][depth]
        j = i + 1
        while j < hi and texts[j][depth] == byte:
            j += 1
        first, last = texts[i], texts[j - 1]
        e = depth + 1
        if j - i == 1:
            e = len(first)
        else:
            while e < len(first) and e < len(last) and first[e] == last[e]:
                e += 1
        out.append((i, j, e))
        i = j
    return out


def is_type(v, t: str) -> bool:
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


def of_types(values: list, types) -> list:
    """The values of one of `types` (a type name or a list of them)."""
    tl = types if isinstance(types, list) else [types]
    return [v for v in values if any(is_type(v, t) for t in tl)]


def value_types(values: list) -> set:
    return {t for v in values for t in TYPES if is_type(v, t)}
