"""Where a kinetic server's resident memory goes while it serves: `kinetic serve` with the
throughput benchmark's flags (bench/servers.py KineticServer: `-np 16 -c 16*2048 --cache-ram
0`, drafting off unless --draft), then rounds of K concurrent streamed completions (the
benchmark's requests: random token prompts, greedy, `ignore_eos`), printing the server's
/proc/PID/status after it is ready and after each round: VmHWM (the peak the throughput
benchmark reports), VmRSS, RssAnon (the heap, the KV pages written, JAX's runtime and
executables) and RssFile (the mapped GGUF file and the shared libraries).

    python bench/memory.py [--model gemma3|qwen25coder|smollm2|PATH] [--rounds 1,4,8,16,1,4,8,16]
                           [--prompt-tokens 16] [--decode-tokens 64] [--draft]

The second pass of rounds shows what serving keeps: pages of released prompts held for the
prefix cache (at most one slot's context of them, kinetic/engine/kv_cache.py), heap blocks the
C library keeps after frees. Memory figures do not depend on the machine's load, so this runs
alone (no llama-server: bench/throughput.py prints llama-server's peak beside kinetic's).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client import random_prompts, run_streams   # noqa: E402
from bench.probes import proc_mib   # noqa: E402
from bench.servers import KineticServer   # noqa: E402
from bench.throughput import gguf_facts, model_path   # noqa: E402

FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile")


def rounds_list(text: str) -> list[int]:
    """Stream counts in the order given, repeats kept."""
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError("stream counts must be at least 1")
    return ks


def show(label: str, pid: int) -> None:
    s = proc_mib(pid, *FIELDS)
    print(f"{label:<24}" + "".join(f"{name} {s.get(name, 0):>5}  " for name in FIELDS), flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3", help="a kinetic.fetch key or a GGUF path")
    ap.add_argument("--rounds", type=rounds_list, default=[1, 4, 8, 16, 1, 4, 8, 16],
                    metavar="K,K,..", help="concurrent streams of each round")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--draft", action="store_true", help="n-gram drafting on (kinetic's default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if max(args.rounds) > args.parallel:
        ap.error(f"a round of {max(args.rounds)} streams needs --parallel >= that")

    path, label = model_path(args.model)
    _, _, vocab = gguf_facts(path)
    server = KineticServer(path, parallel=args.parallel, n_ctx=args.n_ctx, draft=args.draft,
                           threads=args.threads)
    print(f"{label}: {' '.join(server.cmd)}", flush=True)
    rng = np.random.default_rng(args.seed)
    try:
        server.wait_ready()
        show("ready", server.pid)
        for k in args.rounds:
            run_streams(server.url, random_prompts(rng, k, args.prompt_tokens, vocab),
                        args.decode_tokens).check(args.decode_tokens)
            show(f"after {k} stream{'s' if k > 1 else ''}", server.pid)
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
