"""The pallas kernels compiled for a GPU without one: registers, spills and shared memory.

    python bench/triton_sm90.py --triton-python PY [--shape qwen25-1.5b]... [--qtype Q4_0]...

Where no GPU is lent, this is what can still be known of the code a GPU would run. JAX
lowers each pallas_call to a Triton module on a CPU (tests/test_pallas_lowering.py);
here each module is captured as text and handed to PY, a Python that has PyPI's `triton`
(in its own environment: `python -m venv /tmp/tr && /tmp/tr/bin/pip install triton`,
kept out of kinetic's so that two copies of MLIR never share a process), which compiles it
for sm_90 (an H100 / H200) at the launch parameters kinetic names
(kernels/pallas_backend.py) and runs the PTX through the `ptxas` it ships, verbose. For
each kernel at the real shapes of each --shape (bench/gpu.py's SHAPES: the matmul of each
distinct weight, [N, K], at one row and at 64 (the decode and the prompt variant,
kernels/pallas_matmul.py `variant`; and at one row with one-row dots, `dot_rows`), q, k
and v in one launch and gate and up in one (matmul_many, as layers.linear_many runs
them), the paged attention at the model's heads, the RMS norm at d_model and at a head,
a mixture's experts, gate+up and down over every chosen pair (swiglu_experts) at
Qwen3-30B-A3B's shape, and its routing (pallas_route), Qwen3.5's delta rule
(pallas_delta) and its gated attention, it prints the registers a thread uses, the bytes it spills to local
memory, the shared memory a program takes, and how many tensor-core (mma, wgmma)
instructions its PTX has: the block formats' int8 dots are the tensor cores' integer MMA;
a float32 dot at precision HIGHEST (float weights, the attention) is Triton's IEEE dot,
FMAs in order over K, none. A spill is a slow kernel; the figures are the compiler's, not
a measurement of speed, and PyPI's Triton is not the one
inside jaxlib, so they are a guide to tile sizes, not the device's word.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu import SHAPES  # noqa: E402

COMPILE = r'''
import json, os, re, subprocess, sys, warnings
warnings.filterwarnings("ignore")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
bin_ = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ptxas = next(os.path.join(bin_, n) for n in ("ptxas-blackwell", "ptxas")
             if os.path.exists(os.path.join(bin_, n)))
for job in json.load(open(sys.argv[1])):
    row = {"name": job["name"]}
    try:
        k = triton.compile(job["path"], target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": job["warps"], "num_stages": job["stages"]})
        row["shared"] = k.metadata.shared
        ptx = job["path"] + ".ptx"
        open(ptx, "w").write(k.asm["ptx"])
        done = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", ptx, "-o", ptx + ".cubin"],
                              capture_output=True, text=True)
        text = done.stdout + done.stderr
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores", text)
        row["registers"] = int(regs.group(1)) if regs else None
        row["spill"] = int(spill.group(1)) if spill else None
        # tensor-core instructions (a float32 dot at IEEE precision has none: FMAs in order)
        row["mma"] = len(re.findall(r"\b(?:mma|wgmma)\.", k.asm["ptx"]))
    except Exception as e:   # a module this Triton cannot compile: said, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    print(json.dumps(row), flush=True)
'''


def capture_modules(folder: str, shapes: list[str], qtypes: list[str]) -> list[dict]:
    """Each kernel's Triton module as text in `folder`: [{name, path, warps, stages}]."""
    import jax
    import jax.numpy as jnp
    from gguf import GGMLQuantizationType as T
    from jax._src.pallas.triton import lowering, pallas_call_registration

    from kinetic.kernels import pallas_attention, pallas_backend, pallas_matmul as pm
    from kinetic.kernels import pallas_norm, pallas_rope, target
    from tests.tiny_models import random_blocks

    jobs: list[dict] = []
    current: dict = {}
    original = lowering.lower_jaxpr_to_triton_module
    options = pallas_backend.options

    def launch(interpret, *args, **kwargs):
        """The kernel's own launch parameters, as it asks for them (a kernel traced
        again for the same shapes asks again: JAX's caches are cleared by for_gpu)."""
        made = options(interpret, *args, **kwargs)
        current["launch"] = made["compiler_params"]
        return made

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        path = os.path.join(folder, f"{len(jobs)}.ttir")
        with open(path, "w") as f:
            f.write(result.module.operation.get_asm())
        jobs.append({"name": current["name"], "path": path,
                     "warps": current["launch"].num_warps,
                     "stages": current["launch"].num_stages})
        return result
    pallas_backend.options = launch
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture

    def lower(name, f, *args):
        current["name"] = name
        with target.for_gpu():
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))

    def abstract(qtype: str, N: int, K: int):
        """A [N, K] weight's Planes as shapes alone (the kernel's code needs no values)."""
        small = pm.repack(random_blocks(T[qtype], 16, K), T[qtype], (16, K))
        Np = -(-N // pm.ROWS) * pm.ROWS
        w = jax.tree.map(lambda a: jax.ShapeDtypeStruct((Np, *a.shape[1:]), a.dtype), small)
        return type(small)(w.q, w.d, w.m, w.bits, small.offset, small.group, N)

    for shape in shapes:
        s = SHAPES[shape]
        d, hd = s["d_model"], s["head_dim"]
        weights = {"q": (s["n_head"] * hd, d), "kv": (s["n_kv_head"] * hd, d),
                   "o": (d, s["n_head"] * hd), "up": (s["d_ffn"], d), "down": (d, s["d_ffn"]),
                   "output": (151936 if s.get("vocab") != "gpt-2" else 50257, d)}
        for qtype in qtypes:
            for wname, (N, K) in dict.fromkeys(weights.items()):
                if K % 256 and T[qtype] in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
                    continue
                w = abstract(qtype, N, K)
                t = pm.tiling(w.q.shape[0], K)
                for M in (1, 64):
                    lower(f"{shape} {qtype} {wname} [{N}, {K}] M={M} (bn {t.bn}, bk {t.bk}, "
                          f"{t.chunks} chunks)", pm.matmul,
                          jax.ShapeDtypeStruct((M, K), jnp.float32), w)
                # the one-row dots' kernel (pallas_matmul.dot_rows)
                before, pm.DECODE_ROWS = pm.DECODE_ROWS, 1
                try:
                    lower(f"{shape} {qtype} {wname} [{N}, {K}] M=1, 1-row dots", pm.matmul,
                          jax.ShapeDtypeStruct((1, K), jnp.float32), w)
                finally:
                    pm.DECODE_ROWS = before
            if d % 256 and T[qtype] in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
                continue
            # the weights layers.linear_many multiplies in one launch (matmul_many)
            for wname, names in (("q+k+v", ("q", "kv", "kv")), ("gate+up", ("up", "up"))):
                ws = [abstract(qtype, *weights[n]) for n in names]
                for M in (1, 64):
                    lower(f"{shape} {qtype} {wname} in one launch M={M}", pm.matmul_many,
                          jax.ShapeDtypeStruct((M, d), jnp.float32), ws)
                # with the residual add (the partial sums of o's or down's 3 chunks) and
                # the norm before them inside: a decode step's (layers.Normed)
                lower(f"{shape} {qtype} {wname} with the add + norm inside M=1",
                      lambda x, p, w_, ws: pm.matmul_many(x, ws, partials=True,
                                                          norm=(p, None, w_, 1e-6)),
                      jax.ShapeDtypeStruct((1, d), jnp.float32),
                      jax.ShapeDtypeStruct((3, 16, d), jnp.float32),
                      jax.ShapeDtypeStruct((d,), jnp.float32), ws)
                # Gemma 3's: the projection's output normalized before the add too
                lower(f"{shape} {qtype} {wname} with norm + add + norm inside M=1",
                      lambda x, p, w_, ws: pm.matmul_many(x, ws, partials=True,
                                                          norm=(p, None, w_, 1e-6, w_)),
                      jax.ShapeDtypeStruct((1, d), jnp.float32),
                      jax.ShapeDtypeStruct((3, 16, d), jnp.float32),
                      jax.ShapeDtypeStruct((d,), jnp.float32), ws)
            # the feed-forward as a step runs it: gate+up, then down making silu(gate) * up
            # of the partial sums it reads (pallas_matmul.swiglu)
            gate, down = abstract(qtype, *weights["up"]), abstract(qtype, *weights["down"])
            for M in (1, 64):
                lower(f"{shape} {qtype} swiglu (gate+up; down reading them) M={M}",
                      lambda x, g, u, dn: pm.swiglu(x, g, u, dn, partials=True),
                      jax.ShapeDtypeStruct((M, d), jnp.float32), gate, gate, down)
        pages = jax.ShapeDtypeStruct((64, 16, s["n_kv_head"], hd), jnp.float32)
        rows = jax.ShapeDtypeStruct((5,), jnp.int32)

        def attention(q, k, v, table, slots, positions):
            return pallas_attention.paged_attention(q, k, v, table, slots, positions,
                                                    hd ** -0.5, 0, 0.0)
        lower(f"{shape} attention ({s['n_head']}/{s['n_kv_head']} heads of {hd})", attention,
              jax.ShapeDtypeStruct((5, s["n_head"], hd), jnp.float32), pages, pages,
              jax.ShapeDtypeStruct((5, 8), jnp.int32), rows, rows)
        for width in (d, hd):
            lower(f"{shape} rms norm, width {width}",
                  lambda x, w: pallas_norm.rms_norm(x, w, 1e-6),
                  jax.ShapeDtypeStruct((5, width), jnp.float32),
                  jax.ShapeDtypeStruct((width,), jnp.float32))
        # a residual add (o's three partial sums, a bias) and the norm after it
        lower(f"{shape} residual add + rms norm, width {d}",
              lambda x, p, b, w: pallas_norm.add_rms_norm(x, p, b, w, 1e-6),
              jax.ShapeDtypeStruct((5, d), jnp.float32),
              jax.ShapeDtypeStruct((3, 16, d), jnp.float32),
              jax.ShapeDtypeStruct((d,), jnp.float32), jax.ShapeDtypeStruct((d,), jnp.float32))
        # a norm after the projection, the residual add and the next norm (Gemma 3's)
        lower(f"{shape} norm + residual add + rms norm, width {d}",
              lambda x, p, wp, w: pallas_norm.post_add_rms_norm(x, p, None, wp, w, 1e-6),
              jax.ShapeDtypeStruct((5, d), jnp.float32),
              jax.ShapeDtypeStruct((3, 16, d), jnp.float32),
              jax.ShapeDtypeStruct((d,), jnp.float32), jax.ShapeDtypeStruct((d,), jnp.float32))
        # rotary and the cache writes of q, k and v (two partial sums each, biases)
        H, K = s["n_head"], s["n_kv_head"]
        cache = jax.ShapeDtypeStruct((64, 16, K, hd), jnp.float16)
        parts = [jax.ShapeDtypeStruct((2, 16, n * hd), jnp.float32) for n in (H, K, K)]
        biases = [jax.ShapeDtypeStruct((n * hd,), jnp.float32) for n in (H, K, K)]
        angle = jax.ShapeDtypeStruct((5, hd // 2), jnp.float32)
        for neox in (False, True):
            lower(f"{shape} rotary + cache writes ({H}/{K} heads of {hd}, "
                  f"{'neox' if neox else 'adjacent pairs'})",
                  lambda qp, kp, vp, b, c, s_, i, kc, vc, neox=neox: pallas_rope.rope_write(
                      qp, kp, vp, b, c, s_, i, kc, vc, (H, K), neox),
                  *parts, biases, angle, angle, rows, cache, cache)
        # with each head of q and k RMS-normalized first (Qwen3's, no biases)
        norm = jax.ShapeDtypeStruct((hd,), jnp.float32)
        lower(f"{shape} head norms + rotary + cache writes ({H}/{K} heads of {hd}, neox)",
              lambda qp, kp, vp, c, s_, i, kc, vc, qw, kw: pallas_rope.rope_write(
                  qp, kp, vp, (None,) * 3, c, s_, i, kc, vc, (H, K), True, (qw, kw, 1e-6)),
              *parts, angle, angle, rows, cache, cache, norm, norm)
    # Qwen3.5's gated attention: q beside its gate, head norms, a quarter of the head
    # rotated (16/2 heads of 256, 64 rotated)
    H, K, hd, rot = 16, 2, 256, 64
    cache = jax.ShapeDtypeStruct((64, 16, K, hd), jnp.float16)
    parts = [jax.ShapeDtypeStruct((2, 16, n * hd), jnp.float32) for n in (2 * H, K, K)]
    angle = jax.ShapeDtypeStruct((5, rot // 2), jnp.float32)
    norm = jax.ShapeDtypeStruct((hd,), jnp.float32)
    lower(f"gated q, head norms, partial rotary + cache writes ({H}/{K} heads of {hd}, "
          f"{rot} rotated)",
          lambda qp, kp, vp, c, s_, i, kc, vc, qw, kw: pallas_rope.rope_write(
              qp, kp, vp, (None,) * 3, c, s_, i, kc, vc, (H, K), True, (qw, kw, 1e-6),
              q_gated=True),
          *parts, angle, angle, jax.ShapeDtypeStruct((5,), jnp.int32), cache, cache, norm,
          norm)
    # and its attention with the output gate inside, read from q's partial sums
    lower(f"gated attention ({H}/{K} heads of {hd}, f16 cache, the gate inside)",
          lambda q, k, v, table, slots, positions, g: pallas_attention.paged_attention(
              q, k, v, table, slots, positions, hd ** -0.5, gate=g, interpret=False),
          jax.ShapeDtypeStruct((5, H, hd), jnp.float16), cache, cache,
          jax.ShapeDtypeStruct((5, 8), jnp.int32), jax.ShapeDtypeStruct((5,), jnp.int32),
          jax.ShapeDtypeStruct((5,), jnp.int32), parts[0])
    # the decode loop's greedy draw: a row's blocks of the vocabulary to their maxima
    from kinetic.kernels import pallas_greedy
    for rows in (1, 64):
        lower(f"greedy draw's blocks, {rows} rows of 151936",
              lambda x: pallas_greedy._blocks(x, False),
              jax.ShapeDtypeStruct((rows, 151936), jnp.float32))
    # a mixture's experts, one launch a projection over every (row, expert) pair
    # (swiglu_experts), at Qwen3-30B-A3B's shape: 128 experts of [768, 2048], 8 a row
    for qtype in qtypes:
        E, F, d = 128, 768, 2048

        def stacked(N, K):
            w = abstract(qtype, E * N, K)
            return type(w)(w.q, w.d, w.m, w.bits, w.offset, w.group, N, E)
        for rows in (1, 64):
            ids = jax.ShapeDtypeStruct((rows, 8), jnp.int32)
            # gate+up, then down with silu(gate) * up inside (swiglu_experts: a decode
            # step's pairs each a block of its own, a prompt's sorted into blocks)
            lower(f"qwen3moe-30b-a3b {qtype} experts gate+up, down, {rows} rows x 8",
                  lambda x, ids, g, u, dn: pm.swiglu_experts(x, ids, g, u, dn, False),
                  jax.ShapeDtypeStruct((rows, d), jnp.float32), ids, stacked(F, d),
                  stacked(F, d), stacked(d, F))
        # its router at one row, the residual add and norm inside, the normed rows written
        # for the experts (experts.moe_ffn with a layers.Normed)
        lower(f"qwen3moe-30b-a3b {qtype} router with the add + norm inside, normed out, M=1",
              lambda x, p, w_, r: pm.matmul_many(x, [r], partials=True,
                                                 norm=(p, None, w_, 1e-6), normed=True),
              jax.ShapeDtypeStruct((1, d), jnp.float32),
              jax.ShapeDtypeStruct((3, 16, d), jnp.float32),
              jax.ShapeDtypeStruct((d,), jnp.float32), abstract(qtype, E, d))
    # a mixture's routing (pallas_route): the router's partial sums to each row's experts
    from kinetic.kernels import pallas_route
    for E, K in ((128, 8), (512, 10)):
        lower(f"routing, {E} experts, {K} a row, 1 row",
              lambda p: pallas_route.route(p, 1, E, K, "softmax", True, None, False),
              jax.ShapeDtypeStruct((2, 16, E), jnp.float32))
    # Qwen3.5's gated delta rule (pallas_delta): one program a key head (16 of width 128,
    # 4 taps), its value heads 1, 2 or 3 (the 0.8B's 16; 32 and 48 as larger ones have),
    # reading the projections' partial sums (3 chunks over K, 16 rows padded)
    from kinetic.kernels import pallas_delta
    for H in (16, 32, 48):
        Hk, dh, S, K1 = 16, 128, 8, 4
        C = 2 * Hk * dh + H * dh
        f32, i32 = jnp.float32, jnp.int32
        for rows in (1, 64):
            Mp = max(16, rows)
            parts = [jax.ShapeDtypeStruct((3, Mp, N), f32) for N in (C, H * dh, H, H)]
            lower(f"delta rule, {H} value heads on {Hk} key heads of {dh}, {rows} rows",
                  lambda taps, st, ins, r, rp, n: pallas_delta.delta_rule(
                      taps, st, ins, r, rp, n, rows, H, Hk, 1e-6, False),
                  jax.ShapeDtypeStruct((C, 4), f32),
                  (jax.ShapeDtypeStruct((S, 3, C), f32),
                   jax.ShapeDtypeStruct((S, H, dh, dh), f32),
                   jax.ShapeDtypeStruct((S - 2, K1, C + 2 * H), f32)),
                  (*parts, jax.ShapeDtypeStruct((H,), f32), jax.ShapeDtypeStruct((H,), f32),
                   jax.ShapeDtypeStruct((dh,), f32)),
                  jax.ShapeDtypeStruct((4, rows), i32), jax.ShapeDtypeStruct((2, 4), i32),
                  jax.ShapeDtypeStruct((1,), i32))
    return jobs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--triton-python", required=True,
                    help="a Python with PyPI's triton installed (its own environment)")
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES))
    ap.add_argument("--qtype", action="append")
    args = ap.parse_args(argv)
    shapes = args.shape or ["qwen25-1.5b"]
    qtypes = args.qtype or ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
    with tempfile.TemporaryDirectory() as folder:
        jobs = capture_modules(folder, shapes, qtypes)
        manifest = os.path.join(folder, "jobs.json")
        with open(manifest, "w") as f:
            json.dump(jobs, f)
        script = os.path.join(folder, "compile.py")
        with open(script, "w") as f:
            f.write(COMPILE)
        done = subprocess.run([args.triton_python, script, manifest], capture_output=True,
                              text=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        print(done.stderr[-2000:], file=sys.stderr)
        return 1
    version = subprocess.run([args.triton_python, "-c",
                              "import triton; print(triton.__version__)"],
                             capture_output=True, text=True).stdout.strip()
    print(f"triton {version}, sm_90a\n")
    print("| kernel | warps, stages | registers | spilled bytes | shared bytes | mma |\n"
          "|---|---|---|---|---|---|")
    for r, job in zip(rows, jobs):
        launch = f"{job['warps']}, {job['stages']}"
        if "error" in r:
            print(f"| {r['name']} | {launch} | failed: {r['error']} | | | |")
        else:
            print(f"| {r['name']} | {launch} | {r['registers']} | {r['spill']} | "
                  f"{r['shared']} | {r['mma']} |")
    spilled = [r["name"] for r in rows if r.get("spill")]
    failed = [r["name"] for r in rows if "error" in r]
    tensor = [r["name"] for r in rows if r.get("mma")]
    print(f"\n{len(rows)} kernels, {len(spilled)} spill, {len(failed)} failed to compile, "
          f"{len(tensor)} use tensor-core (mma) instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
