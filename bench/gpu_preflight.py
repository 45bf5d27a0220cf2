"""The GPU kernels that have a fallback, each compiled and run once at a tiny shape on this
device before scripts/device_check.sh measures anything (issue 38): one that fails (Triton
cannot compile it, it raises, or its values are not within float32 rounding of its
fallback's) prints the shell line that turns it off, so that the run's figures are still
taken, on the fallback, and say so.

    eval "$(python bench/gpu_preflight.py)"     # e.g. export KINETIC_GPU_ATTENTION=whole

- the norm's kernel (kernels/pallas_norm.py) beside a float64 RMS norm; off:
  KINETIC_GPU_NORM=xla (XLA's norm);
- the attention's lanes (kernels/pallas_attention.py, 8 lanes a row merged in order)
  beside one program a row; off: KINETIC_GPU_ATTENTION=whole;
- the delta rule's kernel (kernels/pallas_delta.py) beside the numpy reference's
  (tests/test_pallas_delta.py's case); off: KINETIC_GPU_DELTA=xla (XLA's loop).
The quantized matmuls have no fallback: tests.log says whether they run. Each failure's
error goes to stderr. On a CPU the kernels run interpreted (a check of the script).
"""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.test_pallas_delta import close  # noqa: E402  (within float32 rounding, or raises)


def norm() -> None:
    from kinetic.kernels import pallas_norm
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 576)).astype(np.float32), rng.standard_normal(576)
    want = x / np.sqrt(np.mean(np.float64(x) ** 2, axis=1, keepdims=True) + 1e-6) * w
    close(np.asarray(pallas_norm.rms_norm(x, w.astype(np.float32), 1e-6)), want)


def attention_lanes() -> None:
    from kinetic.kernels import pallas_attention as pa
    rng = np.random.default_rng(1)
    pages, page_size, K, G, Q = 1 + 2 * 12, 16, 2, 6, 128
    k = rng.standard_normal((pages, page_size, K, Q)).astype(np.float32)
    v = rng.standard_normal((pages, page_size, K, Q)).astype(np.float32)
    table = (1 + np.arange(2 * 12, dtype=np.int32)).reshape(2, 12)
    q = rng.standard_normal((3, K * G, Q)).astype(np.float32)
    slots, positions = np.array([0, 1, 0], np.int32), np.array([180, 7, 100], np.int32)
    whole = pa.paged_attention(q, k, v, table, slots, positions, 0.088, split=0)
    lanes = pa.paged_attention(q, k, v, table, slots, positions, 0.088, split=pa.SPLIT_LANES)
    close(np.asarray(lanes), np.asarray(whole))


def delta_rule() -> None:
    from tests import test_pallas_delta as t
    H, HK, D = 4, 2, 128
    taps, state, inputs, rows, replay = t.case(3, H, HK, D)
    inputs = t.exact_inputs(inputs, rows.shape[1])
    got_out, got = t.run(taps, state, inputs, rows, replay, 2, H, HK)
    want_out, want = t.reference_layer(taps, state, inputs, rows, replay, 2, H, HK)
    for g, w in [(got_out, want_out), *zip(got, want)]:
        close(g, w)


# (what, its check, the variable that turns it off, to what)
CHECKS = [("the norm's kernel", norm, "KINETIC_GPU_NORM", "xla"),
          ("the attention's lanes", attention_lanes, "KINETIC_GPU_ATTENTION", "whole"),
          ("the delta rule's kernel", delta_rule, "KINETIC_GPU_DELTA", "xla")]


def main() -> int:
    import jax
    print(f"# preflight on {jax.devices()[0].device_kind}", file=sys.stderr)
    for what, check, var, off in CHECKS:
        if os.environ.get(var) == off:
            continue   # already off
        try:
            check()
        except Exception:  # noqa: BLE001 - any failure turns the kernel off, and is shown
            print(f"# {what} failed here: {var}={off} for the rest\n{traceback.format_exc()}",
                  file=sys.stderr)
            print(f"export {var}={off}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
