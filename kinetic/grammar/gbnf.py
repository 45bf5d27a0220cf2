"""GBNF, llama.cpp's grammar language, parsed with Lark into the grammar IR.

    root   ::= answer ws          # rules: name ::= alternatives; `root` is the start
    answer ::= "yes" | "no" | [0-9]{1,3} ("." [0-9]+)?
    ws     ::= [ \\t\\n]*

Literals "..." and character classes [...] (ranges a-z, negation [^...]) take the escapes
\\xHH \\uHHHH \\UHHHHHHHH \\t \\r \\n \\\\ \\" \\[ \\]; `.` is any character; groups ( ... ); the
repetitions * + ? {m} {m,} {m,n}; `#` starts a comment. Rules may continue over several lines.
"""

from __future__ import annotations

import lark

from kinetic.grammar.ir import (ANY_CHAR, Grammar, GrammarBuilder, GrammarError, Lit, Rep, Ref,
                                alt, chars, lit, literal_trie, seq)

_GBNF = r"""
start: rule*
rule: RULEDEF alternates
alternates: sequence ("|" sequence)*
sequence: item*
item: atom QUANT?
?atom: STRING            -> literal
     | CHARCLASS         -> charclass
     | NAME              -> ref
     | "(" alternates ")" -> group
     | DOT               -> any

RULEDEF.2: /[a-zA-Z0-9_-]+[ \t]*::=/
NAME: /[a-zA-Z0-9_-]+/
STRING: /"(\\.|[^"\\\n])*"/
CHARCLASS: /\[(\\.|[^\]\\\n])*\]/
QUANT: "*" | "+" | "?" | /\{[ \t]*[0-9]+[ \t]*(,[ \t]*[0-9]*[ \t]*)?\}/
DOT: "."
COMMENT: /#[^\n]*/
%ignore COMMENT
%ignore /[ \t\r\n]+/
"""

_parser: lark.Lark | None = None

_SIMPLE_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


def _get_parser() -> lark.Lark:
    global _parser
    if _parser is None:
        _parser = lark.Lark(_GBNF, parser="lalr", propagate_positions=False,
                            maybe_placeholders=False)
    return _parser


def compile_gbnf(text: str) -> Grammar:
    """Compiles GBNF text into a Grammar; raises GrammarError with the line and column of the
    first problem."""
    grammar = gbnf_builder(text).build("root")
    grammar.source = {"type": "gbnf", "gbnf": text}
    return grammar


def gbnf_builder(text: str) -> GrammarBuilder:
    try:
        tree = _get_parser().parse(text)
    except lark.exceptions.UnexpectedCharacters as e:
        raise GrammarError(f"unexpected character {text[e.pos_in_stream]!r}"
                           if e.pos_in_stream is not None and e.pos_in_stream < len(text)
                           else "unexpected character", e.line, e.column) from None
    except lark.exceptions.UnexpectedToken as e:
        tok = e.token
        what = "end of grammar" if tok.type == "$END" else repr(str(tok))
        line, col = (tok.line, tok.column) if tok.type != "$END" else _end_position(text)
        raise GrammarError(f"unexpected {what}", line, col) from None
    except lark.exceptions.UnexpectedInput as e:  # pragma: no cover - other lark errors
        raise GrammarError(str(e), getattr(e, "line", None), getattr(e, "column", None)) from None
    b = GrammarBuilder()
    for rule in tree.children:
        head, body = rule.children
        name = head.value[:-3].rstrip(" \t")
        if name in b.exprs:
            raise GrammarError(f"rule {name!r} is defined twice", head.line, head.column)
        b.define(name, _alternates(body, b), head.line, head.column)
    return b


def _end_position(text: str) -> tuple[int, int]:
    lines = text.split("\n")
    return len(lines), len(lines[-1]) + 1


FACTORED_LITERALS = 8   # an alternation with this many string literals has them as a trie


def _alternates(tree, b: GrammarBuilder):
    items = [_sequence(s, b) for s in tree.children]
    literals = [e.data for e in items if isinstance(e, Lit)]
    if len(literals) >= FACTORED_LITERALS:   # ir.literal_trie: one stack per next byte
        items = [e for e in items if not isinstance(e, Lit)]
        items.append(literal_trie(literals, lambda expr: _rule(b, expr)))
    return alt(*items)


def _rule(b: GrammarBuilder, expr) -> Ref:
    name = b.fresh("literals")
    b.define(name, expr)
    return Ref(name)


def _sequence(tree, b: GrammarBuilder):
    return seq(*(_item(i, b) for i in tree.children))


def _item(tree, b: GrammarBuilder):
    atom = _atom(tree.children[0], b)
    if len(tree.children) == 1:
        return atom
    q = tree.children[1]
    s = q.value
    if s == "*":
        return Rep(atom, 0, None)
    if s == "+":
        return Rep(atom, 1, None)
    if s == "?":
        return Rep(atom, 0, 1)
    body = s[1:-1].replace(" ", "").replace("\t", "")
    if "," in body:
        a, b = body.split(",", 1)
        lo, hi = int(a), (int(b) if b else None)
    else:
        lo = hi = int(body)
    if hi is not None and hi < lo:
        raise GrammarError(f"repetition {s} has its maximum below its minimum", q.line, q.column)
    return Rep(atom, lo, hi)


def _atom(tree, b: GrammarBuilder):
    kind = tree.data if isinstance(tree, lark.Tree) else None
    if kind == "literal":
        tok = tree.children[0]
        cps = _decode(tok.value[1:-1], tok.line, tok.column + 1)
        return lit("".join(map(chr, cps)).encode("utf-8", "surrogatepass"))
    if kind == "charclass":
        tok = tree.children[0]
        body = tok.value[1:-1]
        negate = body.startswith("^")
        if negate:
            body = body[1:]
        cps = _decode(body, tok.line, tok.column + 1 + negate, keep_dash=True)
        ranges, i = [], 0
        while i < len(cps):
            if i + 2 < len(cps) and cps[i + 1] == -1:
                if cps[i + 2] < cps[i]:
                    raise GrammarError("character range is reversed", tok.line, tok.column)
                ranges.append((cps[i], cps[i + 2]))
                i += 3
            else:
                c = 45 if cps[i] == -1 else cps[i]   # a dash at either end is itself
                ranges.append((c, c))
                i += 1
        return chars(ranges, negate)
    if kind == "ref":
        tok = tree.children[0]
        return Ref(tok.value, tok.line, tok.column)
    if kind == "group":
        return _alternates(tree.children[0], b)
    if kind == "any":
        return ANY_CHAR
    raise GrammarError(f"unexpected {tree!r}")  # pragma: no cover


def _decode(body: str, line: int, column: int, keep_dash: bool = False) -> list[int]:
    """Code points of a literal or class body with escapes resolved; in a class, an unescaped
    '-' between two characters is returned as -1."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c == "\\":
            if i + 1 >= len(body):
                raise GrammarError("incomplete escape", line, column + i)
            e = body[i + 1]
            if e in _SIMPLE_ESCAPES:
                out.append(_SIMPLE_ESCAPES[e])
                i += 2
            elif e in _HEX_ESCAPES:
                n = _HEX_ESCAPES[e]
                digits = body[i + 2:i + 2 + n]
                if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise GrammarError(f"expected {n} hex digits after \\{e}", line, column + i)
                v = int(digits, 16)
                if v > 0x10FFFF:
                    raise GrammarError("code point out of range", line, column + i)
                out.append(v)
                i += 2 + n
            else:
                raise GrammarError(f"unknown escape \\{e}", line, column + i)
        elif c == "-" and keep_dash and 0 < i and i + 1 < len(body) and out and out[-1] != -1:
            out.append(-1)
            i += 1
        else:
            out.append(ord(c))
            i += 1
    return out
