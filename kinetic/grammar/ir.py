"""The grammar IR: expressions over code points and bytes, lowered to byte-level rules.

Front ends (GBNF, JSON Schema) build `Expr` trees for named rules with `GrammarBuilder`;
`GrammarBuilder.build()` lowers them to a `Grammar` whose rules are alternatives of sequences of
symbols, each symbol a terminal (a set of bytes) or a rule reference. Character classes over code
points become alternatives of byte-set sequences (their UTF-8 encodings), repetitions become
right-recursive helper rules, so the matcher only ever sees bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

MAX_CODE_POINT = 0x10FFFF
MAX_SYMBOLS = 1 << 20   # a grammar lowered to more symbols than this is refused (a client
                        # sends the grammar: x{1000000} must not take the server's memory)
MAX_RULES = 1 << 16     # nor more rules than this: x{0,1000000} is a million small rules, and
                        # lowering them took 15 s of a parse worker (JSONSchemaBench's largest
                        # schema lowers to 3413 rules; 65536 take about half a second)


class GrammarError(ValueError):
    """An invalid grammar: the message, and where known the 1-based line and column."""

    def __init__(self, message: str, line: int | None = None, column: int | None = None):
        self.message = message
        self.line = line
        self.column = column
        where = f" at line {line}, column {column}" if line is not None else ""
        super().__init__(f"{message}{where}")


# --- expressions ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Lit:
    """Exact bytes."""
    data: bytes


@dataclass(frozen=True)
class Bytes:
    """One byte out of a set, as a 256-bit mask."""
    mask: int


@dataclass(frozen=True)
class Chars:
    """One code point out of sorted, disjoint, inclusive ranges."""
    ranges: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Ref:
    name: str
    line: int | None = None
    column: int | None = None


@dataclass(frozen=True)
class Seq:
    items: tuple


@dataclass(frozen=True)
class Alt:
    items: tuple


@dataclass(frozen=True)
class Rep:
    item: object
    min: int
    max: int | None   # None: unbounded


EMPTY = Seq(())


def lit(text: str | bytes) -> Lit:
    return Lit(text.encode() if isinstance(text, str) else text)


def seq(*items) -> object:
    flat = []
    for it in items:
        if isinstance(it, Seq):
            flat.extend(it.items)
        else:
            flat.append(it)
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def alt(*items) -> object:
    uniq = list(dict.fromkeys(items))
    return uniq[0] if len(uniq) == 1 else Alt(tuple(uniq))


# --- alternations of literals, left-factored --------------------------------------------------
# An alternation of n literals gives the matcher a parser state of n stacks where it starts
# (one per literal still possible), and every mask walks them all: 100,000 strings wedged the
# server. Left-factored, the literals share their prefixes: each branching point of the trie is
# one rule whose alternatives are its next bytes, so a state holds at most one stack per
# distinct next byte (plus one where a literal may end), whatever their number. JSON Schema's
# enum and GBNF's alternations of string literals are built so.

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


def opt(item) -> Rep:
    return Rep(item, 0, 1)


def star(item) -> Rep:
    return Rep(item, 0, None)


def normalize_ranges(ranges) -> tuple[tuple[int, int], ...]:
    """Sorted, merged, clipped to valid scalar values (surrogates removed)."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        lo, hi = max(lo, 0), min(hi, MAX_CODE_POINT)
        if lo > hi:
            continue
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    cut: list[tuple[int, int]] = []
    for lo, hi in out:   # UTF-8 cannot encode surrogates
        if lo < 0xD800 <= hi or lo <= 0xDFFF < hi or 0xD800 <= lo <= hi <= 0xDFFF:
            if lo < 0xD800:
                cut.append((lo, 0xD7FF))
            if hi > 0xDFFF:
                cut.append((0xE000, hi))
        else:
            cut.append((lo, hi))
    return tuple(cut)


def chars(ranges, negate: bool = False) -> Chars:
    rs = normalize_ranges(ranges)
    if negate:
        comp, nxt = [], 0
        for lo, hi in rs:
            if lo > nxt:
                comp.append((nxt, lo - 1))
            nxt = hi + 1
        if nxt <= MAX_CODE_POINT:
            comp.append((nxt, MAX_CODE_POINT))
        rs = normalize_ranges(comp)
    return Chars(rs)


ANY_CHAR = chars([(0, MAX_CODE_POINT)])


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """The code points lo..hi as a list of UTF-8 byte-range sequences, each sequence the product
    of its per-byte ranges."""
    out: list[list[tuple[int, int]]] = []
    for blo, bhi in ((0, 0x7F), (0x80, 0x7FF), (0x800, 0xFFFF), (0x10000, MAX_CODE_POINT)):
        a, b = max(lo, blo), min(hi, bhi)
        if a <= b:
            _split_same_length(a, b, out)
    return out


def _split_same_length(lo: int, hi: int, out: list) -> None:
    n = len(chr(lo).encode("utf-8", "surrogatepass"))
    for i in range(1, n):
        m = (1 << (6 * i)) - 1
        if lo & ~m != hi & ~m:
            if lo & m:
                _split_same_length(lo, lo | m, out)
                _split_same_length((lo | m) + 1, hi, out)
                return
            if hi & m != m:
                _split_same_length(lo, (hi & ~m) - 1, out)
                _split_same_length(hi & ~m, hi, out)
                return
    a = chr(lo).encode("utf-8", "surrogatepass")
    b = chr(hi).encode("utf-8", "surrogatepass")
    out.append(list(zip(a, b)))


def byte_mask(lo: int, hi: int) -> int:
    return ((1 << (hi + 1)) - 1) ^ ((1 << lo) - 1)


# --- the lowered grammar -------------------------------------------------------------------

TERM, NONTERM, END = 0, 1, 2


class Grammar:
    """Byte-level rules, flattened into positions. Position p has kind[p]: TERM (match one byte
    of mask[p], then go to p + 1), NONTERM (run rule ref[p], then go to p + 1) or END (the
    alternative is done). starts[r] lists the first positions of rule r's alternatives."""

    def __init__(self, rule_names: list[str], rules: list[list[list[tuple[int, int]]]],
                 root: int):
        self.rule_names = rule_names
        self.root = root
        self.kind: list[int] = []
        self.arg: list[int] = []      # byte mask for TERM, rule id for NONTERM, rule id for END
        self.starts: list[list[int]] = []
        for r, alts in enumerate(rules):
            starts = []
            for syms in alts:
                starts.append(len(self.kind))
                for k, a in syms:
                    self.kind.append(k)
                    self.arg.append(a)
                self.kind.append(END)
                self.arg.append(r)
            self.starts.append(starts)
        self.n_rules = len(rules)
        self._states = None   # the matcher's shared state tables, made on first use
        # what the grammar was compiled from, as its compiler records it ({"type": "gbnf",
        # "gbnf": text}, ...): a receipt carries it so that a verifier compiles it again
        # (kinetic/receipts); None for a grammar built otherwise
        self.source: dict | None = None


class GrammarBuilder:
    """Collects named rules as expressions and lowers them to a `Grammar`."""

    def __init__(self):
        self.exprs: dict[str, object] = {}
        self.where: dict[str, tuple[int | None, int | None]] = {}

    def define(self, name: str, expr, line: int | None = None, column: int | None = None):
        self.exprs[name] = expr
        self.where.setdefault(name, (line, column))

    def fresh(self, base: str) -> str:
        i = len(self.exprs)
        while f"{base}-{i}" in self.exprs:
            i += 1
        return f"{base}-{i}"

    def build(self, root: str = "root") -> Grammar:
        if root not in self.exprs:
            raise GrammarError(f"grammar has no rule named {root!r}", 1, 1)
        return _Lowering(self).run(root)


class _Lowering:
    def __init__(self, b: GrammarBuilder):
        self.b = b
        self.ids: dict[str, int] = {}
        self.names: list[str] = []
        self.rules: list[list[list[tuple[int, int]]] | None] = []
        self.aux: dict[tuple, int] = {}    # memoized helper rules by content
        self.size = 0                      # symbols made by repetitions so far

    def run(self, root: str) -> Grammar:
        for name in self.b.exprs:
            self._id(name)
        for name, expr in list(self.b.exprs.items()):
            self.rules[self.ids[name]] = self._alts(expr, name)
        self.rules = without_dead_ends(self.rules)
        if not self.rules[self.ids[root]]:
            raise GrammarError(f"the grammar matches no text: every way through rule {root!r} "
                               f"meets a character class that holds no character (or a rule "
                               f"made only of such)")
        self._check_left_recursion()
        return Grammar(self.names, self.rules, self.ids[root])

    def _id(self, name: str) -> int:
        if name not in self.ids:
            if len(self.names) >= MAX_RULES:
                raise GrammarError(f"the grammar is too large: it lowers to more than "
                                   f"{MAX_RULES} rules (a repetition {{m,n}} makes one rule "
                                   f"for each count past m)")
            self.ids[name] = len(self.names)
            self.names.append(name)
            self.rules.append(None)
        return self.ids[name]

    def _new_rule(self, key: tuple, base: str, alts) -> int:
        if key in self.aux:
            return self.aux[key]
        rid = self._id(f"{base}-{len(self.names)}")
        self.aux[key] = rid
        self.rules[rid] = alts
        return rid

    def _alts(self, expr, ctx: str) -> list[list[tuple[int, int]]]:
        if isinstance(expr, Alt):
            return [self._syms(e, ctx) for e in expr.items]
        if isinstance(expr, Chars):
            return self._char_alts(expr)
        return [self._syms(expr, ctx)]

    def _char_alts(self, expr: Chars) -> list[list[tuple[int, int]]]:
        alts: list[list[tuple[int, int]]] = []
        ascii_mask = 0
        for lo, hi in expr.ranges:
            for s in utf8_sequences(lo, hi):
                if len(s) == 1:
                    ascii_mask |= byte_mask(*s[0])
                else:
                    alts.append([(TERM, byte_mask(a, b)) for a, b in s])
        if ascii_mask:
            alts.insert(0, [(TERM, ascii_mask)])
        return alts

    def _syms(self, expr, ctx: str) -> list[tuple[int, int]]:
        if isinstance(expr, Lit):
            return [(TERM, 1 << b) for b in expr.data]
        if isinstance(expr, Bytes):
            return [(TERM, expr.mask)]
        if isinstance(expr, Ref):
            if expr.name not in self.b.exprs:
                raise GrammarError(f"undefined rule {expr.name!r}", expr.line, expr.column)
            return [(NONTERM, self.ids[expr.name])]
        if isinstance(expr, Seq):
            out: list[tuple[int, int]] = []
            for e in expr.items:
                out.extend(self._syms(e, ctx))
            return out
        if isinstance(expr, Chars):
            alts = self._char_alts(expr)
            if len(alts) == 1:
                return alts[0]
            return [(NONTERM, self._new_rule(("chars", expr.ranges), "char", alts))]
        if isinstance(expr, Alt):
            alts = [self._syms(e, ctx) for e in expr.items]
            if len(alts) == 1:
                return alts[0]
            key = ("alt", tuple(tuple(a) for a in alts))
            return [(NONTERM, self._new_rule(key, ctx, alts))]
        if isinstance(expr, Rep):
            return self._rep(expr, ctx)
        raise TypeError(f"not a grammar expression: {expr!r}")

    def _rep(self, expr: Rep, ctx: str) -> list[tuple[int, int]]:
        item = tuple(self._syms(expr.item, ctx))
        lo, hi = expr.min, expr.max
        if hi is not None and hi < lo:
            raise GrammarError(f"repetition {{{lo},{hi}}} has max < min")
        if not item or hi == 0:
            return []
        self.size += len(item) * (lo + (1 if hi is None else hi - lo))
        if self.size > MAX_SYMBOLS:
            raise GrammarError(f"the grammar is too large: its repetitions expand to more than "
                               f"{MAX_SYMBOLS} symbols")
        out = list(item) * lo
        if hi is None:
            # S ::= item S | ()
            key = ("star", item)
            if key not in self.aux:
                rid = self._id(f"{ctx}-{len(self.names)}")
                self.aux[key] = rid
                self.rules[rid] = [list(item) + [(NONTERM, rid)], []]
            out.append((NONTERM, self.aux[key]))
        elif hi > lo:
            # O_k ::= item O_(k-1) | ()   (O_1 ::= item | ())
            prev = None
            for k in range(1, hi - lo + 1):
                key = ("opt", item, k)
                if key not in self.aux:
                    rid = self._id(f"{ctx}-{len(self.names)}")
                    self.aux[key] = rid
                    tail = [(NONTERM, prev)] if prev is not None else []
                    self.rules[rid] = [list(item) + tail, []]
                prev = self.aux[key]
            out.append((NONTERM, prev))
        return out

    def _check_left_recursion(self) -> None:
        rid = left_recursive_rule(self.rules)
        if rid is not None:
            name = self._user_name(rid)
            raise left_recursion(name, *self.b.where.get(name, (None, None)))

    def _user_name(self, rid: int) -> str:
        name = self.names[rid]
        base = name.rsplit("-", 1)[0] if name not in self.b.exprs else name
        return base if base in self.b.exprs else name


def without_dead_ends(rules: list[list[list[tuple[int, int]]]]) -> list:
    """The rules without their alternatives that can match nothing: those holding a terminal
    of no byte or a rule all of whose alternatives are such (an empty character class, a
    surrogate code point UTF-8 cannot write). A matcher that entered one would find no byte
    allowed, and the answer would end unparsed. A rule left without alternatives matches
    nothing (the root: the grammar matches no text)."""
    dead = [False] * len(rules)

    def dead_alt(syms) -> bool:
        return any((k == TERM and a == 0) or (k == NONTERM and dead[a]) for k, a in syms)

    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(rules):
            if not dead[r] and all(dead_alt(syms) for syms in alts):
                dead[r] = changed = True
    return [[syms for syms in alts if not dead_alt(syms)] for alts in rules]


def left_recursion(name: str, line: int | None = None,
                   column: int | None = None) -> GrammarError:
    return GrammarError(f"left recursion in rule {name!r} (a rule that can reach itself before "
                        f"matching any character)", line, column)


def left_recursive_rule(rules: list[list[list[tuple[int, int]]]]) -> int | None:
    """A rule that can reach itself before matching any byte (the matcher's expansion of it
    would never end), or None. rules[r]: rule r's alternatives, each a list of (kind, arg)."""
    nullable = [False] * len(rules)
    changed = True
    while changed:
        changed = False
        for r, alts in enumerate(rules):
            if not nullable[r] and any(all(k == NONTERM and nullable[a] for k, a in syms)
                                       for syms in alts):
                nullable[r] = changed = True
    first: list[set[int]] = []   # rules that rule r can start with without consuming input
    for alts in rules:
        s: set[int] = set()
        for syms in alts:
            for k, a in syms:
                if k != NONTERM:
                    break
                s.add(a)
                if not nullable[a]:
                    break
        first.append(s)
    color = [0] * len(rules)   # 0 new, 1 on the path, 2 done
    for start in range(len(rules)):
        if color[start]:
            continue
        stack = [(start, iter(first[start]))]
        color[start] = 1
        while stack:
            r, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                color[r] = 2
                stack.pop()
            elif color[nxt] == 1:
                return nxt
            elif color[nxt] == 0:
                color[nxt] = 1
                stack.append((nxt, iter(first[nxt])))
    return None


def checked_grammar(names: list, rules: list, root: int) -> Grammar:
    """A Grammar of rules given as data (a receipt's lowered tables, not a compiler's): the
    checks a compiler makes, made here. Raises GrammarError for rules of the wrong shape
    (kinds, rule ids, byte masks out of range), more than MAX_SYMBOLS symbols, or left
    recursion."""
    def is_int(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)
    if not (isinstance(names, list) and isinstance(rules, list) and len(names) == len(rules)
            and all(isinstance(n, str) for n in names) and is_int(root)
            and 0 <= root < len(rules)):
        raise GrammarError("the rules must be a list of rules with a name each, and the root "
                           "one of them")
    if len(rules) > MAX_RULES:
        raise GrammarError(f"the grammar is too large: more than {MAX_RULES} rules")
    size = 0
    for alts in rules:
        if not isinstance(alts, list):
            raise GrammarError("a rule must be a list of alternatives")
        for syms in alts:
            if not isinstance(syms, list):
                raise GrammarError("an alternative must be a list of symbols")
            size += len(syms) + 1
            if size > MAX_SYMBOLS:
                raise GrammarError(f"the grammar is too large: more than {MAX_SYMBOLS} symbols")
            for sym in syms:
                ok = (isinstance(sym, (list, tuple)) and len(sym) == 2 and is_int(sym[1])
                      and ((sym[0] == TERM and 0 <= sym[1] < 1 << 256)
                           or (sym[0] == NONTERM and 0 <= sym[1] < len(rules))))
                if not ok:
                    raise GrammarError(f"not a grammar symbol: {str(sym)[:80]}")
    rid = left_recursive_rule(rules)
    if rid is not None:
        raise left_recursion(names[rid])
    return Grammar(names, [[[tuple(sym) for sym in syms] for syms in alts] for alts in rules],
                   root)
