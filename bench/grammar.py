"""Structured output costs on a real vocabulary (a benchmark, not a test).

    python bench/grammar.py [--model PATH] [--schemas DIR] [--limit N] [--decode-tokens N]
                            [--no-decode | --decode-only]

With the model's tokenizer (Qwen2.5: 151k tokens by default):

- JSON Schema: every schema of the JSONSchemaBench sample (tests/data/jsonschemabench) is
  compiled (compile time p50/p99 over the schemas that compile); for each, a valid document
  is found (the schema's own `examples` / `default` when the grammar accepts them, else a
  random walk of the grammar that finishes), tokenized with the model's tokenizer, and
  fill_mask is timed at every token along it (accept_token after each), then at the end.
  The first grammar of the process (empty caches on the vocabulary) is reported apart from
  all the later ones (the steady state: each new grammar computes only its own new states).
- Tool call: the grammar of a forced Hermes/Qwen `<tool_call>` (kinetic.chat.tool_calls, from
  the Qwen2.5 chat template) over two tools; compile time and masks along one call.
- Decode: the model greedy-decodes the same prompt unconstrained and under a JSON Schema
  (an array of 8 objects, so both runs are long), tokens/s of each after a warm-up run, and
  the ratio. Timing is from the first token to the last (prefill excluded).

Targets (printed beside the figures): mean mask <= 1 ms, p99 <= 10 ms, compile p50 <= 50 ms,
constrained decode >= 90% of unconstrained.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = os.path.expanduser("~/.cache/kinetic/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
SCHEMAS = os.path.join(ROOT, "tests", "data", "jsonschemabench")
TEMPLATE = "/work/shared/templates/Qwen-Qwen2.5-7B-Instruct.jinja"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search_flights", "description": "Flights between two airports on a date",
        "parameters": {"type": "object", "properties": {
            "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["origin", "destination", "date"]}}},
]
TOOL_CALL = ('<tool_call>\n{"name": "search_flights", "arguments": {"origin": "CDG", '
             '"destination": "JFK", "date": "2025-07-14", "passengers": 2}}\n</tool_call>')
TOOL_GBNF = r'''root ::= "<tool_call>\n{\"name\": " call "}\n</tool_call>"
call ::= "\"get_weather\", \"arguments\": " weather | "\"search_flights\", \"arguments\": " flights
weather ::= "{\"location\": " str ( ", \"unit\": " ( "\"celsius\"" | "\"fahrenheit\"" ) )? "}"
flights ::= "{\"origin\": " iata ", \"destination\": " iata ", \"date\": " date ( ", \"passengers\": " [1-9] )? "}"
iata ::= "\"" [A-Z] [A-Z] [A-Z] "\""
date ::= "\"" [0-9] [0-9] [0-9] [0-9] "-" [0-1] [0-9] "-" [0-3] [0-9] "\""
str ::= "\"" ( [^"\\\x00-\x1f] | "\\" ["\\/bfnrt] )* "\""
'''

DECODE_SCHEMA = {"type": "array", "minItems": 8, "maxItems": 8, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                 "maxItems": 3}},
    "required": ["name", "age", "email", "tags"]}}
DECODE_PROMPT = ("Write a JSON array of 8 people, each with name, age, email and a list of tags. "
                 "Answer with the JSON only.")


def stats(ms) -> str:
    a = np.asarray(ms)
    return (f"n {len(a)}, mean {a.mean():.3f} ms, p50 {np.median(a):.3f} ms, "
            f"p99 {np.percentile(a, 99):.3f} ms, max {a.max():.2f} ms")


def document(schema, grammar, rng) -> bytes | None:
    """A document the grammar accepts: the schema's example or default if it does, else a
    random walk that finishes."""
    from kinetic.grammar.matcher import accepts
    from tests.test_json_schema import random_sentence
    candidates = []
    if isinstance(schema, dict):
        candidates += [e for e in schema.get("examples") or [] if e is not None]
        if "default" in schema:
            candidates.append(schema["default"])
    for value in candidates:
        for text in (json.dumps(value, ensure_ascii=False),
                     json.dumps(value, ensure_ascii=False, separators=(",", ":"))):
            if accepts(grammar, text.encode()):
                return text.encode()
    for _ in range(5):
        text = random_sentence(grammar, rng, prefer_ascii=True)
        if text is not None:
            return text
    return None


def time_masks(grammar, vocab, ids) -> list[float] | None:
    """fill_mask at every token of ids and at the end (ms); None if a token is rejected."""
    row = np.zeros(vocab.n_words, np.int32)
    m = grammar.matcher(vocab)
    ms = []
    for tid in ids:
        t = time.perf_counter()
        m.fill_mask(row)
        ms.append((time.perf_counter() - t) * 1e3)
        if not m.accept_token(int(tid)):
            return None
    t = time.perf_counter()
    m.fill_mask(row)
    ms.append((time.perf_counter() - t) * 1e3)
    return ms if m.can_end() else None


def bench_schemas(tok, vocab, directory: str, limit: int | None) -> None:
    from kinetic.grammar import UnsupportedSchema, compile_json_schema
    files = sorted(glob.glob(os.path.join(directory, "*.json")))[:limit]
    rng = random.Random(0)
    compile_ms, first, steady, refused, no_doc = [], None, [], [], 0
    for path in files:
        with open(path) as f:
            schema = json.load(f)
        t = time.perf_counter()
        try:
            g = compile_json_schema(schema)
        except UnsupportedSchema:
            refused.append(os.path.basename(path))
            continue
        compile_ms.append((time.perf_counter() - t) * 1e3)
        text = document(schema, g, rng)
        if text is None:
            no_doc += 1
            continue
        ids = tok.encode(text.decode("utf-8"), add_special=False)
        masks = time_masks(g, vocab, ids)
        if masks is None:
            no_doc += 1
            continue
        if first is None:
            first = (os.path.basename(path), len(ids), masks)
        else:
            steady.extend(masks)
    print(f"JSONSchemaBench: {len(files)} schemas, {len(compile_ms)} compiled, "
          f"{len(refused)} refused, {len(files) - len(refused) - no_doc} with a document")
    print(f"  compile: first {compile_ms[0]:.1f} ms; p50 {np.median(compile_ms):.2f} ms, "
          f"p99 {np.percentile(compile_ms, 99):.2f} ms, max {max(compile_ms):.1f} ms"
          f"   [target p50 <= 50 ms]")
    name, n, masks = first
    print(f"  first grammar in process ({name}, {n} tokens): {stats(masks)}")
    print(f"  steady state (the other grammars): {stats(steady)}"
          f"   [target mean <= 1 ms, p99 <= 10 ms]")


def tool_grammar():
    """The forced-call grammar of kinetic.chat.tool_calls for the Qwen2.5 template, or the
    GBNF above if that module or template is not there."""
    try:
        from kinetic.chat.tool_calls import tool_format
        with open(TEMPLATE) as f:
            fmt = tool_format(f.read())
        return f"tool_format(Qwen2.5 template) = {fmt.name}", lambda: fmt.grammar(
            TOOLS, False, "none")
    except (ImportError, OSError):
        from kinetic.grammar import compile_gbnf
        return "GBNF", lambda: compile_gbnf(TOOL_GBNF)


def bench_tool_call(tok, vocab) -> None:
    label, make = tool_grammar()
    compile_ms = []
    for _ in range(20):
        t = time.perf_counter()
        make()
        compile_ms.append((time.perf_counter() - t) * 1e3)
    masks = None
    for parse_special in (True, False):
        ids = tok.encode(TOOL_CALL, add_special=False, parse_special=parse_special)
        masks = time_masks(make(), vocab, ids)
        if masks is not None:
            break
    print(f"tool call ({label}): compile p50 {np.median(compile_ms):.2f} ms, "
          f"p99 {np.percentile(compile_ms, 99):.2f} ms")
    if masks is None:
        print("  the grammar rejects the tokenized call")
        return
    print(f"  masks along one call ({len(ids)} tokens, a fresh grammar): {stats(masks)}")


def bench_decode(path: str, n: int) -> None:
    import kinetic
    from kinetic.grammar import compile_json_schema
    model = kinetic.load(path)
    if "grammar" not in kinetic.llm.Model.stream.__code__.co_varnames:
        print("decode: needs engine grammar support (Model.stream has no grammar)")
        return
    ids = model.prompt_ids([{"role": "user", "content": DECODE_PROMPT}])
    grammar = compile_json_schema(DECODE_SCHEMA)

    def run(g):
        times = []
        text = []
        for d in model.stream(ids, max_tokens=n, temperature=0, grammar=g):
            if d.token_ids:
                times.extend([time.perf_counter()] * len(d.token_ids))
            text.append(d.text)
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        return rate, len(times), "".join(text)

    run(None)
    run(grammar)   # warm-up: compiles, first masks on this vocabulary
    free_rate, free_n, _ = run(None)
    con_rate, con_n, text = run(grammar)
    try:
        json.loads(text)
        ok = "valid JSON"
    except ValueError:
        ok = "not complete JSON (max_tokens)"
    model.close()
    print(f"decode ({n} tokens max, greedy): unconstrained {free_rate:.1f} tok/s ({free_n} "
          f"tokens), constrained {con_rate:.1f} tok/s ({con_n} tokens, {ok}); ratio "
          f"{con_rate / free_rate:.2f}   [target >= 0.90]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--schemas", default=SCHEMAS)
    ap.add_argument("--limit", type=int, default=None, help="only the first N schemas")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--decode-only", action="store_true")
    args = ap.parse_args()
    from kinetic.grammar import TokenVocab
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    tok = Tokenizer.from_metadata(GGUFFile(args.model).metadata)
    t = time.perf_counter()
    vocab = TokenVocab.from_tokenizer(tok)
    print(f"{os.path.basename(args.model)}: vocabulary {tok.vocab_size} tokens, trie built in "
          f"{time.perf_counter() - t:.2f} s")
    if not args.decode_only:
        bench_schemas(tok, vocab, args.schemas, args.limit)
        bench_tool_call(tok, vocab)
    if not args.no_decode:
        bench_decode(args.model, args.decode_tokens)


if __name__ == "__main__":
    main()
