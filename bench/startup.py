"""Start-up time: `kinetic serve` cold (an empty compile cache) and warm (a second start that
loads what the first compiled: kinetic/compile_cache.py), beside llama-server's start, and
the one-shot `kinetic run` cold and warm; each process alone in turn, on the same GGUF file.

A start is timed from the process's spawn to the first 200 of its health route (kinetic:
/v1/health, after every step shape is ready; llama-server: /health); `kinetic run` from
spawn to exit (8 greedy tokens of "Hello"). Each server runs with its own defaults plus
`-np --parallel -c --parallel*2048` (kinetic also `--cache-ram 0`). Prints the figures
with VmRSS at ready and the load average.

    python bench/startup.py [--model smollm2 ...] [--llama-server PATH] [--parallel 4]
        [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probes import cpu_name, load_note, proc_mib  # noqa: E402
from bench.servers import LlamaServer, find_llama_server  # noqa: E402
from bench.throughput import model_path  # noqa: E402
from tests.serve_process import ServeProcess  # noqa: E402


def kinetic_start(gguf: str, parallel: int, cache: str) -> tuple[float, float | None]:
    """(seconds to /v1/health 200, VmRSS MiB then) of one `kinetic serve`."""
    os.environ["KINETIC_COMPILE_CACHE_DIR"] = cache
    start = time.monotonic()
    serve = ServeProcess(gguf, "-np", str(parallel), "-c", str(2048 * parallel),
                         "--cache-ram", "0")
    try:
        serve.wait_ready(1800, poll=0.02)   # the figure to 20 ms, not the default 0.5 s
        took = time.monotonic() - start
        return took, proc_mib(serve.proc.pid, "VmRSS").get("VmRSS")
    finally:
        serve.close()


def llama_start(binary: str, gguf: str, parallel: int) -> tuple[float, float | None]:
    start = time.monotonic()
    server = LlamaServer(binary, gguf, threads=os.cpu_count() or 1, parallel=parallel,
                         n_ctx=2048)
    try:
        server.wait_ready(poll=0.02)
        took = time.monotonic() - start
        return took, proc_mib(server.pid, "VmRSS").get("VmRSS")
    finally:
        server.close()


def kinetic_run(gguf: str, cache: str) -> float:
    env = {**os.environ, "KINETIC_COMPILE_CACHE_DIR": cache}
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "kinetic.cli", "run", gguf, "Hello", "-n", "8"],
                   env=env, check=True, capture_output=True)
    return time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["smollm2", "gemma3", "qwen25coder"])
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: found)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="warm starts per model (best kept)")
    args = ap.parse_args()
    binary = find_llama_server(args.llama_server)
    print(f"# {cpu_name()}, {os.cpu_count()} CPUs; -np {args.parallel}")
    for name in args.model:
        gguf, _ = model_path(name)
        with tempfile.TemporaryDirectory(prefix="kinetic-startup-") as cache:
            print(f"## {name}  ({load_note()})", flush=True)
            if binary:
                t, rss = llama_start(binary, gguf, args.parallel)
                print(f"llama-server     ready {t:6.2f} s  VmRSS {rss} MiB", flush=True)
            t, rss = kinetic_start(gguf, args.parallel, cache)
            print(f"kinetic cold     ready {t:6.2f} s  VmRSS {rss} MiB", flush=True)
            warm = [kinetic_start(gguf, args.parallel, cache) for _ in range(args.reps)]
            t, rss = min(warm)
            print(f"kinetic warm     ready {t:6.2f} s  VmRSS {rss} MiB "
                  f"(all: {', '.join(f'{w:.2f}' for w, _ in warm)})", flush=True)
        with tempfile.TemporaryDirectory(prefix="kinetic-startup-run-") as cache:
            cold = kinetic_run(gguf, cache)
            warm = min(kinetic_run(gguf, cache) for _ in range(args.reps))
            print(f"kinetic run      cold {cold:6.2f} s  warm {warm:6.2f} s", flush=True)
        print(f"({load_note()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
