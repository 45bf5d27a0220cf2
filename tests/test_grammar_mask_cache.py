"""The local-walk caches of the mask computation (kinetic/grammar/matcher.py) change no mask:
masks with every local walk shared across grammars (signatures of any size, the top
LOCAL_FRAMES frames), with none shared (every walk cached per grammar from the top frame) and
with the default split are the same, along texts of grammars big enough to have both kinds,
over a byte vocabulary (checked against a brute-force mask too) and real tokenizer vocabularies.
"""

from __future__ import annotations


import numpy as np
import pytest

from kinetic.grammar import Matcher, TokenVocab, compile_gbnf, compile_json_schema
from kinetic.grammar import matcher as M
from tests.tiny_models import vocab_file


# An object with enough properties that the rest of it reaches more than SHARED_RULES rules.
BIG = {"type": "object", "properties": {
    **{f"p{i}": {"type": ["string", "integer", "boolean", "null"][i % 4]} for i in range(40)},
    "name": {"type": "string", "maxLength": 12},
    "inner": {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "number"}},
        "b": {"type": "string", "pattern": "^[a-z]{2,4}$"}}, "required": ["a", "b"]}},
    "required": ["name", "inner", "p0", "p1", "p2", "p3"]}
BIG_TEXT = ('{"p0": "s", "p1": 12, "p2": true, "p3": null, "p5": 7, '
            '"name": "Ann \\u00e9 B", "inner": {"a": [1, -2.5e3], "b": "xyz"}}')
GBNF = r'''root ::= "[" item ("," ws item)* "]"
item ::= str | num | "{" ws str ws ":" ws item ws "}"
str ::= "\"" ( [^"\\] | "\\" ["\\nt] )* "\""
num ::= "-"? [0-9]+ ("." [0-9]+)?
ws ::= [ \t\n]*'''
GBNF_TEXT = '[{"k": "v\\n"}, 12.5, {"x":{"y": -3}}, "end"]'
CASES = [(BIG, BIG_TEXT), (GBNF, GBNF_TEXT)]


def _compile(spec):
    return compile_gbnf(spec) if isinstance(spec, str) else compile_json_schema(spec)


def _masks(spec, text: str, vocab, shared_rules, monkeypatch, stride=1) -> list[np.ndarray]:
    """The mask at every `stride`-th byte of text, with a fresh grammar and empty caches."""
    monkeypatch.setattr(M, "SHARED_RULES", shared_rules)
    vocab.local_walks.clear()
    m = Matcher(_compile(spec), vocab)
    row = np.zeros(vocab.n_words, np.int32)
    out = []
    data = text.encode()
    for i, b in enumerate(data):
        if i % stride == 0:
            m.fill_mask(row)
            out.append(row.copy())
        assert m.accept_bytes(bytes([b]))
    m.fill_mask(row)
    out.append(row.copy())
    assert m.can_end()
    return out


def _check_same(spec, text, vocab, monkeypatch, stride=1):
    default = _masks(spec, text, vocab, M.SHARED_RULES, monkeypatch, stride)
    everything = _masks(spec, text, vocab, 10 ** 9, monkeypatch, stride)
    nothing = _masks(spec, text, vocab, 0, monkeypatch, stride)
    for i, (a, b, c) in enumerate(zip(default, everything, nothing)):
        assert np.array_equal(a, b) and np.array_equal(a, c), f"mask {i} differs"
    return default


def _byte_vocab() -> list[bytes]:
    extra = [b'{"', b'": ', b'", "', b'name', b'"p1": ', b'true', b'null}', b'12', b', "',
             b'\\u00', b'e9', b'-2.5', b'e3]', b'}, ', b'"}', b' "', b'": "', b'xyz"',
             b'[{', b'}}', b'\\n"', b'": -', b'ABC', b'\xc3\xa9']
    return [bytes([i]) for i in range(256)] + extra


@pytest.mark.parametrize("spec,text", CASES)
def test_byte_vocab_masks_same_and_exact(spec, text, monkeypatch):
    tokens = _byte_vocab() + [b""]
    vocab = TokenVocab(tokens, eog_ids=[len(tokens) - 1])
    masks = _check_same(spec, text, vocab, monkeypatch)
    g = _compile(spec)
    data = text.encode()
    for i, row in enumerate(masks):
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab.size].astype(bool)
        m = Matcher(g, vocab)
        assert m.accept_bytes(data[:i])
        for t, tb in enumerate(tokens):
            want = m.can_end() if not tb else Matcher(g, vocab).accept_bytes(data[:i] + tb)
            assert bits[t] == want, (i, tb)


@pytest.mark.parametrize("name", ["gpt-2", "llama-spm", "qwen2"])
def test_real_vocab_masks_same(name, monkeypatch):
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    path = vocab_file(name)
    vocab = TokenVocab.from_tokenizer(Tokenizer.from_metadata(GGUFFile(path).metadata))
    for spec, text in CASES:
        _check_same(spec, text, vocab, monkeypatch, stride=3)
