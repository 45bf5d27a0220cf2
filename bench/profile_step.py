"""Where a decode step's time goes: XLA's profiler over Runner.decode_steps at R rows, in
process, on real weights, the time of each kind of operation per step.

    python bench/profile_step.py [--model qwen25coder|smollm2|gemma3|PATH] [--rows 8,16]
                                 [--calls 10] [--context 64] [--top 16]

For each R of --rows: the model opened as `kinetic serve -np R` would open it (no drafting,
1024 tokens a slot; compiled for its buckets, the weights in their kernel layout), then
--calls calls of Runner.decode_steps, each running the runner's steps-per-call at R rows (R
sequences at positions from --context on, greedy, one token fed to the next; the same calls
the engine makes when nothing can come between them), timed without the profiler (ms a step,
tokens/s) and then again under jax.profiler. The profile's operations are matched by name to
the decode loop's optimized HLO (XLA dumps it to a temporary folder: the script sets
XLA_FLAGS before JAX starts) and summed by kind: the custom call's target (kinetic_qmatmul,
kinetic_attention, ...) or the fusion, the JAX name scope it came from (ffn, attention, ...)
and its result shape, per step. The while loop itself is printed first: the step's whole
device time, the kinds are its parts. The machine may be shared: the load average is printed
beside each figure.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DUMP = tempfile.mkdtemp(prefix="kinetic-profile-")
# before JAX starts: the decode loop's optimized HLO, to name the profile's operations
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP}"
                           " --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*")

import jax   # noqa: E402
import numpy as np   # noqa: E402

from bench.probes import load_note   # noqa: E402
from bench.throughput import model_path   # noqa: E402


def hlo_kinds(folder: str) -> dict[str, str]:
    """HLO instruction name -> 'target scope shape' from the dumped decode loops."""
    kinds: dict[str, str] = {}
    for path in glob.glob(folder + "/*decode_loop*after_optimizations.txt"):
        for line in open(path):
            m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) (.*)", line)
            if not m:
                continue
            name, shape, rest = m.groups()
            target = re.search(r'custom_call_target="([^"]+)"', rest)
            op = re.search(r'op_name="([^"]+)"', rest)
            opcode = re.search(r"^([a-z\-]+)\(", rest)
            scope = "/".join(s for s in (op.group(1) if op else "").split("/")
                             if not s.startswith("jit(")
                             and s not in ("while", "body", "closed_call"))
            what = target.group(1) if target else (opcode.group(1) if opcode else "?")
            scope = re.sub(r"\[\d+\]", "", scope)[:28]
            kinds.setdefault(name, f"{what:<22} {scope:<28} {shape[:34]}")
    return kinds


def profile(path: str, rows: int, calls: int, context: int, top: int) -> None:
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.llm import open_model
    model = open_model(path, EngineConfig(parallel=rows, n_ctx=1024, speculative=False),
                       compile=True)
    runner = model.engine.runner
    S, P, ps = runner.config.num_slots, runner.config.pages_per_slot, runner.config.page_size
    n = runner.decode_steps_at(rows)
    if n < 2:
        sys.exit(f"{rows} rows: the runner runs one step a call there (no decode loop)")
    # each slot its own pages, in order
    table = np.minimum(np.arange(S * P, dtype=np.int32).reshape(S, P) + 1,
                       runner.config.num_pages - 1)

    def call(base: int) -> None:
        pos = np.broadcast_to(np.arange(n)[:, None] + base, (n, rows)).copy()
        slots = np.arange(rows)
        write = table[slots[None, :], pos // ps] * ps + pos % ps
        runner.decode_steps(np.full(rows, 7), pos, slots, write, table, (None,) * rows)

    call(context)
    call(context)
    t0 = time.perf_counter()
    for _ in range(calls):
        call(context)
    dt = (time.perf_counter() - t0) / (calls * n)
    print(f"{rows} rows, {n} steps a call, positions from {context}: {dt * 1e3:.2f} ms a step "
          f"({rows / dt:.1f} tok/s); {load_note()}", flush=True)
    trace = tempfile.mkdtemp(prefix="kinetic-trace-")
    with jax.profiler.trace(trace):
        for _ in range(calls):
            call(context)
    data = jax.profiler.ProfileData.from_file(
        glob.glob(trace + "/**/*.xplane.pb", recursive=True)[0])
    total: collections.Counter = collections.Counter()
    for plane in data.planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLAPjRtCpuClient"):   # the step's own thread
                for event in line.events:
                    total[event.name] += event.duration_ns
    names, steps = hlo_kinds(DUMP), calls * n
    by_kind: collections.Counter = collections.Counter()
    for name, ns in total.items():
        if name in names:
            by_kind[names[name]] += ns
    loop = sum(ns for name, ns in total.items() if name.startswith("while"))
    print(f"  {loop / 1e6 / steps:8.3f} ms  the decode loop (its steps' whole device time)")
    for kind, ns in by_kind.most_common(top):
        if not kind.startswith("?"):
            print(f"  {ns / 1e6 / steps:8.3f} ms  {kind}")
    model.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen25coder",
                    help="a kinetic.fetch key (smollm2, qwen25coder, gemma3) or a GGUF path")
    ap.add_argument("--rows", default="8,16", help="comma-separated row counts")
    ap.add_argument("--calls", type=int, default=10, help="decode calls timed and profiled")
    ap.add_argument("--context", type=int, default=64, help="the rows' first position")
    ap.add_argument("--top", type=int, default=16, help="kinds printed")
    args = ap.parse_args(argv)
    path, _ = model_path(args.model)
    rows = [int(r) for r in args.rows.split(",") if r.strip()]
    if len(rows) > 1:   # one process each: the HLO dump then holds that one model's loops
        for r in rows:
            done = subprocess.run([sys.executable, __file__, "--model", path, "--rows", str(r),
                                   "--calls", str(args.calls), "--context", str(args.context),
                                   "--top", str(args.top)])
            if done.returncode:
                return done.returncode
        return 0
    print(f"profile of decode steps: {path}; {load_note()}")
    profile(path, rows[0], args.calls, args.context, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
