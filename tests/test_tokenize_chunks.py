"""Long texts (kinetic/text/chunks.py): `Tokenizer.encode_chunks` gives exactly encode()'s ids,
however small the pieces, on llama.cpp's vocab test vectors and on long random texts built
to stress the cuts (runs of one character, special tokens' text, written ▁, bytes without a
token); and `Tokenizer.min_tokens` never exceeds the true count, and is close to it on a
text of the longest token repeated."""

from __future__ import annotations

import random

import pytest

from kinetic.text.chunks import CHUNK_CHARS, cut
from tests.test_tokenizer import VOCABS, real, vectors, vocab   # noqa: F401 (a fixture)

SIZES = (1, 2, 5, 64)


def chunked(tok, text: str, size: int, add_special: bool = False,
            parse_special: bool = False) -> list[int]:
    out: list[int] = []
    for ids in tok.encode_chunks(text, add_special, parse_special, size):
        out.extend(ids)
    return out


@pytest.mark.parametrize("name", VOCABS)
def test_chunks_give_the_vectors_ids(name):
    tok = vocab(name)
    for size in SIZES:
        wrong = [(text, want) for text, want in vectors(name)
                 if chunked(tok, text, size) != want]
        assert not wrong, f"size {size}: {len(wrong)} texts differ, first: {wrong[0]!r}"


@pytest.mark.real_model
def test_chunks_give_llama_servers_ids_on_the_real_models(real):
    tok, ref = real
    for case in ref["tokenize"]:
        for size in SIZES:
            assert chunked(tok, case["text"], size) == case["ids"]
            assert (chunked(tok, case["text"], size, True, True)
                    == case["ids_add_special_parse_special"])
    rng = random.Random(0)
    text = random_text(tok, rng, 600)
    assert chunked(tok, text, 7, True, True) == tok.encode(text, True, True)
    assert tok.min_tokens(text, True) <= len(tok.encode(text, False, True))


def random_text(tok, rng: random.Random, n_parts: int) -> str:
    """Prose, code, runs of one character, other scripts, the text of special tokens,
    written ▁ and control characters, mixed."""
    v = tok._v
    specials = [v.tokens[t] for t in v.special_ids_longest_first][:50] or ["<s>"]
    words = ["the", "The", " quick", "brown", "fox's", "naïve", "café", "über", "日本語",
             "テキスト", "привет", "مرحبا", "🙂", "👍🏽", "x=1;", "def f(a, b):", "12345678",
             "3.14159", "\u2581", "\u2581\u2581x", "'s", "'ll", "\u00a0", "\u200b", "\x00",
             "\x04", "\x7f", "é", "e\u0301"]
    runs = [" ", "\n", "\t", "=", "-", "a", "0", "\u2581", "日", ".", "\r\n", " \n"]
    parts = []
    for _ in range(n_parts):
        kind = rng.random()
        if kind < 0.55:
            parts.append(rng.choice(words) + rng.choice(["", " ", "  ", "\n", ", "]))
        elif kind < 0.8:
            parts.append(rng.choice(runs) * rng.choice([2, 3, 17, 64, 130, 400, 1500]))
        elif kind < 0.9:
            parts.append(rng.choice(specials))
        else:
            parts.append(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800),
                                         rng.randrange(0x800, 0xD800),
                                         rng.randrange(0x10000, 0x20000)])))
    return "".join(parts)


@pytest.mark.parametrize("name", VOCABS)
def test_chunks_of_long_random_texts(name):
    tok = vocab(name)
    rng = random.Random(name)
    for i in range(3):
        text = random_text(tok, rng, 600)
        for add_special, parse_special in ((False, False), (True, True)):
            whole = tok.encode(text, add_special, parse_special)
            for size in (7, 300, CHUNK_CHARS):
                got = chunked(tok, text, size, add_special, parse_special)
                assert got == whole, (name, i, size, add_special, parse_special)


@pytest.mark.parametrize("name", VOCABS)
def test_chunks_come_in_pieces(name):
    # a long text comes in many pieces, a run of one character too where cuts are safe
    tok = vocab(name)
    text = "The quick brown fox jumps over the lazy dog. " * 200
    assert sum(1 for _ in tok.encode_chunks(text, size=100)) > 50


def test_a_cut_never_falls_between_characters_that_can_merge():
    junctions = frozenset({"ab", "bb"})
    text = "abbbbbbbcab" * 3
    pieces = list(cut(text, 2, junctions))
    assert "".join(pieces) == text
    for left, right in zip(pieces, pieces[1:]):
        assert left[-1] + right[0] not in junctions
    assert pieces[0] == "abbbbbbb"   # the run of b is jumped, not cut inside
    assert list(cut("aaaa", 1, frozenset({"aa"}))) == ["aaaa"]


@pytest.mark.parametrize("name", VOCABS)
def test_min_tokens_is_a_lower_bound(name):
    tok = vocab(name)
    rng = random.Random(f"{name}-bound")
    texts = [t for t, _ in vectors(name)] + [random_text(tok, rng, 300) for _ in range(3)]
    for parse_special in (False, True):
        for text in texts:
            n = len(tok.encode(text, add_special=False, parse_special=parse_special))
            assert tok.min_tokens(text, parse_special) <= n, (name, text[:80])


@pytest.mark.parametrize("name", VOCABS)
def test_min_tokens_is_tight_on_the_longest_token(name):
    # a text of the vocabulary's longest normal token, repeated: the bound is near the count
    # (a vocabulary without a bound gives 0)
    tok = vocab(name)
    v = tok._v
    normal = [t for t in range(len(v.tokens)) if t not in set(v.special_ids_longest_first)]
    longest = max(normal, key=lambda t: len(tok.token_bytes(t)))
    text = tok.token_bytes(longest).decode("utf-8", "replace") * 50
    n = len(tok.encode(text, add_special=False))
    bound = tok.min_tokens(text)
    assert bound <= n
    if name == "bert-bge":   # WordPiece drops whitespace: no bound
        assert bound == 0
    elif name == "phi-3":    # its control tokens strip the spaces after them: none once parsed
        assert tok.min_tokens(text, parse_special=True) == 0 and bound >= n // 4
    else:
        assert bound >= n // 4, (name, bound, n)


def test_bytes_without_a_token_are_not_counted():
    # SmolLM2-style: a byte whose character is not in a byte-level vocabulary vanishes, so a
    # text of it may have no token at all; the bound must allow that
    tok = vocab("gpt-2")
    bound = tok._bounds.get(False) or (tok.min_tokens("x"), tok._bounds[False])[1]
    assert bound.silent == b""   # GPT-2 has every byte
    text = "\x04" * 1000
    from kinetic.text.chunks import PieceBound
    assert PieceBound(4, b"\x04").min_tokens(text) == 0
    assert PieceBound(4, b"\x04").min_tokens(text + "abcdefgh") == 2


@pytest.mark.parametrize("name", ["llama-bpe", "llama-spm"])
def test_a_long_run_is_merged_whole_and_can_be_stopped(name):
    # a run of spaces joins with itself everywhere (not in GPT-2: it has no "ĠĠ"): no safe
    # cut, one long piece, merged by chunks.bpe_merge / spm_merge (the same ids), which call
    # check() as they go
    tok = vocab(name)
    text = "x" + " " * 40_000 + "y"
    assert chunked(tok, text, 1000) == tok.encode(text, add_special=False)
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt   # anything the caller raises comes out of encode_chunks

    with pytest.raises(KeyboardInterrupt):
        for _ in tok.encode_chunks(text, add_special=False, size=1000, check=check):
            pass
    assert len(calls) == 2
