"""Mask and compile timings on a real vocabulary (a benchmark, not a test):

    python -m kinetic.grammar.bench ~/.cache/kinetic/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Generates a JSON answer token by token (the tokenizer's own tokenization of a fixed text) under
a schema, timing fill_mask at every step: once with a fresh process-wide cache (the first
grammar on this vocabulary) and once more with a freshly compiled grammar (what every later
request sees: only its own new states are computed).
"""

from __future__ import annotations

import sys
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
TEXT = ('{"name": "Ethan Hunt the third of his name", "age": 25, "tags": ["a", "bb", '
        '"hello world"], "address": {"city": "Paris", "zip": "75001"}}')


def main(path: str) -> None:
    from kinetic.grammar import TokenVocab, compile_json_schema
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(path).metadata)
    t = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tok)
    print(f"vocabulary {tok.vocab_size} tokens, trie built in {time.perf_counter() - t:.2f} s")
    compile_ms = []
    for _ in range(20):
        t = time.perf_counter()
        compile_json_schema(SCHEMA)
        compile_ms.append((time.perf_counter() - t) * 1e3)
    print(f"compile p50 {np.median(compile_ms):.2f} ms")
    ids = tok.encode(TEXT, add_special=False)
    row = np.zeros(vocab.n_words, np.int32)
    for label in ("first grammar on this vocabulary", "a later grammar"):
        m = compile_json_schema(SCHEMA).matcher(vocab)
        ms = []
        for tid in ids:
            t = time.perf_counter()
            m.fill_mask(row)
            ms.append((time.perf_counter() - t) * 1e3)
            assert m.accept_token(tid)
        a = np.array(ms)
        print(f"{label}: {len(a)} masks, mean {a.mean():.2f} ms, p50 {np.median(a):.2f} ms, "
              f"p99 {np.percentile(a, 99):.2f} ms, max {a.max():.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
