"""Whether a kinetic server's resident memory stops growing under batch requests (issue 36):
`kinetic serve MODEL -np 2` (plus any flags after `--`), then N POST /completion requests one
after the other, each with `"prompt"` a list of K short prompts (different sentences, about 24
tokens each; no two batches alike, so every batch's prompts are new to the prefix cache),
printing the server's VmRSS and RssAnon (/proc/PID/status, MiB) after it is ready and after
each batch, then the growth after the first batch.

    python bench/memory_batches.py [--model smollm2|PATH] [--batches 20] [--prompts 64]
                                   [--n-predict 16] [--parallel 2] [-- SERVE FLAGS...]

The first batch pays for what serving keeps once (the KV pages written, the host prompt cache
filling up to --cache-ram, glibc's heap at its working size); what comes after it should be
flat. Memory figures do not depend on the machine's load, so this may run beside other work.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client import WORDS   # noqa: E402
from bench.probes import proc_mib   # noqa: E402
from bench.servers import split_server_flags   # noqa: E402
from bench.throughput import model_path   # noqa: E402
from tests.serve_process import ServeProcess   # noqa: E402



def prompts(rng: np.random.Generator, batch: int, k: int) -> list[str]:
    """k different sentences of about 24 tokens, none alike across batches."""
    return [f"Batch {batch} note {i}: write one line about the "
            + " ".join(rng.choice(WORDS, 12)) + "." for i in range(k)]


def completion(url: str, body: dict) -> list:
    req = urllib.request.Request(url + "/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    assert isinstance(out, list) and len(out) == len(body["prompt"]), str(out)[:300]
    return out


def main(argv=None) -> int:
    argv, extra = split_server_flags(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="a kinetic.fetch key or a GGUF path")
    ap.add_argument("--batches", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64, help="prompts per request")
    ap.add_argument("--n-predict", type=int, default=16)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    flags = ["--parallel", str(args.parallel), *extra]
    server = ServeProcess(model_path(args.model)[0], *flags)
    print(f"kinetic serve {args.model} {' '.join(flags)}: {args.batches} batches of "
          f"{args.prompts} prompts, n_predict {args.n_predict}", flush=True)
    rng = np.random.default_rng(args.seed)
    try:
        server.wait_ready()
        s = proc_mib(server.proc.pid, "VmRSS", "RssAnon")
        print(f"{'ready':<10} VmRSS {s['VmRSS']:>6}  RssAnon {s['RssAnon']:>6}", flush=True)
        rss = []
        for b in range(args.batches):
            completion(server.url, {"prompt": prompts(rng, b, args.prompts),
                                    "n_predict": args.n_predict, "temperature": 0})
            s = proc_mib(server.proc.pid, "VmRSS", "RssAnon")
            rss.append(s["VmRSS"])
            print(f"batch {b + 1:<4} VmRSS {s['VmRSS']:>6}  RssAnon {s['RssAnon']:>6}",
                  flush=True)
        print(f"growth after the first batch: {rss[-1] - rss[0]} MiB "
              f"(most {max(rss) - rss[0]} MiB)")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
