"""Regular expressions (the JSON Schema `pattern` subset of ECMA-262/Python syntax) as grammar
expressions over code points.

`parse_regex(pattern)` returns (expr, anchored_start, anchored_end); the caller decides what an
unanchored end may match. Lookarounds, backreferences and word boundaries cannot be expressed
and raise RegexUnsupported naming them.
"""

from __future__ import annotations

from kinetic.grammar.ir import EMPTY, Chars, Rep, alt, chars, seq


class RegexUnsupported(ValueError):
    pass


_DIGIT = ((48, 57),)
_WORD = ((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = ((9, 13), (32, 32))
_CLASS_ESCAPES = {"d": (_DIGIT, False), "D": (_DIGIT, True), "w": (_WORD, False),
                  "W": (_WORD, True), "s": (_SPACE, False), "S": (_SPACE, True)}
_CHAR_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "0": 0, "a": 7, "e": 27}


def parse_regex(pattern: str):
    p = _Parser(pattern)
    branches = p.parse_top()
    if p.i != len(pattern):
        raise RegexUnsupported(f"unbalanced ')' in pattern {pattern!r}")
    # branches: list of (expr, start_anchor, end_anchor)
    return branches


class _Parser:
    def __init__(self, s: str):
        self.s = s
        self.i = 0

    def peek(self) -> str | None:
        return self.s[self.i] if self.i < len(self.s) else None

    def parse_top(self):
        out = []
        while True:
            start = end = False
            if self.peek() == "^":
                self.i += 1
                start = True
            items = self.parse_seq(top=True)
            if items and items[-1] == "$":
                items.pop()
                end = True
            if "$" in items:
                raise RegexUnsupported("'$' inside a pattern")
            out.append((seq(*items) if items else EMPTY, start, end))
            if self.peek() == "|":
                self.i += 1
                continue
            return out

    def parse_alt(self):
        branches = [seq(*self.parse_seq())]
        while self.peek() == "|":
            self.i += 1
            branches.append(seq(*self.parse_seq()))
        return alt(*branches)

    def parse_seq(self, top: bool = False) -> list:
        items: list = []
        while True:
            c = self.peek()
            if c is None or c in "|)":
                return items
            if c == "$":
                self.i += 1
                if not top or self.peek() not in (None, "|"):
                    raise RegexUnsupported("'$' inside a pattern")
                items.append("$")
                continue
            if c == "^":
                raise RegexUnsupported("'^' inside a pattern")
            atom = self.parse_atom()
            items.append(self.parse_quant(atom))

    def parse_quant(self, atom):
        c = self.peek()
        if c is None:
            return atom
        lo = hi = None
        if c == "*":
            lo, hi = 0, None
            self.i += 1
        elif c == "+":
            lo, hi = 1, None
            self.i += 1
        elif c == "?":
            lo, hi = 0, 1
            self.i += 1
        elif c == "{":
            j = self.s.find("}", self.i)
            body = self.s[self.i + 1:j] if j > 0 else ""
            parts = body.split(",")
            if j > 0 and 1 <= len(parts) <= 2 and parts[0].strip().isdigit() and (
                    len(parts) == 1 or parts[1].strip() == "" or parts[1].strip().isdigit()):
                lo = int(parts[0])
                hi = lo if len(parts) == 1 else (int(parts[1]) if parts[1].strip() else None)
                self.i = j + 1
            else:
                return atom   # a literal '{'
        else:
            return atom
        if self.peek() in ("?", "+"):   # lazy or possessive: the same language
            self.i += 1
        if hi is not None and hi < lo:
            raise RegexUnsupported("a repetition whose maximum is below its minimum")
        if hi is None and isinstance(atom, Rep) and atom.min <= 1:
            return Rep(atom.item, lo * atom.min, None)   # (y{0,n})* is y*, (y{1,n})+ is y+
        return Rep(atom, lo, hi)

    def parse_atom(self):
        c = self.s[self.i]
        if c == "(":
            self.i += 1
            if self.s.startswith("?:", self.i):
                self.i += 2
            elif self.s.startswith("?P<", self.i) or (self.s.startswith("?<", self.i) and
                                                     self.s[self.i + 2:self.i + 3] not in "=!"):
                j = self.s.find(">", self.i)
                self.i = j + 1
            elif self.peek() == "?":
                raise RegexUnsupported(f"the group '(?{self.s[self.i + 1:self.i + 3]}' "
                                       "(lookaround or flags)")
            inner = self.parse_alt()
            if self.peek() != ")":
                raise RegexUnsupported("unbalanced '(' in pattern")
            self.i += 1
            return inner
        if c == "[":
            return self.parse_class()
        if c == ".":
            self.i += 1
            return chars([(10, 10)], negate=True)
        if c == "\\":
            return self.parse_escape(in_class=False)
        if c in "*+?":
            raise RegexUnsupported(f"nothing to repeat before {c!r}")
        self.i += 1
        return Chars(((ord(c), ord(c)),))

    def parse_escape(self, in_class: bool):
        self.i += 1
        if self.i >= len(self.s):
            raise RegexUnsupported("a pattern ending in '\\'")
        e = self.s[self.i]
        self.i += 1
        if e in _CLASS_ESCAPES:
            rs, neg = _CLASS_ESCAPES[e]
            return chars(rs, neg)
        if e in _CHAR_ESCAPES:
            v = _CHAR_ESCAPES[e]
            return Chars(((v, v),))
        if e in "xu":
            n = 2 if e == "x" else 4
            h = self.s[self.i:self.i + n]
            try:
                v = int(h, 16)
            except ValueError:
                raise RegexUnsupported(f"bad escape \\{e}{h}") from None
            self.i += n
            return Chars(((v, v),))
        if e == "b" and in_class:
            return Chars(((8, 8),))
        if e in "bB":
            raise RegexUnsupported(f"word boundary \\{e}")
        if e.isdigit():
            raise RegexUnsupported(f"backreference \\{e}")
        if e.isalnum():
            raise RegexUnsupported(f"escape \\{e}")
        return Chars(((ord(e), ord(e)),))

    def parse_class(self):
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise RegexUnsupported("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._class_item()
            if isinstance(lo, Chars):   # \d and friends inside a class
                ranges.extend(lo.ranges)
                continue
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_item()
                if isinstance(hi, Chars) or hi < lo:
                    raise RegexUnsupported("bad character range in class")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        return chars(ranges, negate)

    def _class_item(self):
        c = self.s[self.i]
        if c == "\\":
            x = self.parse_escape(in_class=True)
            if len(x.ranges) == 1 and x.ranges[0][0] == x.ranges[0][1]:
                return x.ranges[0][0]
            return x
        self.i += 1
        return ord(c)

