"""GBNF grammars as (grammar, accepted strings, rejected strings) tables, each string checked
byte by byte through the matcher and token by token through the masks of a byte-level
vocabulary; masks compared with a brute-force oracle; syntax errors with line and column."""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.grammar import GrammarError, Matcher, TokenVocab, compile_gbnf

# --- a byte-level vocabulary and checks shared by the grammar test files --------------------

MULTI = [b"yes", b"no", b'{"', b'":', b'",', b' "', b"true", b"null", b"false", b"12", b"123",
         b"\xc3\xa9", b"abc", b'a"', b"\n  ", b"},", b"[[", b"]]", b"00", b"-0", b'"}', b": ",
         b"ab", b"\xe2\x82", b"\xac", b"\\u", b"\\n"]
EOG = 256 + len(MULTI)        # an end-of-generation token (no bytes)
CONTROL = EOG + 1             # a control token (no bytes): never allowed


def byte_vocab() -> TokenVocab:
    """All 256 single bytes, some multi-byte tokens, an EOG token and a control token."""
    return TokenVocab([bytes([i]) for i in range(256)] + MULTI + [b"", b""], eog_ids=[EOG])


VOCAB = byte_vocab()


def greedy_tokens(vocab: TokenVocab, data: bytes) -> list[int]:
    """Longest-match tokenization (masks must allow any tokenization of a valid text)."""
    by = {b: i for i, b in enumerate(vocab.token_bytes) if b}
    out, i = [], 0
    while i < len(data):
        for n in range(min(8, len(data) - i), 0, -1):
            if data[i:i + n] in by:
                out.append(by[data[i:i + n]])
                i += n
                break
    return out


def mask_bits(m, vocab) -> np.ndarray:
    row = np.zeros(vocab.n_words, np.int32)
    m.fill_mask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab.size].astype(bool)


def accepts_bytewise(grammar, vocab, data: bytes) -> bool:
    m = Matcher(grammar, vocab)
    return all(m.accept_bytes(bytes([b])) for b in data) and m.can_end()


def accepts_by_masks(grammar, vocab, tokens: list[int]) -> bool:
    """Feeds tokens while each is allowed by the mask; at the end EOG must be allowed."""
    m = Matcher(grammar, vocab)
    for t in tokens:
        if not mask_bits(m, vocab)[t]:
            return False
        assert m.accept_token(t), "a token allowed by the mask was rejected"
    return bool(mask_bits(m, vocab)[EOG]) and m.accept_token(EOG)


def brute_force_mask(m, vocab) -> np.ndarray:
    """The mask computed the slow way, one token at a time (the test oracle)."""
    out = np.zeros(vocab.size, bool)
    for t, data in enumerate(vocab.token_bytes):
        if t in m._eog:
            out[t] = m.can_end()
        elif data and m.accept_bytes(data):
            out[t] = True
            m.rollback(1)
    return out


def check_table(grammar, accepted, rejected, vocab=VOCAB):
    for text in accepted:
        data = text.encode() if isinstance(text, str) else text
        assert accepts_bytewise(grammar, vocab, data), f"should accept {data!r}"
        assert accepts_by_masks(grammar, vocab, greedy_tokens(vocab, data)), \
            f"masks should allow {data!r} (multi-byte tokens)"
        assert accepts_by_masks(grammar, vocab, list(data)), f"masks should allow {data!r}"
    for text in rejected:
        data = text.encode() if isinstance(text, str) else text
        assert not accepts_bytewise(grammar, vocab, data), f"should reject {data!r}"
        assert not accepts_by_masks(grammar, vocab, greedy_tokens(vocab, data)), \
            f"masks should not allow {data!r}"
        assert not accepts_by_masks(grammar, vocab, list(data)), f"masks should not allow {data!r}"


# --- GBNF tables ------------------------------------------------------------------------------

GBNF_TABLE = [
    ('root ::= "yes" | "no"', ["yes", "no"], ["", "y", "yes ", "No", "yesno"]),
    ('root ::= "a" "b"? "c"', ["ac", "abc"], ["a", "abbc", "bc"]),
    ('root ::= "x"*', ["", "x", "xxxx"], ["y", "xxy"]),
    ('root ::= ("ab")+', ["ab", "abab"], ["", "a", "aba"]),
    ('root ::= "a"{3}', ["aaa"], ["aa", "aaaa"]),
    ('root ::= "a"{2,}', ["aa", "aaaaa"], ["a", ""]),
    ('root ::= "a"{1,3} "b"{0,2}', ["a", "aaab", "abb", "aaabb"], ["aaaa", "abbb", "b"]),
    ('root ::= [a-c0-9]+', ["abc", "0a9c"], ["d", "", "a-"]),
    ('root ::= [^a-z]', ["A", "0", "é", "\u20ac", "\U0001F600"], ["a", "z", "AB", ""]),
    ('root ::= [-a]+ [b-]', ["-b", "a--"], ["b", "ab-x"]),
    (r'root ::= "\x41\u00e9\n\t\\\"" [\]\[]', ['Aé\n\t\\"]', 'Aé\n\t\\"['], ['Aé\n\t\\"a']),
    (r'root ::= [\u00e0-\u00ff] [\U0001F600-\U0001F64F]', ["é\U0001F600", "à\U0001F64F"],
     ["e\U0001F600", "é\U0001F650", "é"]),
    ('root ::= . .', ["ab", "é€", "\U0001F600x"], ["a", b"\xff\xfe", b"\xc3", "abc"]),
    ('root ::= item ("," item)*\nitem ::= [0-9]+ | "\\"" [a-z]* "\\""',
     ['1', '1,"ab",22', '""'], ['1,', ',1', '"a', '1,,2']),
    # rules over several lines, comments, nested groups, recursion
    ('''
# a tiny JSON-ish grammar
root   ::= value
value  ::= object | array | "true" | "null" | num
object ::=
  "{" (
        str ":" value
    ("," str ":" value)*
  )? "}"
array  ::= "[" ( value ("," value)* )? "]"   # arrays nest
str    ::= "\\"" [a-z]* "\\""
num    ::= "-"? ([0-9] | [1-9] [0-9]+)
''', ['{}', '[]', '{"a":[1,{"b":null}],"c":-12}', '[[[[true]]]]'],
     ['{', '[1,]', '{"a"}', '{"a":01}', '[[[]]', 'nul']),
    ('root ::= a b\na ::= "x" | ""\nb ::= "y" a', ["y", "xy", "xyx", "yx"], ["x", "xx", "xyy"]),
]


@pytest.mark.parametrize("gbnf,accepted,rejected", GBNF_TABLE)
def test_gbnf_table(gbnf, accepted, rejected):
    check_table(compile_gbnf(gbnf), accepted, rejected)


@pytest.mark.parametrize("gbnf,texts", [
    (GBNF_TABLE[14][0], ['{"a":[1,{"b":null}],"c":-12}', '[[', "{", '{"ab']),
    ('root ::= [^"]* "\\"" [0-9]{0,3}', ['abc"12', 'x', 'é"']),
    ('root ::= "é" | "€" | [\U0001F600-\U0001F64F]', ["", "\U0001F600"[:1]]),
])
def test_masks_match_brute_force(gbnf, texts):
    """At every prefix of the texts, the trie-walk mask equals token-by-token checking."""
    g = compile_gbnf(gbnf)
    for text in texts:
        m = Matcher(g, VOCAB)
        for b in text.encode():
            np.testing.assert_array_equal(mask_bits(m, VOCAB), brute_force_mask(m, VOCAB))
            if not m.accept_bytes(bytes([b])):
                break
        np.testing.assert_array_equal(mask_bits(m, VOCAB), brute_force_mask(m, VOCAB))


def test_partial_utf8_tokens():
    """A token may end inside a character and the next one finish it."""
    g = compile_gbnf('root ::= "\u20ac" [0-9]')   # € is e2 82 ac
    m = Matcher(g, VOCAB)
    half = VOCAB.token_bytes.index(b"\xe2\x82")
    assert mask_bits(m, VOCAB)[half] and not mask_bits(m, VOCAB)[0xAC]
    assert m.accept_token(half)
    bits = mask_bits(m, VOCAB)
    assert bits[0xAC] and bits.sum() == 2   # the byte ac, and the token "\xac"
    assert m.accept_token(0xAC) and not m.can_end()
    assert m.accept_token(ord("7")) and m.can_end()


def test_eog_and_control_tokens():
    g = compile_gbnf('root ::= "a" "b"?')
    m = Matcher(g, VOCAB)
    bits = mask_bits(m, VOCAB)
    assert not bits[EOG] and not bits[CONTROL] and not m.accept_token(EOG)
    assert m.accept_token(ord("a"))
    bits = mask_bits(m, VOCAB)
    assert bits[EOG] and bits[ord("b")] and not bits[CONTROL] and bits.sum() == 2
    assert not m.accept_token(CONTROL)
    assert m.accept_token(EOG) and m.is_terminated()
    assert not mask_bits(m, VOCAB).any() and not m.accept_token(ord("b"))


def test_rejected_token_changes_nothing_and_rollback():
    g = compile_gbnf('root ::= "abc" "d"*')
    m = Matcher(g, VOCAB)
    assert not m.accept_token(ord("b"))
    ab = VOCAB.token_bytes.index(b"ab")
    assert m.accept_token(ab) and m.accept_token(ord("c")) and m.accept_token(ord("d"))
    assert m.can_end()
    m.rollback(2)   # back to after "ab"
    assert not m.can_end() and list(np.flatnonzero(mask_bits(m, VOCAB))) == [ord("c")]
    assert m.accept_token(ord("c")) and m.can_end()
    m.rollback(2)
    assert m.accept_token(VOCAB.token_bytes.index(b"abc"))
    with pytest.raises(ValueError):
        m.rollback(2)


def test_mask_row_shape_and_bit_order():
    g = compile_gbnf('root ::= "!"')    # byte 33: word 1, bit 1
    m = Matcher(g, VOCAB)
    row = np.full(VOCAB.n_words, -1, np.int32)
    m.fill_mask(row)
    assert row.dtype == np.int32 and len(row) == (VOCAB.size + 31) // 32
    assert row[1] == 2 and not row[0] and not row[2:].any()


def test_matchers_of_one_grammar_are_independent():
    g = compile_gbnf('root ::= "ab" | "ac"')
    m1, m2 = Matcher(g, VOCAB), Matcher(g, VOCAB)
    assert m1.accept_token(ord("a")) and m1.accept_token(ord("b"))
    assert m2.accept_token(ord("a")) and m2.accept_token(ord("c")) and m1.can_end()


@pytest.mark.parametrize("gbnf,line,column,words", [
    ('root ::= "a" |\n  "b" | ]', 2, 9, "unexpected"),
    ('root ::= "a"\nfoo ::= bar', 2, 9, "undefined rule 'bar'"),
    ('root ::= [a-', 1, 10, "unexpected"),
    ('root ::= "abc\\q"', 1, 14, "unknown escape \\q"),
    ('root ::= "\\x4"', 1, 11, "hex digits"),
    ('root ::= ("a"', 1, 14, "unexpected end"),
    ('# only a comment\nx ::= "a"', 1, 1, "no rule named 'root'"),
    ('root ::= x\nx ::= x "a"', 2, 1, "left recursion"),
    ('root ::= "a"{3,1}', 1, 13, "maximum below its minimum"),
    ('root ::= "a"\nroot ::= "b"', 2, 1, "defined twice"),
    ('root ::= [z-a]', 1, 10, "reversed"),
    ('root ::= "a" ::= "b"', 1, 14, "unexpected"),
])
def test_gbnf_errors(gbnf, line, column, words):
    with pytest.raises(GrammarError) as e:
        compile_gbnf(gbnf)
    assert (e.value.line, e.value.column) == (line, column), str(e.value)
    assert words in str(e.value) and isinstance(e.value, ValueError)
