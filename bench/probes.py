"""Probes of the machine a benchmark runs on (Linux /proc, numpy): what the CPU is, how busy
the machine is, its memory bandwidth, how many CPUs processes other than ours keep busy, and
a process's peak memory.

    cpu_name()             model name, family/model numbers, the vector extensions
    cpu_has(flag)          whether /proc/cpuinfo lists a flag (e.g. amx_tile)
    load_note()            the load average, as one line
    memory_bandwidth()     bytes read + written per second by a numpy copy, 1 and N threads
    OtherLoad(pids)        context manager: CPUs kept busy by other processes meanwhile
    wait_quiet(pids, s)    wait up to s seconds for a quiet second
    vm_hwm(pid)            peak resident set size (VmHWM), bytes
    proc_mib(pid, names)   fields of /proc/PID/status (VmRSS, RssAnon, VmHWM...), MiB
"""

from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path

import numpy as np


def _cpuinfo() -> dict:
    """The first CPU's fields of /proc/cpuinfo ({} where there is none)."""
    info: dict = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` among the CPU's flags."""
    return flag in _cpuinfo().get("flags", "").split()


def cpu_name() -> str:
    """Model name, family/model numbers and the vector extensions that matter to matmuls."""
    info = _cpuinfo()
    if not info:
        return platform.processor() or "unknown CPU"
    flags = info.get("flags", "").split()
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
            if f in flags]
    return (f"{info.get('model name', 'unknown CPU')} (family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}; {' '.join(simd) or 'no AVX2'})")


def load_note() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


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
    return out


def bandwidth_text(bw: dict) -> str:
    return ", ".join(f"{v / 1e9:.1f} GB/s with {t} thread{'s' if t > 1 else ''}"
                     for t, v in sorted(bw.items()))


def _busy_ticks() -> int:
    """Busy CPU time of the whole machine so far, clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - (v[4] if len(v) > 4 else 0)   # all but idle and iowait


def _proc_ticks(pid) -> int:
    """utime + stime of a process and its waited-for children, clock ticks (0 once it has
    gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            v = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in v[11:15])
    except (OSError, ValueError):
        return 0


class OtherLoad:
    """CPUs kept busy by processes other than ours during a `with` block: the machine's busy
    time minus our processes' time, over the block's wall time, in `.cpus` after it.
    pids: ours ("self" for this process; the servers' pids)."""

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


def wait_quiet(pids, max_wait: float, threshold: float = 0.25) -> float | None:
    """Wait (at most max_wait seconds) for a second in which processes other than `pids`
    keep fewer than `threshold` CPUs busy; returns the last second's figure (None when
    max_wait <= 0: no wait at all)."""
    if max_wait <= 0:
        return None
    deadline = time.monotonic() + max_wait
    while True:
        with OtherLoad(pids) as load:
            time.sleep(1.0)
        if load.cpus < threshold or time.monotonic() >= deadline:
            return load.cpus


def vm_hwm(pid: int | str = "self") -> int | None:
    """Peak resident set size of a process, bytes (VmHWM of /proc/PID/status; None where it
    cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def proc_mib(pid: int, *names: str) -> dict[str, int]:
    """The `names` fields of /proc/PID/status (VmRSS, RssAnon, VmHWM...), MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in names:
                out[name] = int(value.split()[0]) // 1024
    return out

