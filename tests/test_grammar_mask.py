"""Masks over a real vocabulary (Qwen2.5, 151k tokens): every token the mask allows keeps the
text a valid prefix of the grammar, a sample of the tokens it refuses does not, and the text
tokenized by the real tokenizer is allowed all the way."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kinetic.grammar import Matcher, TokenVocab, compile_gbnf, compile_json_schema
from tests.conftest import real_model_file

pytestmark = pytest.mark.real_model

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}},
    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
    "required": ["name", "age", "tags", "zip"]}
TEXT = '{"name": "Ethan Hunt", "age": 25, "tags": ["a b", "\\u00e9t\\u00e9"], "zip": "75001"}'


@pytest.fixture(scope="module")
def qwen():
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(real_model_file("qwen25coder")).metadata)
    return tok, TokenVocab.from_tokenizer(tok)


def _allowed(m, vocab) -> np.ndarray:
    row = np.zeros(vocab.n_words, np.int32)
    m.fill_mask(row)
    return np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab.size].astype(bool)


def _is_prefix(grammar, vocab, data: bytes) -> bool:
    return Matcher(grammar, vocab).accept_bytes(data)


@pytest.mark.parametrize("grammar,text", [
    (compile_json_schema(SCHEMA), TEXT),
    (compile_gbnf('root ::= "yes" | "no" | [0-9]+ " apples"'), "12 apples"),
])
def test_real_vocab_masks_are_exact(qwen, grammar, text):
    tok, vocab = qwen
    ids = tok.encode(text, add_special=False)
    rng = random.Random(0)
    m = Matcher(grammar, vocab)
    done = b""
    for step, tid in enumerate(ids + [None]):
        allowed = _allowed(m, vocab)
        eog = list(tok.eog_ids)
        assert allowed[eog].all() == m.can_end() and allowed[eog].any() == m.can_end()
        if tid is None:
            assert m.can_end()
            break
        assert allowed[tid], f"step {step}: the real tokenization's {tok.token_piece(tid)!r}"
        ok_ids = [t for t in np.flatnonzero(allowed).tolist() if t not in tok.eog_ids]
        for t in rng.sample(ok_ids, min(40, len(ok_ids))):
            assert _is_prefix(grammar, vocab, done + tok.token_bytes(t)), (step, t)
        bad_ids = np.flatnonzero(~allowed).tolist()
        for t in rng.sample(bad_ids, min(40, len(bad_ids))):
            data = tok.token_bytes(t)
            assert not data or t in tok.eog_ids or not _is_prefix(grammar, vocab, done + data)
        assert m.accept_token(tid)
        done += tok.token_bytes(tid)
    assert done.decode() == text


def test_real_vocab_structural_position(qwen):
    """Right after the object's first key, only tokens that continue it are allowed."""
    tok, vocab = qwen
    g = compile_json_schema(SCHEMA)
    m = Matcher(g, vocab)
    assert m.accept_bytes(b'{"name"')
    allowed = np.flatnonzero(_allowed(m, vocab))
    pieces = {tok.token_bytes(t) for t in allowed.tolist()}
    assert b":" in pieces and b'":' not in pieces and b" :" in pieces
    assert all(p.lstrip(b" \t\n\r").startswith(b":") or not p.strip(b" \t\n\r")
               for p in pieces), sorted(pieces)[:20]


def test_a_kept_trie_loads_with_the_same_masks(qwen, tmp_path):
    """TokenVocab.from_tokenizer(cache=...): the second start loads the trie's arrays the
    first wrote (keyed by the tokens' bytes), and a grammar's masks over it are the built
    trie's; a torn file is built and written again."""
    tok, built = qwen
    first = TokenVocab.from_tokenizer(tok, cache=tmp_path)
    [path] = list(tmp_path.glob("trie-*.npz"))
    loaded = TokenVocab.from_tokenizer(tok, cache=tmp_path)
    assert loaded.size == built.size and len(loaded.levels) == len(built.levels)
    grammar = compile_json_schema(SCHEMA)
    for vocab in (first, loaded):
        a, b = Matcher(grammar, built), Matcher(grammar, vocab)
        for piece in (b"", b'{"name": "E', b'than", "age": 2'):
            assert a.accept_bytes(piece) and b.accept_bytes(piece)
            assert (_allowed(a, built) == _allowed(b, vocab)).all()
    path.write_bytes(path.read_bytes()[:1000])
    again = TokenVocab.from_tokenizer(tok, cache=tmp_path)
    assert len(again.levels) == len(built.levels) and path.stat().st_size > 1000
