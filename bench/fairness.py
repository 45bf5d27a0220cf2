"""Fairness (issue 36): how long one small request waits while a big one runs.

    python bench/fairness.py [--model smollm2|PATH] [--prompts 256] [--n-predict 32]
                             [--probes 5] [-- SERVE FLAGS...]
    python bench/fairness.py --embeddings [--model PATH] [--texts 256] [--tokens 512]

Generation: `kinetic serve MODEL` (its default slots unless given after `--`), one POST
/completion with a list of K prompts (different sentences, n_predict N) in the background,
and meanwhile, one after the other, P streamed one-token chat completions: each one's time
to first token (the first content event), with os.getloadavg()'s 1-minute figure beside it.
Before the big request, the same chat alone gives the idle figure. The scheduler admits
waiting prompts round-robin across requests (kinetic/engine/fairness.py), so a chat waits
for the next free slot, not for the K prompts.

Embeddings (--embeddings): one POST /v1/embeddings of T texts of L tokens each in the
background, and meanwhile P one-token /v1/embeddings requests, each one's time to its answer.
Without --model, a random-weight BERT of all-MiniLM-L6-v2's shape (6 layers of 384, f16,
context 512, built by tests/embedding_models.py under /tmp). Requests take turns an encoder
step at a time (kinetic/api/embeddings.py), so the small one waits for about one step.

The figures are wall-clock times on a shared machine: the load beside them says how busy it
was. Target on this 2-core machine: a chat's first token in under 2 s during the 256 prompts.
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client import WORDS   # noqa: E402
from bench.servers import split_server_flags   # noqa: E402
from bench.throughput import model_path   # noqa: E402
from tests.serve_process import ServeProcess   # noqa: E402

_chats = iter(range(1 << 30))


def chat() -> dict:
    """A one-token chat whose last words are new to the prefix cache, as a new user's are."""
    n = next(_chats)
    return {"messages": [{"role": "user", "content": f"Say hi to {WORDS[n % 32]} number {n}."}],
            "max_tokens": 1, "temperature": 0, "stream": True}


def load() -> float:
    return os.getloadavg()[0]


def post(port: int, path: str, body: dict, timeout: float = 3600.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:300]
        return json.loads(data)
    finally:
        conn.close()


def first_token_seconds(port: int) -> float:
    """Seconds from sending the streamed one-token chat to its first content event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    began = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(chat()),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()[:300]
        while True:
            line = resp.readline()
            if not line:
                raise AssertionError("the stream ended with no content")
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    return time.perf_counter() - began
    finally:
        conn.close()


def small_embedding_seconds(port: int) -> float:
    began = time.perf_counter()
    post(port, "/v1/embeddings", {"input": [[101]]})
    return time.perf_counter() - began


class Background(threading.Thread):
    """One big request, timed; `error` holds what went wrong."""

    def __init__(self, port: int, path: str, body: dict):
        super().__init__(daemon=True)
        self.port, self.path, self.body = port, path, body
        self.seconds = self.error = None

    def run(self) -> None:
        began = time.perf_counter()
        try:
            post(self.port, self.path, self.body)
            self.seconds = time.perf_counter() - began
        except Exception as e:   # reported by main
            self.error = e


def probe(server: ServeProcess, big: Background, measure, probes: int) -> list[float]:
    """`probes` timings of measure(port) while `big` runs (the first after it has been
    going for a second), each printed with the load."""
    big.start()
    time.sleep(1.0)
    out = []
    for i in range(probes):
        if not big.is_alive():
            print(f"  (the big request ended after {i} probes)")
            break
        s = measure(server.port)
        out.append(s)
        print(f"  probe {i + 1}: {s:6.3f} s   load {load():5.2f}", flush=True)
        time.sleep(0.5)
    return out


def minilm_shaped() -> str:
    from tests.embedding_models import write_bert
    path = Path("/tmp/kinetic-fairness/minilm-shaped-f16.gguf")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_bert(path, pooling="mean", dtype="f16", n_layer=6, d_model=384, n_head=12,
                   d_ffn=1536, context_length=512)
    return str(path)


def main(argv=None) -> int:
    argv, extra = split_server_flags(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a kinetic.fetch key or a GGUF path "
                    "(default smollm2, or with --embeddings a MiniLM-shaped random BERT)")
    ap.add_argument("--embeddings", action="store_true")
    ap.add_argument("--prompts", type=int, default=256, help="prompts of the big /completion")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--texts", type=int, default=256, help="texts of the big /v1/embeddings")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of each of those texts")
    ap.add_argument("--probes", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    model = args.model or ("" if args.embeddings else "smollm2")
    model = minilm_shaped() if not model else model_path(model)[0]
    server = ServeProcess(model, *extra)
    rng = np.random.default_rng(args.seed)
    print(f"kinetic serve {Path(model).name} {' '.join(extra)}  ({os.cpu_count()} cores)",
          flush=True)
    try:
        server.wait_ready()
        if args.embeddings:
            measure, what = small_embedding_seconds, "one-token /v1/embeddings answer"
            texts = [[int(t) for t in rng.integers(1000, 20000, args.tokens)]
                     for _ in range(args.texts)]
            big = Background(server.port, "/v1/embeddings", {"input": texts})
            label = f"/v1/embeddings of {args.texts} x {args.tokens} tokens"
        else:
            measure, what = first_token_seconds, "one-token chat, time to first token"
            prompts = [f"Note {i}: write one line about the " + " ".join(rng.choice(WORDS, 12))
                       for i in range(args.prompts)]
            big = Background(server.port, "/completion",
                             {"prompt": prompts, "n_predict": args.n_predict,
                              "temperature": 0})
            label = f"/completion of {args.prompts} prompts, n_predict {args.n_predict}"
        measure(server.port)   # warm
        idle = [measure(server.port) for _ in range(3)]
        print(f"{what}, idle: {min(idle):.3f} s (best of 3)   load {load():5.2f}", flush=True)
        print(f"{what}, while a {label} runs:", flush=True)
        busy = probe(server, big, measure, args.probes)
        big.join()
        if big.error is not None:
            raise big.error
        print(f"the big request took {big.seconds:.1f} s   load {load():5.2f}")
        if busy:
            print(f"RESULT {what}: median {statistics.median(busy):.3f} s, most "
                  f"{max(busy):.3f} s, during the big request (idle {min(idle):.3f} s); "
                  f"load {load():.2f} on {os.cpu_count()} cores")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
