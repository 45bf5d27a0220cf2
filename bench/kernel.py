"""Per-shape speed of kinetic's quantized matmul (the C++ kernel behind the XLA FFI) beside
XLA's bf16 dot, on the projections of real GGUF models, with this machine's copy bandwidth.

    python bench/kernel.py [--model smollm2|qwen25coder|gemma3|PATH]... [--m 1,4,16,64]
                           [--isa scalar|avx2|avx512] [--min-time 0.2] [--json OUT.json]

Shapes: for each model (--model, repeatable; default: each of the three above that is cached),
every distinct (N, K, type) among the 2-D tensors of block 0, plus the output projection:
output.weight, or token_embd.weight when the output is tied to the embedding. A row names every
tensor of its shape (the first one is timed).

For each shape and each M of --m, with x a random float32 [M, K]:
- kernel: kinetic.kernels.ffi.qmatmul(x, data, fmt, offset, N, K) inside jax.jit, `data` the
  whole file as one zero-copy device buffer and the weight at its offset, as kinetic runs it;
- xla: jnp.dot(x.astype(bf16), W, preferred_element_type=f32) inside jax.jit, W dequantized
  (kinetic.model.quants) and stored [K, N] in bfloat16, as kinetic's xla path stores it.
Each is called once to compile and warm up, then repeated until --min-time seconds and
--min-reps calls have been timed; the figure is the median call, wall clock up to
block_until_ready, so it includes JAX's dispatch (the "jit call floor" printed at the top).

Weights are timed in the layout kinetic's loader gives them: where it repacks (the AVX-512
path, unless KINETIC_REPACK=0; kinetic.model.weights.repack_wanted), the 32-value block formats
are rearranged into the 16-column layout first, and their type is printed with a `*`.

Columns: kernel ms; kernel GB/s = bytes of the weight in its GGUF blocks / time; GFLOP/s =
2*M*N*K / time; of copy = kernel GB/s / the 2-thread copy bandwidth; xla ms; xla GB/s = the bf16
weight's 2*N*K bytes / time; speed-up = xla ms / kernel ms.

Copy bandwidth, measured first: np.copyto of a 1 GiB float64 array (larger than the caches),
best of 5, with one thread and with two Python threads each copying half (numpy releases the
GIL). It is counted as BYTES READ per second, the array's size / the time (a copy also writes as
many bytes, so its read + write traffic is twice the figure): the same unit as the kernel's
GB/s, which counts the weight bytes it reads. The summary line takes M = 1 on the matrices of
at least 4 MB (4e6 bytes) of weight and prints the median of "of copy" over them (the issue's
target: >= 0.60).

Repeated calls on one weight find it in the caches when it fits (the last cache level is
printed at the top), so small matrices may read faster than the 1 GiB copy. The machine may be
shared: the load average is printed at the top, before each model and at the end, and each
JSON row has the 1-minute figure; distrust figures taken while it was high.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probes import cpu_name, load_note, memory_bandwidth

MODELS = ("smollm2", "qwen25coder", "gemma3")
ISAS = ("scalar", "avx2", "avx512")
LARGE = 4e6   # weight bytes from which a matrix counts as large in the summary


def copy_bandwidth(size: int = 1 << 30, threads: int = 2, repeats: int = 5) -> dict[int, float]:
    """Bytes READ per second by np.copyto of `size` bytes, best of `repeats`, with 1 and with
    `threads` threads: half of bench/probes.py's read + written figure."""
    return {k: v / 2 for k, v in memory_bandwidth(size, threads, repeats).items()}


def median_call(fn, args: tuple, min_time: float, min_reps: int) -> float:
    """Median seconds of fn(*args) up to block_until_ready, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times: list[float] = []
    while len(times) < min_reps or sum(times) < min_time:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@jax.jit
def xla_dot(x, w_kn):
    return jnp.dot(x.astype(jnp.bfloat16), w_kn, preferred_element_type=jnp.float32)


def kernel_fn(fmt: int, offset: int, n: int, k: int):
    from kinetic.kernels import ffi
    return jax.jit(lambda x, data: ffi.qmatmul(x, data, fmt, offset, n, k))


def shape_groups(f) -> list[list[str]]:
    """Tensor names grouped by (shape, type): block 0's 2-D tensors and the output
    projection, smallest weight first."""
    out_name = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
    names = sorted(n for n, t in f.tensors.items() if n.startswith("blk.0.") and len(t.shape) == 2)
    groups: dict = {}
    for name in names + [out_name]:
        t = f.tensors[name]
        groups.setdefault((t.shape, t.qtype), []).append(name)
    return sorted(groups.values(), key=lambda g: f.tensors[g[0]].data.nbytes)


def short(name: str, tied: bool) -> str:
    base = name.removeprefix("blk.0.").removesuffix(".weight")
    return base + " (tied output)" if tied and name == "token_embd.weight" else base


def last_cache() -> str:
    """CPU 0's last cache level and its size as Linux states it, e.g. "L3 266240K"."""
    found = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"),
                   key=lambda d: int((d / "level").read_text()))
    if not found:
        return "cache sizes unknown"
    level, size = ((found[-1] / f).read_text().strip() for f in ("level", "size"))
    return f"L{level} {size}"


def model_paths(wanted: list[str] | None) -> list[tuple[str, str]]:
    """(label, path) of each model asked for; by default every cached one of MODELS."""
    from kinetic.fetch import FetchError, model_path
    out = []
    for m in wanted or MODELS:
        if Path(m).is_file():
            out.append((Path(m).stem, str(Path(m).resolve())))
            continue
        try:
            path = model_path(m)
        except FetchError as e:
            sys.exit(f"--model {m}: {e}")
        if path is not None:
            out.append((m, str(path)))
        elif wanted:
            sys.exit(f"--model {m}: not cached here (`kinetic pull {m}` fetches it)")
    if not out:
        sys.exit(f"none of {', '.join(MODELS)} is cached: fetch one with `kinetic pull`")
    return out


HEAD = (f"{'model':12} {'tensor':26} {'type':5} {'N':>6} {'K':>5} {'M':>3} | {'kern ms':>9} "
        f"{'GB/s':>6} {'GFLOP/s':>7} {'of copy':>7} | {'xla ms':>9} {'GB/s':>6} | {'speed-up':>8}")


def bench_model(label: str, path: str, ms: list[int], args, copy2: float) -> list[dict]:
    from kinetic import kernels
    from kinetic.model import quants
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.model.weights import repack_wanted
    f = GGUFFile(path)
    tied = "output.weight" not in f.tensors
    data = jax.device_put(f.bytes)   # the whole file, zero-copy, as kinetic passes it
    repack = repack_wanted() and data.unsafe_buffer_pointer() == f.bytes.ctypes.data
    rng = np.random.default_rng(args.seed)
    rows = []
    for names in shape_groups(f):
        raw = f.tensors[names[0]]
        n, k = raw.shape
        wbytes = raw.data.nbytes
        w_kn = jnp.asarray(np.ascontiguousarray(quants.dequantize(raw).T), dtype=jnp.bfloat16)
        fmt, offset = int(raw.qtype), raw.file_offset(f.bytes)
        if repack and fmt in kernels.REPACKABLE and n >= 16:   # as the loader does
            fmt = kernels.repack16_host(fmt, f.writable_bytes()[offset:offset + wbytes], n, k)
        kern = kernel_fn(fmt, offset, n, k)
        tensor = "+".join(short(x, tied) for x in names)
        for m in ms:
            x = jax.device_put(rng.standard_normal((m, k), dtype=np.float32))
            tk = median_call(kern, (x, data), args.min_time, args.min_reps)
            tx = median_call(xla_dot, (x, w_kn), args.min_time, args.min_reps)
            r = {"model": label, "tensor": tensor, "tensors": names,
                 "type": raw.qtype.name + ("*" if fmt & kernels.REPACK16 else ""),
                 "N": n, "K": k, "M": m, "weight_bytes": wbytes,
                 "kernel_s": tk, "kernel_GBps": wbytes / tk / 1e9,
                 "kernel_GFLOPps": 2 * m * n * k / tk / 1e9,
                 "kernel_of_copy": wbytes / tk / copy2,
                 "xla_s": tx, "xla_GBps": 2 * n * k / tx / 1e9, "speedup": tx / tk,
                 "load1": os.getloadavg()[0]}
            rows.append(r)
            print(f"{label:12.12} {tensor:26.26} {r['type']:5} {n:6} {k:5} {m:3} | "
                  f"{tk * 1e3:9.3f} {r['kernel_GBps']:6.2f} {r['kernel_GFLOPps']:7.2f} "
                  f"{r['kernel_of_copy']:7.2f} | {tx * 1e3:9.3f} {r['xla_GBps']:6.2f} | "
                  f"{r['speedup']:7.2f}x", flush=True)
        del w_kn
    return rows


def summary(rows: list[dict], copy2: float) -> tuple[str, float | None]:
    big = [r for r in rows if r["M"] == 1 and r["weight_bytes"] >= LARGE]
    if not big:
        return f"summary: no M = 1 row on a matrix of >= {LARGE / 1e6:.0f} MB of weight", None
    frac = statistics.median(r["kernel_of_copy"] for r in big)
    which = ", ".join(f"{r['model']} {r['tensor']} {r['kernel_of_copy']:.2f}" for r in big)
    what = f"{len(big)} matri{'ces' if len(big) > 1 else 'x'} of >= {LARGE / 1e6:.0f} MB"
    return (f"summary: M = 1 on the {what} of weight: "
            f"median {frac:.2f} of the 2-thread copy bandwidth ({copy2 / 1e9:.2f} GB/s read), "
            f"target >= 0.60 {'ok' if frac >= 0.6 else 'NO'}  [{which}]"), frac


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append",
                    help="smollm2, qwen25coder, gemma3 (any kinetic.fetch key) or a GGUF path; "
                         "repeat for several (default: each of the three that is cached)")
    ap.add_argument("--m", default="1,4,16,64", help="rows of x, comma-separated")
    ap.add_argument("--isa", choices=ISAS, help="sets KINETIC_KERNEL_ISA for the kernel")
    ap.add_argument("--min-time", type=float, default=0.2, help="timed seconds per figure")
    ap.add_argument("--min-reps", type=int, default=5, help="timed calls per figure")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", help="also write every row here")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.m.split(",") if v.strip()]
    if args.isa:
        os.environ["KINETIC_KERNEL_ISA"] = args.isa   # read when kinetic.kernels is imported
    try:
        from kinetic import kernels
    except RuntimeError as e:   # kernels.KernelError: a KINETIC_KERNEL_ISA it cannot run
        sys.exit(f"kinetic.kernels: {e}")
    if not kernels.available():
        sys.exit("kinetic's C++ kernel is not built here: run `pip install -e .`")
    models = model_paths(args.model)

    started = datetime.datetime.now().astimezone()
    cpus = len(os.sched_getaffinity(0))
    print(f"kinetic kernel bench, {started:%Y-%m-%d %H:%M %Z}; {load_note()}")
    print(f"machine: {cpu_name()}, {last_cache()}")
    print(f"kernel ISA {kernels.isa()} (this CPU: {', '.join(kernels.supported_isas())}; "
          f"KINETIC_KERNEL_ISA={os.environ.get('KINETIC_KERNEL_ISA') or '(unset)'})")
    print(f"XLA: jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS') or '(unset)'}, "
          f"{cpus} CPUs for this process (the kernel runs on XLA's intra-op thread pool, one "
          f"thread per CPU by default), {len(jax.devices('cpu'))} CPU device(s)")
    bw = copy_bandwidth()
    print("copy bandwidth (np.copyto of 1 GiB, bytes READ per second, best of 5): "
          + ", ".join(f"{v / 1e9:.2f} GB/s with {t} thread{'s' * (t > 1)}"
                      for t, v in sorted(bw.items())), flush=True)
    one = jax.device_put(np.zeros((1, 8), np.float32))
    floor = median_call(jax.jit(lambda x: x + 1), (one,), args.min_time, args.min_reps)
    print(f"jit call floor: {floor * 1e6:.0f} us (a trivial jitted call; every time includes it)")

    rows: list[dict] = []
    for label, path in models:
        print(f"\n{label}: {Path(path).name}; {load_note()}\n{HEAD}", flush=True)
        rows += bench_model(label, path, ms, args, bw[2])
    line, frac = summary(rows, bw[2])
    print(f"\n{line}\nafter: {load_note()}")
    if args.json:
        out = {"started": started.isoformat(), "machine": cpu_name(), "cpus": cpus,
               "last_cache": last_cache(), "isa": kernels.isa(),
               "xla_flags": os.environ.get("XLA_FLAGS"),
               "jax": jax.__version__, "copy_read_Bps": {str(t): v for t, v in bw.items()},
               "jit_floor_s": floor, "m": ms, "min_time": args.min_time,
               "min_reps": args.min_reps, "rows": rows, "summary_of_copy": frac,
               "summary": line, "load_after": os.getloadavg()}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
