"""Memory of one long context: kinetic serve beside llama-server, each alone in turn, with and
without --swa-full, on the same GGUF file (default Gemma 3 270M, whose sliding-window layers
keep only their window: kinetic/engine/sliding_window.py).

Each server (`-np 1 -c N`, no RAM prompt cache) gets two requests through llama-server's
/completion route, greedy, `ignore_eos`:
  A  a prompt of --prompt-tokens random token ids, --decode-tokens generated;
  B  A's prompt and answer plus 16 new ids, 16 generated, `cache_prompt` on: a continued
     conversation, which resumes after the cached prefix (a server that cannot finds it
     out as time: B's prompt is computed again).
It prints each server's VmRSS when ready, VmHWM (peak) at the end, A's and B's wall times
and B's answer (the same ids on every kinetic run), with the load average.

    python bench/long_context.py [--model gemma3] [--llama-server PATH] [--n-ctx 16384]
        [--prompt-tokens 12000] [--decode-tokens 64] [--cache-type f16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import time
import urllib.parse
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probes import cpu_name, load_note, proc_mib, vm_hwm  # noqa: E402
from bench.servers import KineticServer, LlamaServer, find_llama_server  # noqa: E402
from bench.throughput import gguf_facts, model_path  # noqa: E402


def complete(url: str, prompt: list[int], n: int) -> tuple[list[int], float]:
    """(the generated ids, wall seconds) of one greedy /completion request."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=1800)
    body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                       "cache_prompt": True, "return_tokens": True})
    t = time.perf_counter()
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    took = time.perf_counter() - t
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {str(data)[:300]}")
    return [int(t) for t in data.get("tokens") or []], took


def measure(name: str, server, prompt: list[int], more: list[int], decode: int) -> dict:
    server.wait_ready()
    ready = proc_mib(server.pid, "VmRSS")["VmRSS"]
    answer, t_a = complete(server.url, prompt, decode)
    cont, t_b = complete(server.url, prompt + answer + more, 16)
    out = {"ready_mib": ready, "peak_mib": (vm_hwm(server.pid) or 0) >> 20,
           "rss_end_mib": proc_mib(server.pid, "VmRSS")["VmRSS"], "a_s": round(t_a, 2),
           "b_s": round(t_b, 2), "answer": answer[:8], "continued": cont[:8]}
    print(f"{name:24s} ready {ready:5d} MiB  peak {out['peak_mib']:5d} MiB  "
          f"end {out['rss_end_mib']:5d} MiB  A {t_a:6.2f} s  B {t_b:6.2f} s  "
          f"B's first ids {cont[:6]}   ({load_note()})", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3", help="a kinetic.fetch key or a GGUF path")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--n-ctx", type=int, default=16384)
    ap.add_argument("--prompt-tokens", type=int, default=12000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--cache-type", default=None, choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    path, _ = model_path(args.model)
    _, _, vocab = gguf_facts(path)
    rng = np.random.default_rng(0)
    prompt = [1] + rng.integers(100, min(vocab, 30000), args.prompt_tokens - 1).tolist()
    more = rng.integers(100, min(vocab, 30000), 16).tolist()
    print(f"{cpu_name()}; {path}; -np 1 -c {args.n_ctx}; prompt {args.prompt_tokens}, "
          f"{args.decode_tokens} generated", flush=True)
    threads = args.threads or len(__import__("os").sched_getaffinity(0))
    llama = find_llama_server(args.llama_server)
    results = {}
    runs = [("kinetic", ()), ("kinetic --swa-full", ("--swa-full",))]
    if llama:
        runs += [("llama-server", ()), ("llama-server --swa-full", ("--swa-full",))]
    for name, extra in runs:
        if name.startswith("kinetic"):
            server = KineticServer(path, parallel=1, n_ctx=args.n_ctx, draft=False,
                                   threads=threads, cache_type=args.cache_type, extra=extra)
        else:
            server = LlamaServer(llama, path, threads=threads, cache_type=args.cache_type,
                                 flags=["-c", str(args.n_ctx), "-np", "1", "--cache-ram", "0",
                                        *extra])
        try:
            results[name] = measure(name, server, prompt, more, args.decode_tokens)
        finally:
            server.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
