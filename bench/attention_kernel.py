"""Time the C++ paged attention (kinetic.kernels.attention) against layers.paged_attention,
both jitted, on a decode-like and a prefill-like step (f32 cache, page size 16); then the
kernel alone on a 512-token prompt fed as 32 chunks of 16 rows (positions 0..15, 16..31, ...,
one call each), for real models' head shapes, with a float32 and a float16 cache.

    python bench/attention_kernel.py [--reps N] [--only step|prompt]
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


# name, H query heads, K kv heads, head width, window (0: none)
PROMPT_MODELS = [("gemma-3-270m", 4, 1, 256, 512), ("smollm2-135m", 9, 3, 64, 0),
                 ("qwen2.5-0.5b", 14, 2, 64, 0)]


def prompt_chunks(H, K, Q, dtype, rng, ctx=512, T=16):
    """The caches of one ctx-token sequence (slot 0, pages 1..ctx/PS) and the step of each
    T-row chunk of its prompt: (q, k, v, [step for positions c..c+T-1, c = 0, T, ...])."""
    P = ctx // PS
    k = jnp.asarray(rng.standard_normal((P + 1, PS, K, Q)).astype(dtype))
    v = jnp.asarray(rng.standard_normal((P + 1, PS, K, Q)).astype(dtype))
    q = jnp.asarray(rng.standard_normal((T, H, Q)).astype(np.float32))
    table = jnp.arange(1, P + 1, dtype=jnp.int32)[None]
    steps = [layers.StepInput(tokens=jnp.zeros(T, jnp.int32),
                              positions=jnp.arange(c, c + T, dtype=jnp.int32),
                              slots=jnp.zeros(T, jnp.int32), write_index=jnp.zeros(T, jnp.int32),
                              page_table=table) for c in range(0, ctx, T)]
    return q, k, v, steps


def bench_prompt(reps):
    """ms for the whole prompt's chunk calls (min over reps), and per call."""
    rng = np.random.default_rng(0)
    print(f"prompt: 512 tokens as 32 chunks of 16 rows, page size {PS}  (ms: min of {reps})")
    for name, H, K, Q, window in PROMPT_MODELS:
        fn = jax.jit(lambda q, k, v, s, w=window, sc=Q ** -0.5:
                     A.paged_attention(q, k, v, s, sc, w))
        for dtype in (np.float32, np.float16):
            q, k, v, steps = prompt_chunks(H, K, Q, dtype, rng)
            for s in steps[:2]:
                fn(q, k, v, s).block_until_ready()
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                for s in steps:
                    fn(q, k, v, s).block_until_ready()
                best = min(best, time.perf_counter() - t0)
            print(f"{name:13s} H={H:2d} K={K} Q={Q:3d} window={window:3d} "
                  f"{np.dtype(dtype).name:7s}  prompt {best * 1e3:7.2f} ms  "
                  f"per call {best * 1e3 / len(steps):6.3f} ms")


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
    ap.add_argument("--only", choices=["step", "prompt"])
    opts = ap.parse_args()
    reps = opts.reps
    if opts.only == "prompt":
        return bench_prompt(max(1, reps // 10))
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
    if opts.only is None:
        bench_prompt(max(1, reps // 10))


if __name__ == "__main__":
    main()
