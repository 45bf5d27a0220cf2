"""A hostile client against `kinetic serve`, for the figures of issue 36: how many answers are
5xx, the slowest answer to one body, how long /health waits meanwhile (the event loop's
stalls), and the server's resident memory before and after.

    python bench/hostile.py [--bodies 300] [--big 1,4,16] [--text smollm2] [--embedding PATH]

Two servers in turn: a text model (SmolLM2, `-np 2 -c 4096`) and an embedding model (MiniLM,
../shared/models/all-MiniLM-L6-v2-f16.gguf). Against each:
- fuzzed bodies: --bodies per POST route, drawn by the suite's own strategies
  (tests/test_fuzz_routes.py: the route's fields with plausible or any JSON values, huge
  numbers, lone surrogates, spliced bytes), derandomized, so every run sends the same ones;
- big bodies of each --big size in MB: a raw prompt to /completion, spaces to /tokenize, a
  chat message, logit_bias with text keys, an embeddings input;
while a thread asks GET /health every 50 ms. Printed: answers by status class, the five
slowest answers (route, body size, seconds, status), /health's p50 and worst latency, VmRSS
and VmHWM, and the load average beside them (the machine may be shared).
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings   # noqa: E402

from bench.probes import proc_mib   # noqa: E402
from tests.serve_process import ServeProcess   # noqa: E402
from tests import test_fuzz_routes as fuzz   # noqa: E402

MINILM = ROOT.parent / "shared" / "models" / "all-MiniLM-L6-v2-f16.gguf"
TEXT_ENDPOINTS = sorted(fuzz.FIELDS)


def send(port: int, method: str, path: str, body: bytes = b"",
         timeout: float = 900.0) -> tuple[int, float]:
    """(status, seconds) of one request on a new connection; status 0: no answer."""
    began = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body or None,
                     headers={"Content-Type": "application/json"} if body else {})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.monotonic() - began
    except OSError:
        return 0, time.monotonic() - began
    finally:
        conn.close()


class HealthProbe:
    """GET /health every `every` seconds in a thread; latencies kept."""

    def __init__(self, port: int, every: float = 0.05):
        self.port, self.every, self.seconds = port, every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            status, took = send(self.port, "GET", "/health", timeout=60)
            self.seconds.append(took)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.seconds


def fuzzed(port: int, path: str, strategy, n: int, record: list) -> None:
    @settings(max_examples=n, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=strategy)
    def one(body: bytes) -> None:
        status, took = send(port, "POST", path, body)
        record.append((path, len(body), took, status))

    one()


def big_bodies(mb: int, kind: str) -> list[tuple[str, bytes]]:
    n = int((mb << 20) * 0.99)   # the JSON around the text stays under --mb's MiB (16 MiB:
                                 # the server's most; past it, a 413 and the upload cut)
    if kind == "embedding":
        return [("/v1/embeddings", json.dumps({"input": "word " * (n // 5)}).encode()),
                ("/v1/embeddings", json.dumps({"input": ["a cat"] * min(256, n // 8)}).encode())]
    words = "word " * (n // 5)
    # logit_bias with text keys: 1000 keys (the most distinct tokens a request may bias is
    # 1024) of n / 1000 bytes each, all tokenized to find their tokens
    bias = {f"{i} " + "word " * (n // 5000): 1 for i in range(1000)}
    return [("/completion", json.dumps({"prompt": words, "n_predict": 1}).encode()),
            ("/tokenize", json.dumps({"content": " " * n}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": [
                {"role": "user", "content": words}], "max_tokens": 1}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": [
                {"role": "user", "content": "hi"}], "max_tokens": 1,
                "logit_bias": bias}).encode())]


def attack(model: str, kind: str, args) -> list:
    server = ServeProcess(model, *(("-np", "2", "-c", "4096") if kind == "text" else ()))
    try:
        server.wait_ready()
        pid = server.proc.pid
        before = proc_mib(pid, "VmRSS", "VmHWM")
        probe = HealthProbe(server.port)
        record: list = []
        if kind == "text":
            for endpoint in TEXT_ENDPOINTS:
                fuzzed(server.port, fuzz.ENDPOINTS[endpoint], fuzz.bodies(endpoint),
                       args.bodies, record)
        else:
            for path in ("/v1/embeddings", "/embedding", "/api/embed", "/api/embeddings"):
                fuzzed(server.port, path, fuzz.encoder_bodies(path), args.bodies, record)
        for mb in args.big:
            for path, body in big_bodies(mb, kind):
                status, took = send(server.port, "POST", path, body)
                record.append((path, len(body), took, status))
        health = probe.stop()
        after = proc_mib(pid, "VmRSS", "VmHWM")
    finally:
        server.close()
    classes = {c: sum(1 for r in record if r[3] // 100 == c) for c in (0, 2, 4, 5)}
    print(f"\n{kind} model {Path(model).name}: {len(record)} bodies; answers 2xx "
          f"{classes[2]}, 4xx {classes[4]}, 5xx {classes[5]}, none {classes[0]}")
    for path, size, took, status in record:
        if status == 0:
            print(f"  no answer: {path} {size / 1e6:.2f} MB after {took:.2f} s")
    for path, size, took, status in sorted(record, key=lambda r: -r[2])[:5]:
        print(f"  slowest: {path} {size / 1e6:.2f} MB -> {status} in {took:.2f} s")
    if health:
        print(f"  /health while attacked: p50 {1e3 * statistics.median(health):.1f} ms, "
              f"worst {1e3 * max(health):.1f} ms over {len(health)} probes")
    print(f"  RSS {before['VmRSS']} -> {after['VmRSS']} MiB (peak {after['VmHWM']} MiB); "
          f"load {os.getloadavg()[0]:.2f}")
    return record


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=300, help="fuzzed bodies per route")
    ap.add_argument("--big", type=lambda s: [int(x) for x in s.split(",") if x],
                    default=[1, 4, 16], help="sizes of the big bodies, MB (comma-separated)")
    ap.add_argument("--text", default="smollm2", help="the text model (a pulled name or file)")
    ap.add_argument("--embedding", default=str(MINILM), help="the embedding model's file")
    args = ap.parse_args()
    from kinetic.store import resolve
    print(f"load before: {os.getloadavg()[0]:.2f}")
    attack(str(resolve(args.text)), "text", args)
    attack(args.embedding, "embedding", args)


if __name__ == "__main__":
    main()
