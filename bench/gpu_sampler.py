"""The sampling chain's cost a step, by how a step's sampled rows are grouped into calls (issue
38: on a GPU each call of the chain reads flags back to the host; scripts/device_check.sh
runs it on the device machine).

    python bench/gpu_sampler.py [--vocab 151936] [--streams 1,64,256] [--reps 5]
                                [--form loop4,batch4,batch64] [--json OUT.json]

B sampled rows (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, each row its own seed)
drawn from random [B, V] float32 logits already on the device, through the engine's own
path: engine/sample_batch.py groups them into calls (sample_batches) and
engine/sample_device.py's DeviceSampler draws each (Runner.sample's work). Forms:
- loop4: 4 rows a call, sampler.sample_rows (a loop over a call's rows, CPU's chain);
- batch4: 4 rows a call, sampler.sample_batch (all of a call's rows at once);
- batch64: up to 64 rows a call at the smallest bucket that holds them, sample_batch (a
  GPU's SampleShape, GPU_SAMPLE_CHUNK).
Each figure is the median ms over --reps of drawing all B rows (grouping on the host
included; compiling excluded: one warm-up first), beside the greedy draw of the same B rows;
"same" says whether the form drew the tokens loop4 drew (a row's bits do not depend on how
rows are grouped). The header names the device and XLA_FLAGS (an A/B of XLA's command buffers:
scripts/device_check.sh). One JSON line per figure as it is measured, the table last; runs on a
CPU too (a check of the script: --vocab 4096 takes seconds).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FORMS = {"loop4": (4, False), "batch4": (4, True), "batch64": (64, True)}   # rows, whole_batch


def draw_all(sampler, logits, rows, shape) -> list[int]:
    """Every row's token, the engine's way: sample_batches' calls, each drawn in turn."""
    from kinetic.engine.sample_batch import sample_batches
    return [t for batch in sample_batches(rows, shape) for t in sampler.sample(logits, batch).tokens]


def median_ms(fn, reps: int) -> float:
    """bench/kernel.py's median_call of fn over `reps` calls, after a warm-up, in ms."""
    from bench.kernel import median_call
    return 1e3 * median_call(fn, (), 0.0, reps)


def measure(vocab: int, streams: list[int], forms: list[str], reps: int):
    """Yield one dict per (B, form): ms to draw B rows, and whether loop4's tokens came."""
    import jax
    from kinetic.engine.sample_batch import SampleShape, sample_row
    from kinetic.engine.sample_device import DeviceSampler
    from kinetic.engine.sampling_params import SamplingParams
    from tests.test_sample_batch import FakeJob   # what sample_row reads of a Job
    top = max(streams)
    buckets = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    buckets += [top] if buckets[-1] != top else []
    base = SampleShape.of(vocab, 4096, buckets, eog_ids=[0])
    sampler = DeviceSampler(vocab, exact=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
    greedy = SamplingParams(temperature=0.0)
    for B in streams:
        logits = jax.device_put(rng.standard_normal((B, vocab), np.float32) * 4)
        sampled = [sample_row(FakeJob(params, 1000 + i), i, 512, (), None, base)
                   for i in range(B)]
        plain = [sample_row(FakeJob(greedy, 0), i, 512, (), None, base) for i in range(B)]
        yield {"streams": B, "form": "greedy", "ms": median_ms(
            lambda: draw_all(sampler, logits, plain, base), reps)}
        want = None
        for form in forms:
            rows, whole = FORMS[form]
            shape = dataclasses.replace(base, chain_rows=rows, whole_batch=whole)
            got = draw_all(sampler, logits, sampled, shape)
            want = got if want is None else want
            yield {"streams": B, "form": form, "same": got == want, "ms": median_ms(
                lambda: draw_all(sampler, logits, sampled, shape), reps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=151936, help="tokens (Qwen2.5's: 151936)")
    ap.add_argument("--streams", default="1,64,256")
    ap.add_argument("--form", default=",".join(FORMS), help="of " + ", ".join(FORMS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)
    import jax
    forms = args.form.split(",")
    unknown = sorted(set(forms) - set(FORMS))
    if unknown:
        ap.error(f"unknown form {unknown[0]!r}; forms: {', '.join(FORMS)}")
    streams = [int(s) for s in args.streams.split(",")]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, vocab {args.vocab}, "
          f"load {os.getloadavg()[0]:.2f}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
          flush=True)
    rows = []
    for r in measure(args.vocab, streams, forms, args.reps):
        rows.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    cols = ["greedy", *forms]
    print("\n| rows | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---:|" + "---:|" * len(cols))
    for B in streams:
        cell = {r["form"]: r for r in rows if r["streams"] == B}
        print(f"| {B} | " + " | ".join(
            f"{cell[c]['ms']:.2f}" + ("" if cell[c].get("same", True) else " DIFFERS")
            for c in cols) + " |")
    return 0 if all(r.get("same", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
