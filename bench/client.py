"""One streamed HTTP client for every server the benchmark runs: POST /completion,
llama-server's native route, which kinetic serves too, with the same body for both.

    run_streams(url, prompts, n)  ->  Run   (one thread and connection per prompt)

The body (completion_body): the prompt as a list of token ids, "n_predict": n,
"temperature": 0 (greedy), "ignore_eos": true (so every stream generates exactly n tokens),
"cache_prompt": false, "stream": true, "return_tokens": true. Each answer is server-sent
events, `data: {...}` per piece of text, the last with "stop": true. Both servers give
"tokens_predicted" (tokens generated so far) in every event, so tokens are counted from
it; an event that does not carry it counts its "tokens" list (or 1). kinetic's events carry
no token ids, and with drafting one event may carry several tokens.

Times are wall clock, taken here (perf_counter), never the servers' own counters:
- each stream's connection is opened first, then all streams send at once (a barrier);
- t_first: when the first event with a token arrived; t_last: when the event that brought
  the last token arrived; both seconds after that stream's sending.
Run's figures:
- ttft: time to first token of the first stream;
- decode_tps: one stream's tokens after the first per second between first and last;
- aggregate_tps: all streams' tokens / (last token of any stream - the first sending).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

import numpy as np

# words for prompts a benchmark makes up (none alike when drawn at random)
WORDS = ("river stone garden window silver morning engine yellow quiet forest market letter "
         "winter candle bridge orange summer mountain pocket thunder velvet harbor lantern "
         "meadow copper violin island shadow marble rocket canyon feather crystal").split()


@dataclass
class Stream:
    t_send: float = 0.0            # perf_counter when its request was sent
    t_first: float | None = None   # seconds after t_send
    t_last: float | None = None
    n_tokens: int = 0
    n_prompt: int | None = None    # the server's "tokens_evaluated"
    events: int = 0                # events that brought tokens
    timings: dict = field(default_factory=dict)   # the server's own, from the last event
    error: str | None = None

    def as_dict(self) -> dict:
        return {"t_first_s": self.t_first, "t_last_s": self.t_last,
                "n_tokens": self.n_tokens, "n_prompt": self.n_prompt, "events": self.events,
                "timings": self.timings, "error": self.error}


@dataclass
class Run:
    streams: list[Stream]

    @property
    def ttft(self) -> float:
        return self.streams[0].t_first

    @property
    def decode_tps(self) -> float:
        """The first stream: tokens after the first per second between first and last."""
        s = self.streams[0]
        return (s.n_tokens - 1) / max(s.t_last - s.t_first, 1e-9)

    @property
    def wall(self) -> float:
        """Seconds from the first sending to the last token of any stream."""
        t0 = min(s.t_send for s in self.streams)
        return max(s.t_send + s.t_last for s in self.streams) - t0

    @property
    def aggregate_tps(self) -> float:
        return sum(s.n_tokens for s in self.streams) / max(self.wall, 1e-9)

    def check(self, n: int) -> None:
        """Every stream generated exactly n tokens, without error (RuntimeError otherwise)."""
        for s in self.streams:
            if s.error or s.n_tokens != n or s.t_first is None:
                raise RuntimeError(f"a stream generated {s.n_tokens} tokens, not {n}"
                                   + (f": {s.error}" if s.error else ""))


def completion_body(prompt: list[int], n: int) -> dict:
    """The /completion request both servers get: greedy, exactly n tokens, streamed."""
    return {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False, "stream": True, "return_tokens": True}


def random_prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> list:
    """Distinct random token ids, away from the low ids where special tokens usually sit."""
    hi = min(vocab, 30000)
    return [rng.integers(300, hi, length).tolist() for _ in range(count)]


def _stream(host: str, port: int, body: bytes, barrier: threading.Barrier,
            out: Stream) -> None:
    conn = http.client.HTTPConnection(host, port, timeout=3600)
    try:
        try:
            conn.connect()
        finally:
            barrier.wait()   # whatever happened: the others must not wait for this one
        out.t_send = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            out.error = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue
            now = time.perf_counter() - out.t_send
            chunk = json.loads(raw[6:])
            if "error" in chunk:
                out.error = json.dumps(chunk["error"])[:300]
                return
            n = chunk.get("tokens_predicted")
            if n is None:   # a server that does not count: the ids it lists, or one
                n = out.n_tokens + (len(chunk.get("tokens") or [])
                                    or (0 if chunk.get("stop") else 1))
            if n > out.n_tokens:
                out.t_first = now if out.t_first is None else out.t_first
                out.t_last, out.n_tokens = now, n
                out.events += 1
            out.n_prompt = chunk.get("tokens_evaluated", out.n_prompt)
            if chunk.get("stop"):
                out.timings = chunk.get("timings", {})
                return
        out.error = out.error or "the answer ended without a stop event"
    except Exception as e:   # reported by Run.check
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()


def run_streams(url: str, prompts: list, n: int) -> Run:
    """One streamed /completion per prompt, all at once, each generating n tokens."""
    u = urllib.parse.urlsplit(url)
    streams = [Stream() for _ in prompts]
    barrier = threading.Barrier(len(prompts))
    threads = [threading.Thread(target=_stream, daemon=True,
                                args=(u.hostname, u.port, json.dumps(completion_body(p, n))
                                      .encode(), barrier, s))
               for p, s in zip(prompts, streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Run(streams)
