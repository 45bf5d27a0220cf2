"""The event loop under heavy bodies (issue 36, finding 4): /health's latency while clients
send bodies whose parsing is heavy, and how long big bodies take to be answered.

    python bench/event_loop.py [--model smollm2|PATH] [--seconds 20] [--clients 2]
                               [--big-mb 16] [-- SERVE FLAGS...]

`kinetic serve MODEL` (its defaults: one slot of 4096 tokens), then:
1. idle: /health polled for 3 s, its latency (p50, p99, max);
2. `--clients` clients each sending, one after the other for `--seconds`, a 1 MB chat
   completion whose logit_bias has 1024 keys of random words (1,000 characters each: the
   parser tokenizes every key, then refuses their 600,000-odd tokens, 1,024 being the most,
   with a 400), while /health is polled: its latency and the slowest body's answer;
3. alone, each timed, with /health polled meanwhile: a `--big-mb` MB raw prompt to
   /completion (refused from its length: it cannot fit the context), the same to
   /v1/chat/completions as one message, and `--big-mb` MB of random words and of spaces
   to /tokenize (no context limit there: tokenized whole, in pieces, off the event loop).

The load (os.getloadavg()'s 1-minute figure) is printed beside each figure: the machine is
shared. Target (issue 36): /health never slower than 100 ms; no single body under 20 MB
answered after more than 10 s.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.servers import split_server_flags   # noqa: E402
from bench.throughput import model_path   # noqa: E402
from tests.serve_process import ServeProcess   # noqa: E402

def load() -> float:
    return os.getloadavg()[0]


def send(port: int, method: str, path: str, body: bytes | None = None,
         timeout: float = 1200.0) -> tuple[int, float]:
    """(status, seconds to the whole answer) of one request on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    began = time.perf_counter()
    try:
        conn.request(method, path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - began
    finally:
        conn.close()


class HealthPoller(threading.Thread):
    """GET /health every `every` seconds until stopped; `seconds` holds each latency."""

    def __init__(self, port: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.port, self.every = port, every
        self.seconds: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status, s = send(self.port, "GET", "/health", timeout=600)
            if status == 200:
                self.seconds.append(s)
            self.stop.wait(self.every)

    def summary(self) -> str:
        s = sorted(self.seconds)
        if not s:
            return "/health: no answer"
        p99 = s[min(len(s) - 1, int(0.99 * len(s)))]
        return (f"/health p50 {1e3 * statistics.median(s):6.1f} ms, p99 {1e3 * p99:6.1f} ms, "
                f"max {1e3 * s[-1]:6.1f} ms ({len(s)} polls)")


def polled(port: int):
    poller = HealthPoller(port)
    poller.start()
    return poller


def random_words(n_chars: int, seed: int) -> str:
    """`n_chars` characters of random lower-case words, from 200,000 different ones: the
    tokenizer's cache of words (65,536) helps little, as with real text of many words."""
    rng = random.Random(seed)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    pool = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(200_000)]
    return " ".join(rng.choices(pool, k=n_chars // 6 + 1))[:n_chars]


def bias_body(seed: int, n_keys: int = 1024, key_chars: int = 1000) -> bytes:
    """A chat body whose logit_bias has `n_keys` keys of text of random words, `key_chars`
    characters each."""
    text = random_words(n_keys * key_chars, seed)
    keys = {f"{i} {text[i * key_chars:(i + 1) * key_chars]}"[:key_chars]: -1
            for i in range(n_keys)}
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "logit_bias": keys}).encode()


def big_bodies(mb: int) -> list[tuple[str, str, bytes]]:
    n = mb * 1_000_000 - 200   # under --max-body-bytes (16 MiB) with the JSON around it
    text = random_words(n, 99)
    return [
        (f"{mb} MB raw prompt", "/completion",
         json.dumps({"prompt": text, "n_predict": 1}).encode()),
        (f"{mb} MB chat message", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": text}],
                     "max_tokens": 1}).encode()),
        (f"{mb} MB of words to /tokenize", "/tokenize", json.dumps({"content": text}).encode()),
        (f"{mb} MB of spaces to /tokenize", "/tokenize",
         json.dumps({"content": " " * n}).encode()),
    ]


def main(argv=None) -> int:
    argv, extra = split_server_flags(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a kinetic.fetch key or a GGUF path")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--big-mb", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma-separated labels of big bodies to skip "
                    "(substrings: raw, chat, words, spaces)")
    args = ap.parse_args(argv)

    model = model_path(args.model)[0]
    server = ServeProcess(model, *extra)
    print(f"kinetic serve {Path(model).name} {' '.join(extra)}  ({os.cpu_count()} cores)",
          flush=True)
    try:
        server.wait_ready()
        port = server.port
        send(port, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode())

        poller = polled(port)
        time.sleep(3.0)
        poller.stop.set()
        poller.join()
        print(f"idle:          {poller.summary()}   load {load():5.2f}", flush=True)

        bodies = [bias_body(seed) for seed in range(8)]
        answers: list[tuple[int, float]] = []
        end = time.monotonic() + args.seconds

        def client(k: int) -> None:
            while time.monotonic() < end:
                body = bodies[(k + len(answers)) % len(bodies)]
                answers.append(send(port, "POST", "/v1/chat/completions", body))

        poller = polled(port)
        clients = [threading.Thread(target=client, args=(k,), daemon=True)
                   for k in range(args.clients)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        poller.stop.set()
        poller.join()
        statuses = sorted({s for s, _ in answers})
        slowest = max(s for _, s in answers)
        print(f"{args.clients} clients x {len(bodies[0]) / 1e6:.2f} MB logit_bias bodies for "
              f"{args.seconds:g} s: {poller.summary()}; {len(answers)} bodies answered "
              f"{statuses}, slowest {slowest:.2f} s   load {load():5.2f}", flush=True)

        skip = [s for s in args.skip.split(",") if s]
        for label, path, data in big_bodies(args.big_mb):
            if any(s in label for s in skip):
                continue
            poller = polled(port)
            status, seconds = send(port, "POST", path, data)
            poller.stop.set()
            poller.join()
            print(f"{label}: {status} after {seconds:6.2f} s; {poller.summary()}   "
                  f"load {load():5.2f}", flush=True)
    finally:
        server.proc.terminate()
        server.proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
