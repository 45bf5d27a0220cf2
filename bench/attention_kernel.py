"""Time the C++ paged attention (kinetic.kernels.attention) against layers.paged_attention,
both jitted, on a decode-like and a prefill-like step (f32 cache, page size 16).

    python bench/attention_kernel.py [--reps N]
XLA's CPU thread pool (and so the kernel's threads) is as wide as the CPUs this process may
use: run under `taskset -c 0,1` for two threads."""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kinetic.kernels import attention as A
from kinetic.model import layers

PS = 16


def case(T, H, K, Q, ctx, rng):
    P = ctx // PS
    pages = P + 1
    k = jnp.asarray(rng.standard_normal((pages, PS, K, Q)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((pages, PS, K, Q)).astype(np.float32))
    q = jnp.asarray(rng.standard_normal((T, H, Q)).astype(np.float32))
    step = layers.StepInput(tokens=jnp.zeros(T, jnp.int32),
                            positions=jnp.arange(ctx - T, ctx, dtype=jnp.int32),
                            slots=jnp.zeros(T, jnp.int32), write_index=jnp.zeros(T, jnp.int32),
                            page_table=jnp.arange(1, P + 1, dtype=jnp.int32)[None])
    return q, k, v, step


def timed(fn, args, reps):
    fn(*args).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return float(np.min(ts)) * 1e6, float(np.median(ts)) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    reps = ap.parse_args().reps
    rng = np.random.default_rng(0)
    scale = 64 ** -0.5
    ours = jax.jit(lambda q, k, v, s: A.paged_attention(q, k, v, s, scale))
    xla = jax.jit(lambda q, k, v, s: layers.paged_attention(q, k, v, s, scale))
    print(f"cpus {len(os.sched_getaffinity(0))}  (us: min / median of {reps})")
    for name, T, ctx in [("decode", 1, 512), ("decode", 1, 2048), ("prefill", 64, 512)]:
        args = case(T, 14, 2, 64, ctx, rng)
        a, b = timed(ours, args, reps), timed(xla, args, reps)
        err = float(jnp.abs(ours(*args) - xla(*args)).max() / jnp.abs(xla(*args)).max())
        print(f"{name:8s} T={T:3d} ctx={ctx:5d}  kernel {a[0]:7.0f} / {a[1]:7.0f}  "
              f"xla {b[0]:7.0f} / {b[1]:7.0f}  x{b[0] / a[0]:5.2f}  rel diff {err:.1e}")


if __name__ == "__main__":
    main()
