"""What a split costs where it can be measured here: one model over two CPU devices of one
process (XLA_FLAGS=--xla_force_host_platform_device_count=2), by row and by layer, and over
two processes of one device each (`kinetic serve --coordinator`), against the unsplit model.

The devices share this machine's cores (the C++ kernel's pool has a thread per core on
each), so a split cannot be faster here: the figures are its overhead (the collectives, the
work the split repeats on every device), not the speed-up of devices of their own. Each
configuration runs in a process of its own, serving the model (the same HTTP path as a
user's), and asks for one greedy answer of --tokens tokens after a 512-token prompt; the
server's own timings (`/completion`'s prompt_per_second, predicted_per_second) are
reported, best of --reps, beside the machine's load.

    python bench/split.py [--model smollm2] [--tokens 64] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.probes import cpu_name, load_note  # noqa: E402
from tests.conftest import real_model_file  # noqa: E402
from tests.serve_process import ServeProcess, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("-c", "2048", "-np", "1", "--draft-max", "0")


def measure(serve: ServeProcess, prompt: list[int], tokens: int, reps: int) -> dict:
    """Best prompt and decode tok/s of `reps` answers (each prompt's first token differs,
    so no answer reuses another's cached prefix)."""
    best = {"prompt": 0.0, "decode": 0.0}
    for i in range(reps):
        body = {"prompt": [(t + i) % 1000 + 100 for t in prompt], "n_predict": tokens,
                "temperature": 0, "ignore_eos": True}
        status, _, got = serve.request("POST", "/completion", body)
        assert status == 200, got
        t = got["timings"]
        best["prompt"] = max(best["prompt"], t["prompt_per_second"])
        best["decode"] = max(best["decode"], t["predicted_per_second"])
    return best


def run(model: str, flags: tuple[str, ...], env: dict, prompt, tokens, reps,
        processes: int = 1) -> dict:
    old = dict(os.environ)
    os.environ.update(env)
    followers = []
    try:
        if processes > 1:
            join = ("--coordinator", f"127.0.0.1:{free_port()}", "--num-processes",
                    str(processes))
            serve = ServeProcess(model, *FLAGS, *flags, *join, "--process-id", "0")
            followers = [subprocess.Popen(
                [sys.executable, "-m", "kinetic.cli", "serve", model, *FLAGS, *flags, *join,
                 "--process-id", str(i)], cwd=ROOT, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL) for i in range(1, processes)]
        else:
            serve = ServeProcess(model, *FLAGS, *flags)
        try:
            serve.wait_ready()
            return measure(serve, prompt, tokens, reps)
        finally:
            serve.close()
            for f in followers:
                f.kill()
                f.wait()
    finally:
        os.environ.clear()
        os.environ.update(old)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model = str(real_model_file(args.model))
    prompt = list(range(512))
    two = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    one = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    configs = [("unsplit, one device", (), one, 1),
               ("-sm row, 2 devices of 1 process", ("-sm", "row"), two, 1),
               ("-sm layer, 2 devices of 1 process", ("-sm", "layer"), two, 1),
               ("-sm layer, 2 processes of 1 device", (), one, 2),
               ("-sm row, 2 processes of 1 device", ("-sm", "row"), one, 2)]
    print(f"# {args.model}, {args.tokens} tokens after a 512-token prompt, best of "
          f"{args.reps}; {cpu_name()}, {os.cpu_count()} CPUs")
    rows = []
    for name, flags, env, processes in configs:
        print(f"  {load_note()}", flush=True)
        got = run(model, flags, env, prompt, args.tokens, args.reps, processes)
        rows.append((name, got))
        print(f"{name:38s} prompt {got['prompt']:8.1f} tok/s   decode {got['decode']:7.1f} "
              f"tok/s", flush=True)
    base = rows[0][1]
    print("\nagainst the unsplit model:")
    for name, got in rows[1:]:
        print(f"{name:38s} prompt {got['prompt'] / base['prompt']:.2f}x   decode "
              f"{got['decode'] / base['decode']:.2f}x")
    print(json.dumps({name: got for name, got in rows}))


if __name__ == "__main__":
    main()
