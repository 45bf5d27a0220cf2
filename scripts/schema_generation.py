"""Constrained generation on a real model over the JSONSchemaBench sample: every answer that
ended by itself must parse and validate (the jsonschema package).

    python scripts/schema_generation.py smollm2 --every 6 --max-tokens 200

Prints one line per schema (finish reason, tokens, valid or the validation error) and the
totals. Answers cut by --max-tokens are counted apart: they are unfinished, not wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "tests", "data", "jsonschemabench")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a GGUF path or a `kinetic models list` key")
    ap.add_argument("--every", type=int, default=6, help="take every Nth schema (sorted)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import kinetic
    from kinetic.fetch import model_path
    from kinetic.grammar import UnsupportedSchema, compile_json_schema
    path = args.model if os.path.exists(args.model) else model_path(args.model)
    m = kinetic.load(path, n_ctx=4096, parallel=args.parallel)
    sample = []
    for name in sorted(os.listdir(BENCH))[::args.every]:
        with open(os.path.join(BENCH, name)) as f:
            schema = json.load(f)
        try:
            sample.append((name, schema, compile_json_schema(schema)))
        except UnsupportedSchema as e:
            print(f"{name}: refused ({e})")

    def run(item):
        name, schema, grammar = item
        ask = [{"role": "user", "content": "Fill in an example JSON document for this schema:\n"
                + json.dumps(schema)[:2000]}]
        text, last = [], None
        for d in m.stream(ask, max_tokens=args.max_tokens, grammar=grammar):
            text.append(d.text)
            last = d
        return name, schema, "".join(text), last
    started = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(run, sample))
    counts = {"valid": 0, "invalid": 0, "length": 0}
    tokens = 0
    for name, schema, text, last in results:
        tokens += last.usage.completion_tokens
        if last.finish_reason != "stop":
            counts["length"] += 1
            print(f"{name}: {last.finish_reason} after {last.usage.completion_tokens} tokens")
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
            counts["valid"] += 1
            print(f"{name}: valid ({last.usage.completion_tokens} tokens)")
        except (ValueError, jsonschema.ValidationError) as e:
            counts["invalid"] += 1
            print(f"{name}: INVALID: {str(e).splitlines()[0]}\n  {text!r}")
    finished = counts["valid"] + counts["invalid"]
    print(f"\n{len(sample)} schemas: {finished} finished, {counts['valid']} of them valid, "
          f"{counts['invalid']} invalid; {counts['length']} cut by max_tokens; {tokens} tokens "
          f"in {time.perf_counter() - started:.0f} s")
    m.close()
    return 1 if counts["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
