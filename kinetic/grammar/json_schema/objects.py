"""Objects: named properties in declaration order, then extra keys.

The presence rules (required, minProperties, maxProperties, dependencies, `not: {required}`,
ExactlyOne) are tracked exactly by walking the named properties in order with a state (how many
properties so far, which of the relevant ones are present): one rule per reachable state, built
from the last property back, so a rule only refers to rules already made. Extra keys are never
one of the named properties (a repeated key would be checked against the wrong schema), so they
are written without escapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kinetic.grammar.ir import EMPTY, Ref, Rep, alt, chars, lit, opt, seq, star
from kinetic.grammar.json_schema.keywords import esc, is_not_required
from kinetic.grammar.json_schema.limits import Unsatisfiable, UnsupportedSchema, too_large
from kinetic.grammar.json_schema.strings import pattern_expr

_WS = Ref("ws")
_SPECIAL = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_ANY_NAME = ("", ".*", "^.*$", ".+", "^.+$")   # propertyNames-compatible patternProperties


@dataclass(frozen=True)
class ExactlyOne:
    """From a oneOf whose branches only require properties: exactly one of the sets has all
    its properties present."""
    sets: tuple[frozenset[str], ...]


def _dependencies(s: dict, path: str) -> dict[str, list[str]]:
    deps: dict[str, list[str]] = {}
    for key in ("dependencies", "dependentRequired"):
        given = s.get(key) or {}
        for name, dep in given.items():
            if isinstance(dep, dict) and set(dep) <= {"required"}:
                dep = dep.get("required", [])
            if not isinstance(dep, list):
                raise UnsupportedSchema(f"{key} with a schema", f"{path}/{key}/{esc(name)}")
            deps.setdefault(name, []).extend(d for d in dep if d != name and isinstance(d, str))
    return deps


def object_value(conv, s: dict, path: str, one_of: tuple[ExactlyOne, ...]):
    """The grammar of an object schema's values."""
    props = s.get("properties") or {}
    required = list(s.get("required") or [])
    addl = s.get("additionalProperties")
    pattern_props = s.get("patternProperties") or {}
    if addl is None and not props and not pattern_props:
        addl = True
    min_props = s.get("minProperties", 0)
    max_props = s.get("maxProperties")
    deps = _dependencies(s, path)
    not_sets = [frozenset(s["not"]["required"])] if is_not_required(s.get("not")) else []
    names = list(dict.fromkeys([*props, *required, *deps, *(d for ds in deps.values() for d in ds),
                                *(k for rule in one_of for ns in rule.sets for k in ns)]))
    if len(names) > conv.limits.properties:
        raise too_large(conv.limits, "properties", "an object", path,
                        f"names {len(names)} properties")
    conv.spend(len(names), path)
    excluded = set()
    name_pattern = (s.get("propertyNames") or {}).get("pattern")
    if name_pattern is not None:
        matches = conv.search(name_pattern, path + "/propertyNames")
        excluded |= {k for k in names if not matches(k)}
    searches = [(conv.search(pat, f"{path}/patternProperties/{esc(pat)}"), sub)
                for pat, sub in pattern_props.items()]

    def schema_of(k, declared):
        """A property's schema: its own and those of the patterns its name matches."""
        parts = [] if declared is None else [declared]
        parts += [sub for matches, sub in searches if matches(k)]
        if declared is None and not parts:
            if addl is False:
                return False
            parts = [addl if addl not in (None, True) else True]
        return parts[0] if len(parts) == 1 else {"allOf": parts}

    req = set(required)
    if excluded & req:
        raise Unsatisfiable("a required property that is not allowed", path)
    items = []   # (name, key: value expression, required)
    for k in names:
        if k in excluded:
            continue
        try:
            sub = conv.gen(schema_of(k, props.get(k)), f"{path}/properties/{esc(k)}")
        except Unsatisfiable:
            if k in req:
                raise
            continue   # an optional property no value fits is left out
        items.append((k, seq(conv.literal(k), _WS, lit(":"), _WS, sub), k in req))
    extra_kv = _extra_keys(conv, s, path, names, not_sets, name_pattern, searches, addl)

    present = {k for k, _, _ in items}
    relevant = ({k for k in deps if k in present}
                | {d for k in deps if k in present for d in deps[k]}
                | {k for ns in not_sets for k in ns}
                | {k for rule in one_of for ns in rule.sets for k in ns}) & present
    cap = max(min_props, max_props + 1 if max_props is not None else 0, 1)
    sep = seq(lit(","), _WS)

    def tail(c, seen):
        """Extra keys after the named ones, c properties so far."""
        if any(not set(deps[k]) <= seen for k in seen if k in deps):
            return None
        if any(ns <= seen for ns in not_sets):
            return None
        if any(sum(ns <= seen for ns in rule.sets) != 1 for rule in one_of):
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

    # the states (count so far, relevant properties present) before each named property
    levels = [{(0, frozenset())}]
    total = 1
    for k, _, is_req in items:
        nxt = set()
        for c, seen in levels[-1]:
            if max_props is None or c < max_props:
                nxt.add((min(c + 1, cap), seen | {k} if k in relevant else seen))
            if not is_req:
                nxt.add((c, seen))
        levels.append(nxt)
        total += len(nxt)
        if total > conv.limits.combinations:
            raise too_large(conv.limits, "combinations", "an object", path,
                            "needs more states to count its properties and track their "
                            "dependencies")
    after = {state: tail(*state) for state in levels[-1]}
    for i in range(len(items) - 1, -1, -1):
        k, kv, is_req = items[i]
        here = {}
        for c, seen in levels[i]:
            opts = []
            if max_props is None or c < max_props:
                nxt = after[(min(c + 1, cap), seen | {k} if k in relevant else seen)]
                if nxt is not None:
                    opts.append(seq(*([sep] if c else []), kv, _WS, nxt))
            if not is_req and after[(c, seen)] is not None:
                opts.append(after[(c, seen)])
            here[(c, seen)] = conv.share(alt(*opts)) if opts else None
        after = here
    body = after[(0, frozenset())]
    if body is None:
        for k in ("minProperties", "maxProperties", "dependencies", "dependentRequired",
                  "not", "oneOf"):
            if k in s:
                raise UnsupportedSchema(k, f"{path}/{k}")
        raise Unsatisfiable("an object no properties fit", path)
    return seq(lit("{"), _WS, body, lit("}"))


def _extra_keys(conv, s, path, names, not_sets, name_pattern, searches, addl):
    """One key: value pair outside the named properties, or None when there can be none."""
    known = set(names) | {k for ns in not_sets for k in ns}
    pattern_props = s.get("patternProperties") or {}
    extra = []
    if name_pattern is not None:
        any_key = seq(lit('"'), pattern_expr(name_pattern, path + "/propertyNames",
                                             conv.limits), lit('"'))
        if any(conv.search(name_pattern, path)(k) for k in known):
            any_key = None   # it could repeat a known name: no extra keys (narrower)
    else:
        any_key = key_not_in(conv, known)
    for (matches, sub), pat in zip(searches, pattern_props):
        if any(matches(k) for k in known):
            continue   # could repeat a known name: these keys are left out (narrower)
        at = f"{path}/patternProperties/{esc(pat)}"
        if name_pattern is None:
            key = seq(lit('"'), pattern_expr(pat, at, conv.limits), lit('"'))
        elif pat in _ANY_NAME or pat == name_pattern:
            key = any_key
        else:
            raise UnsupportedSchema("propertyNames with patternProperties",
                                    path + "/propertyNames")
        if key is None:
            continue
        try:
            val = conv.gen(sub, at)
        except Unsatisfiable:
            continue   # no value fits: no such key
        extra.append(seq(key, _WS, lit(":"), _WS, val))
    if addl not in (None, False) and not pattern_props and any_key is not None:
        # (with patternProperties, extra keys are only those the patterns allow)
        try:
            val = conv.gen(addl if addl is not True else True, path + "/additionalProperties")
            extra.append(seq(any_key, _WS, lit(":"), _WS, val))
        except Unsatisfiable:
            pass
    return conv.share(alt(*extra)) if extra else None


def key_not_in(conv, known):
    """A JSON string key, written without escapes, that is none of `known`: a trie of the
    known names whose every node also allows the characters that leave all of them."""
    if not known:
        return Ref("json-string")
    b = conv.b
    if "key-char" not in b.exprs:
        b.define("key-char", chars(_SPECIAL, negate=True))
        b.define("key-non-ascii", chars([(0x80, 0x10FFFF)]))
    free = star(Ref("key-char"))
    trie: dict = {}
    for k in known:
        node = trie
        for ch in k:
            node = node.setdefault(ch, {})
        node[None] = {}

    def other(kids):
        taken = "".join(sorted(kids))
        cls = conv.key_class.get(taken)   # the characters that leave every name
        if cls is None:
            cut = [(ord(ch), ord(ch)) for ch in taken]
            if any(ord(ch) >= 0x80 for ch in kids):   # (rare: one big class)
                one = chars(_SPECIAL + cut, negate=True)
            else:
                one = alt(chars(_SPECIAL + cut + [(0x80, 0x10FFFF)], negate=True),
                          Ref("key-non-ascii"))
            cls = conv.key_class[taken] = conv.share(seq(one, free))
        return cls

    # post-order without recursion (names may be long): a node's rule after its children's
    done: dict[int, object] = {}
    work = [(trie, False)]
    while work:
        node, ready = work.pop()
        kids = [ch for ch in node if ch is not None]
        if not ready:
            work.append((node, True))
            work.extend((node[ch], False) for ch in kids if ord(ch) > 0x1F and ch not in '"\\')
            continue
        out = [] if None in node else [EMPTY]
        for ch in kids:
            if ord(ch) > 0x1F and ch not in '"\\':
                out.append(seq(lit(ch), done.pop(id(node[ch]))))
        out.append(other(kids))
        done[id(node)] = conv.share(alt(*out))
    name = b.fresh("key")
    b.define(name, seq(lit('"'), done[id(trie)], lit('"')))
    return Ref(name)
