"""The other streams' pace while hostile grammars are refused or stopped (issue: one request
must never take the server down).

    python bench/hostile_grammar.py [--model smollm2] [--tokens 96]

Starts `kinetic serve MODEL --parallel 4`, then streams one ordinary greedy completion once
alone (the baseline) and once beside each kind of hostile `/completion`, which another client
sends again and again meanwhile, and records the gap between the stream's chunks (about one
decode step each). The hostile grammars:
  - a JSON Schema enum of 100,000 strings: past the schema's enum limit, a 400;
  - a GBNF alternation of 20,000 literals: a trie (ir.literal_trie), served;
  - a GBNF alternation of 12,000 literal-and-class sequences: its first mask overruns the
    grammar budget in the worker thread, a 400;
  - a literal longer than any token, then 12,000 such alternatives: it passes the first-mask
    check and overruns its budget in a step, so it must end alone with a 503.
Prints each hostile answer's status and time, and the stream's gap p50 / p99 / max per phase,
with the load average beside them (the machine may be shared: compare phases of one run).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.serve_process import ServeProcess  # noqa: E402


def post(port: int, path: str, body: dict, timeout: float = 120.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def stream_gaps(port: int, tokens: int) -> list[float]:
    """Seconds between the streamed chunks of one greedy completion."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    body = {"prompt": "Once upon a time, in a small village by the sea,", "n_predict": tokens,
            "temperature": 0, "stream": True}
    conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    gaps, last = [], None
    for line in resp:
        if not line.startswith(b"data: "):
            continue
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    conn.close()
    return gaps


def hostile_bodies() -> dict[str, dict]:
    literals = "root ::= " + " | ".join(f'"v{i}"' for i in range(20_000))   # under 256 KiB
    # literals each followed by a class: not a trie, 12,000 stacks to follow at once
    sequences = "root ::= " + " | ".join(f'"v{i}" [a-z]' for i in range(12_000))
    # a prefix longer than any token: the first mask never reaches the alternatives
    late = ('root ::= "kinetic-hostile-grammar-probe-xyzzy-" ('
            + " | ".join(f'"k{i}" [a-z]' for i in range(12_000)) + ')')
    return {
        "enum of 100,000 strings (json_schema)": {
            "prompt": "hi", "n_predict": 4,
            "json_schema": {"enum": [f"v{i}" for i in range(100_000)]}},
        "GBNF alternation of 20,000 literals": {"prompt": "hi", "n_predict": 4,
                                                 "grammar": literals},
        "GBNF alternation of 12,000 sequences": {"prompt": "hi", "n_predict": 4,
                                                 "grammar": sequences},
        "cheap start, 12,000 alternatives after it": {"prompt": "hi", "n_predict": 32,
                                                      "grammar": late},
    }


def summary(gaps: list[float]) -> str:
    ms = sorted(1000 * g for g in gaps)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return (f"n {len(ms)}, p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
            f"max {ms[-1]:.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    from kinetic.fetch import fetch_model
    server = ServeProcess(str(fetch_model(args.model)) if "." not in args.model else args.model,
                          "--parallel", "4")
    try:
        server.wait_ready()
        port = server.port
        stream_gaps(port, 8)   # warm up
        bodies = hostile_bodies()
        phases = [("alone", [])] + [(name, [name]) for name in bodies]
        for label, hostile in phases:
            results: list[str] = []
            stop = threading.Event()

            def attack(names=hostile):
                while not stop.is_set():
                    for name in names:
                        t = time.perf_counter()
                        status, raw = post(port, "/completion", bodies[name])
                        message = raw.decode(errors="replace")[:110]
                        results.append(f"    {name}: {status} in {time.perf_counter() - t:.2f} s"
                                       f" {message}")

            threads = [threading.Thread(target=attack, daemon=True)] if hostile else []
            for t in threads:
                t.start()
            time.sleep(0.5 if hostile else 0)
            gaps = stream_gaps(port, args.tokens)
            stop.set()
            for t in threads:
                t.join(timeout=120)
            print(f"{label}: {summary(gaps)}   load {os.getloadavg()[0]:.2f}")
            for line in results[:3]:
                print(line)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
