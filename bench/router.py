"""Router mode: switching between two pulled models, and the memory an unloaded model leaves.

Starts `kinetic serve` with no model (router mode, --models-max 1) and asks, in turn:
  1. model A (its first request: A's worker loads, cold or warm by the compile cache),
  2. model B (the switch: A is unloaded, B's worker loads),
  3. model A again, 4. model B again (both compile caches warm now).
For each it prints the seconds to the whole answer (8 greedy tokens), the router's own
VmRSS, and the total resident memory of the router and its workers (the sum of VmRSS over
the process tree), before the first load and after every unload (POST /models/unload at
the end), so that what an unloaded model leaves behind shows. Beside it, each model's warm
`kinetic serve` start alone (bench/startup.py measures it the same way).

    python bench/router.py [--models smollm2 gemma3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probes import cpu_name, load_note  # noqa: E402
from tests.serve_process import free_port  # noqa: E402


def tree_rss(pid: int) -> tuple[int, int]:
    """(the process's VmRSS, the sum over it and its children), MiB."""
    def rss(p: int) -> int:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) // 1024
        except OSError:
            pass
        return 0
    kids = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            kids += (task / "children").read_text().split()
    except OSError:
        pass
    return rss(pid), rss(pid) + sum(rss(int(k)) for k in kids)


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs=2, default=["smollm2", "gemma3"])
    ap.add_argument("--parallel", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kinetic.cli", "serve", "--port", str(port),
                             "--models-max", "1", "-np", str(args.parallel), "-c",
                             str(2048 * args.parallel), "--cache-ram", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        print(f"# {cpu_name()}, {os.cpu_count()} CPUs; router --models-max 1 -np "
              f"{args.parallel}; {load_note()}")
        own, total = tree_rss(proc.pid)
        print(f"before any load: router {own} MiB, router and workers {total} MiB")
        a, b = args.models
        for name in (a, b, a, b):
            began = time.monotonic()
            status, answer = post(port, "/v1/chat/completions", {
                "model": name, "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 8, "temperature": 0})
            took = time.monotonic() - began
            own, total = tree_rss(proc.pid)
            print(f"{name:12s} first answer {took:6.2f} s (status {status}); router {own} MiB, "
                  f"router and workers {total} MiB", flush=True)
        for name in (a, b):
            post(port, "/models/unload", {"model": name})
        time.sleep(1.0)
        own, total = tree_rss(proc.pid)
        print(f"after unloading: router {own} MiB, router and workers {total} MiB")
        print(f"({load_note()})")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
