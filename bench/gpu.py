"""Kernel "pallas" on a GPU: bitwise row invariance and speed on random-weight models of real
shapes, beside the bandwidth bound and XLA's dense bf16 path (issue 38's device check;
scripts/device_check.sh runs it on the device machine).

    python bench/gpu.py [--shape smollm2-135m|qwen25-0.5b|qwen25-1.5b|...]... [--qtype Q4_0]...
                        [--streams 1,2,7,8,16,64,256] [--reps 10] [--out DIR] [--tiny]
                        [--split-check] [--llama-cpp DIR] [--quick]

The models are written here, in a temporary folder, by tests/tiny_models.py with random
block bytes (`random_weights`: no quantizing, seconds even at 1.5B) and a real tokenizer
(the vocab-only files in tests/data): SmolLM2-135M's shape (llama, d 576, 30 layers, 9/3
heads of 64, ffn 1536; GPT-2's 50257 tokens, close to its 49152), Qwen2.5-0.5B's (qwen2,
d 896, 24 layers, 14/2 heads of 64, ffn 4864, 151936 tokens) and Qwen2.5-1.5B's (d 1536, 28
layers, 12/2 heads of 128, ffn 8960); also Qwen3-1.7B's, and two of Qwen3-30B-A3B's 48 layers
(qwen3moe, d 2048, 32/4 heads of 128, 128 experts of 768, 8 a token: a mixture's launches
a layer, bench/gpu_compile.py). K-quants need rows that are whole 256-blocks, so they
are written only for the shapes whose d_model is a multiple of 256 (Qwen2.5-1.5B's and
those after it).

For each model and each row count B of --streams, on kernel "pallas":
- bitwise: the logits of one row (slot 0's 16 prompt tokens, one per step) alone, and as
  the first row of steps of B rows (the other rows other slots' tokens at the same
  positions): every byte equal, or the model's row reads "DIFFERS";
- row-wise pieces: XLA's RMS norm over d_model and over a head, rotary and silu x up, and
  the norm's Pallas kernel (the step's norm on a GPU), each jitted alone at the model's
  widths: row 0's bytes alone and among B rows (a piece that differs is one to move into
  Pallas; "bitwise" covers the step's own pieces inside the step);
- decode: the median time of a B-row step at position 512 (each row its own slot), as
  tok/s = B / time;
- loop: one sequence's greedy decode as the server runs it when nothing else can come,
  the engine's decode_steps (4) steps in one device call (Runner.decode_steps), as ms a
  step; bench.step pays the host's work and a launch every step, this once per 4;
- prompt: a 512-token prompt in steps of --prompt-step rows, tok/s;
- bound: weight bytes read per step (every plane of every matrix, once) / the copy
  bandwidth measured first (a jitted x + 1 over 4 GiB of float32, bytes read + written
  per second), as a time; "of bound" = that time / the 1-row step's (and the loop's);
- matmuls: layer 0's projections and the output's (not with --tiny), each alone at one
  row, then q+k+v and gate+up each in one launch (as a step runs them): the weight's
  tiling (bn, bk, chunks of K), its programs, ms, and the fraction of its own bound (its
  planes' bytes over the read bandwidth); then the same with one-row dots
  (pallas_matmul.DECODE_ROWS 1: a float weight's 16-row dot does 16 times a row's FMAs),
  ms and whether the row's bytes are the 16-row dots';
- xla: the same model on kernel "xla" (weights dequantized to bfloat16, XLA's dot) at
  16 rows, tok/s;
- with --split-check (issue 42): the same model through the split's code path over one
  device (`--split-mode row -tp 1`: shard_map, the gathers, the rearranged planes): whether
  a B-row step's logits are the unsplit step's bytes, and its decode tok/s beside the
  unsplit's, at each B;
- with --llama-cpp DIR (the anchor): llama.cpp on the same file, DIR's llama-batched-bench
  with every layer on the GPU (`-ngl 99`, its defaults otherwise): a 512-token prompt in
  each of B sequences, then 32 steps of B rows from position 512, as decode tok/s at each
  B and (B = 1) prompt tok/s; a second table gives kinetic's speed over llama.cpp's.
  scripts/device_anchor.sh builds such a llama.cpp for the GPU ahead of time.
Times are wall clock to block_until_ready after a warm-up call (compilation excluded),
median of --reps. The table is printed last; with --out, gpu.json and gpu.md go there, the
JSON rewritten after each model so a run cut short keeps what it measured. --tiny: two
small layers (a check of the script itself, on a CPU in Pallas' interpret mode). --quick:
the decode figures, the loop and a row's bits alone and among B rows only, with the
XLA_FLAGS, the decode dots' rows (KINETIC_PALLAS_DECODE_ROWS) and KINETIC_GPU_NORM they ran
under (an A/B of such settings, e.g. command buffers: scripts/device_check.sh).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    "smollm2-135m": dict(arch="llama", d_model=576, n_layer=30, n_head=9, n_kv_head=3,
                         head_dim=64, d_ffn=1536, vocab="gpt-2", tied=True),
    "qwen25-0.5b": dict(arch="qwen2", d_model=896, n_layer=24, n_head=14, n_kv_head=2,
                        head_dim=64, d_ffn=4864, tied=True),
    "qwen25-1.5b": dict(arch="qwen2", d_model=1536, n_layer=28, n_head=12, n_kv_head=2,
                        head_dim=128, d_ffn=8960, tied=True),
    "qwen3-1.7b": dict(arch="qwen3", d_model=2048, n_layer=28, n_head=16, n_kv_head=8,
                       head_dim=128, d_ffn=6144, tied=True),
    # Qwen3-30B-A3B's layers, 2 of its 48 (a mixture's launches a layer; ~1 GB in Q4_0)
    "qwen3-30b-a3b-2l": dict(arch="qwen3moe", d_model=2048, n_layer=2, n_head=32,
                             n_kv_head=4, head_dim=128, d_ffn=6144, n_expert=128,
                             n_expert_used=8, d_ffn_expert=768),
    # Qwen3.5-0.8B's shapes (bench/families.py's qwen35-0.8b): 18 gated delta-rule layers
    # (16 key and 16 value heads of 128) and 6 gated attention layers; Qwen2's vocabulary
    "qwen35-0.8b": dict(arch="qwen35", d_model=1024, n_layer=24, n_head=8, n_kv_head=2,
                        head_dim=256, rope_dim=64, d_ffn=3584, ssm_state=128, ssm_k_heads=16,
                        ssm_v_heads=16, full_attention_interval=4, tied=True),
}
TINY = dict(n_layer=2, d_model=256, d_ffn=512, n_head=4, n_kv_head=2, head_dim=64)
PROMPT_LEN, DECODE_AT, PAGE = 512, 512, 16
LLAMA_TG = 32        # llama-batched-bench's decode steps per row count


def timed(f, reps: int) -> float:
    """Median seconds of f() over `reps` calls after a warm-up (bench/kernel.py's
    median_call; f blocks until its result is ready)."""
    from bench.kernel import median_call
    return median_call(f, (), 0.0, reps)


def copy_bandwidth(reps: int, tiny: bool) -> float:
    """Bytes read + written per second by a jitted x + 1 over a large float32 array."""
    import jax
    import jax.numpy as jnp
    n = (16 << 20) if tiny else (1 << 30)
    x = jnp.ones((n,), jnp.float32)
    add = jax.jit(lambda a: a + 1)
    return 2 * 4 * n / timed(lambda: add(x).block_until_ready(), reps)


def weight_bytes(model) -> int:
    import jax
    return sum(a.nbytes for a in jax.tree_util.tree_leaves(model.weights)
               if hasattr(a, "nbytes"))


class Bench:
    """One model on one kernel: a runner with a slot per stream and each slot's pages."""

    def __init__(self, model, streams: int, step: int, split=None):
        from kinetic.engine.engine_config import Split
        from kinetic.engine.runner import Runner, RunnerConfig
        P = -(-(max(PROMPT_LEN, DECODE_AT) + 16) // PAGE)
        self.cfg = RunnerConfig(step_tokens=step, num_slots=streams, page_size=PAGE,
                                num_pages=streams * P + 1, pages_per_slot=P,
                                split=split or Split())
        self.runner = Runner(model, self.cfg)
        self.table = (1 + np.arange(streams * P, dtype=np.int32)).reshape(streams, P)

    def write_index(self, positions, slots):
        """Where the cache rows of `positions` in `slots` go (their pages' rows)."""
        return self.table[slots, positions // PAGE] * PAGE + positions % PAGE

    def step(self, tokens, positions, slots):
        tokens, positions, slots = map(np.asarray, (tokens, positions, slots))
        self.resume(slots, positions)
        return self.runner.step_device(tokens, positions, slots,
                                       self.write_index(positions, slots), self.table)

    def resume(self, slots, positions):
        """A recurrent model's (Qwen3.5's) slots taken to hold states that end where their
        first rows here start: the bench runs a step at one position again and again, and
        the runner otherwise refuses a row its slot's state does not reach
        (engine/recurrent_state.py). The states' values are whatever is there, as the
        weights are random; the work a step does is the same."""
        state = self.runner.state
        if state is None:
            return
        slots, positions = np.ravel(slots), np.ravel(positions)
        for r, (s, p) in enumerate(zip(slots, positions)):
            if r == 0 or s != slots[r - 1]:   # the slot's first row
                state.committed[int(s)], state.pending[int(s)] = int(p), 0


def invariance(bench: Bench, ids: np.ndarray, others: np.ndarray, streams: list[int]) -> dict:
    """{B: whether slot 0's 16 logit rows are the same bytes in B-row steps as alone}."""
    def feed(B: int) -> bytes:
        rows = []
        for p in range(len(ids)):
            toks = np.concatenate([[ids[p]], others[:B - 1, p]])
            logits = bench.step(toks, np.full(B, p), np.arange(B))
            rows.append(np.asarray(logits[0]))
        return np.stack(rows).tobytes()
    alone = feed(1)
    return {B: feed(B) == alone for B in streams if B > 1}


def write_shape(path: str, spec: dict, qtype: str, tiny: bool = False) -> int:
    """A random-weight GGUF of a SHAPES spec (TINY's sizes over it with tiny) at path, in
    qtype; returns its layers (module docstring: tests/tiny_models.py's random_weights)."""
    from tests.tiny_models import write_tiny_model
    shape = {**spec, **(TINY if tiny else {})}
    arch = shape.pop("arch")
    write_tiny_model(path, arch, qtype=qtype, context_length=2048, random_weights=True,
                     **shape)
    return shape["n_layer"]


def measure(name: str, spec: dict, qtype: str, args, bandwidth: float, folder: str) -> dict:
    import jax

    from kinetic.model.loader import load_model
    path = os.path.join(folder, f"{name}-{qtype}.gguf")
    write_shape(path, spec, qtype, args.tiny)
    row = {"model": name, "qtype": qtype, "tiny": args.tiny}
    model = load_model(path, kernel="pallas")
    row["weight_bytes"] = weight_bytes(model)
    row["bound_ms"] = 1e3 * row["weight_bytes"] / (bandwidth / 2)   # read bandwidth
    top = max(args.streams)
    if args.quick:   # decode, and a row's bits alone and among B (a decode dot's rows
        step = max(top, args.prompt_step) if args.prompt else top   # may vary)
        bench, rng = Bench(model, top, step), np.random.default_rng(0)
        vocab = int(model.weights["token_embd"].shape[1])
        row["bitwise"] = {str(B): same for B, same in invariance(
            bench, rng.integers(0, vocab, 16), rng.integers(0, vocab, (top, 16)),
            args.streams).items()}
        decode(row, bench, rng, vocab, args)
        if args.prompt:
            row["prompt_tok_s"] = prompt_speed(bench, rng, vocab, args)
        return row
    # first: on a CPU, tracing the pieces as for a GPU clears JAX's caches (target.for_gpu)
    row["row_pieces"] = row_pieces(model.config, args.streams, np.random.default_rng(1))
    bench = Bench(model, top, max(top, args.prompt_step))
    rng = np.random.default_rng(0)
    vocab = int(model.weights["token_embd"].shape[1])
    ids = rng.integers(0, vocab, 16)
    others = rng.integers(0, vocab, (top, 16))
    row["bitwise"] = {str(B): same for B, same in
                      invariance(bench, ids, others, args.streams).items()}
    decode(row, bench, rng, vocab, args)
    row["prompt_tok_s"] = prompt_speed(bench, rng, vocab, args)
    row["matmuls"] = matmuls(model, bandwidth, args.reps, head=not args.tiny)
    del bench
    if args.split_check:
        row["split1"] = split_check(model, top, args, rng, vocab)
    dense = Bench(load_model(path, kernel="xla", dtype="bfloat16"), 16, 16)
    toks = rng.integers(0, vocab, 16)
    row["xla_bf16_16_tok_s"] = 16 / timed(
        lambda: dense.step(toks, np.full(16, DECODE_AT), np.arange(16)).block_until_ready(),
        args.reps)
    row["device"] = jax.devices()[0].device_kind
    if args.llama_cpp:
        row["llama_cpp"] = llama_cpp(args.llama_cpp, path, args.streams)
    return row


def decode(row: dict, bench: Bench, rng, vocab: int, args) -> dict:
    """row with the decode figures: tok/s of a B-row step at each --streams, the 1-row
    step's ms, the server's 4-step loop's ms a step, and each beside the bound."""
    row["decode_tok_s"] = {}
    for B in args.streams:
        toks = rng.integers(0, vocab, B)
        t = timed(lambda: bench.step(toks, np.full(B, DECODE_AT), np.arange(B))
                  .block_until_ready(), args.reps)
        row["decode_tok_s"][str(B)] = B / t
        if B == 1:
            row["one_row_ms"] = 1e3 * t
    row["loop_steps"], row["loop_one_row_ms"] = loop_step_ms(bench, rng, vocab, args.reps)
    row["of_bound"] = row["bound_ms"] / row["one_row_ms"] if "one_row_ms" in row else None
    row["of_bound_loop"] = row["bound_ms"] / row["loop_one_row_ms"]
    row["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    from kinetic.kernels import pallas_matmul
    row["decode_dot_rows"] = pallas_matmul.decode_rows()
    row["gpu_norm"] = os.environ.get("KINETIC_GPU_NORM", "pallas")
    row["gpu_delta"] = os.environ.get("KINETIC_GPU_DELTA", "pallas")
    row["gpu_attention"] = os.environ.get("KINETIC_GPU_ATTENTION", "split")
    return row


def llama_cpp(folder: str, path: str, streams: list[int], timeout: float = 120) -> dict:
    """llama.cpp's llama-batched-bench (in `folder`) on the file at `path`: {"cmd",
    "decode_tok_s": {B: tok/s}, "prompt_tok_s"}, or {"cmd", "error"} when it fails."""
    from bench.probes import cpu_has
    from bench.servers import link_shared_libraries
    binary = os.path.join(folder, "llama-batched-bench")
    link_shared_libraries(binary)
    cmd = [binary, "-m", path, "-ngl", "99", "-npp", str(PROMPT_LEN), "-ntg", str(LLAMA_TG),
           "-npl", ",".join(map(str, streams)),
           "-c", str(max(streams) * (PROMPT_LEN + LLAMA_TG)), "--output-format", "jsonl"]
    if cpu_has("amx_tile"):          # llama.cpp's CPU repacking dies on AMX (SIGILL)
        cmd.append("--no-repack")
    out = {"cmd": " ".join(cmd)}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {**out, "error": f"{type(e).__name__}: {e}"}
    found = {r["pl"]: r for r in map(json.loads, (line for line in done.stdout.splitlines()
                                                  if line.startswith("{")))}
    if done.returncode or not found:
        return {**out, "error": f"exit {done.returncode}: {done.stderr[-600:]}"}
    out["decode_tok_s"] = {str(B): r["speed_tg"] for B, r in found.items()}
    out["prompt_tok_s"] = found[1]["speed_pp"] if 1 in found else None
    # a CUDA build that finds no GPU runs on the CPU: say so rather than pass it off
    log = done.stderr + done.stdout
    out["on_gpu"] = "ggml_cuda_init: found" in log and "CUDA0" in log
    return out


def row_pieces(cfg, streams: list[int], rng) -> dict:
    """The step's row-wise pieces that XLA computes on a GPU (on a CPU they run in C++,
    layers._native_rows, because XLA's CPU code changed a row's bits with the row count),
    each jitted alone at the model's widths, and the norm's Pallas kernel that a GPU's
    step runs instead of XLA's (kernels/pallas_norm.py): {piece: {B: whether row 0 has
    the same bytes among B rows as alone}}. Where "bitwise" reads DIFFERS, this names the
    piece to move into Pallas; where XLA's norm keeps every row, Pallas' could go back to
    XLA (KINETIC_GPU_NORM=xla)."""
    import jax
    import jax.numpy as jnp

    from kinetic.kernels import pallas_norm as kernel_norm
    from kinetic.kernels import target
    from kinetic.model import layers

    def rope(x, positions):
        cos, sin = layers.rope_angles(positions, cfg, cfg.rope_base)
        return layers.apply_rope(x, cos, sin, cfg.rope_neox)
    top = max(streams)
    normal = rng.standard_normal

    def xla_norm(x, w):
        return layers.xla_rms_norm(x, w, cfg.norm_eps)

    def pallas_norm(x, w):
        return kernel_norm.rms_norm(x, w, cfg.norm_eps)
    rows, heads = normal((top, cfg.d_model)), normal((top, cfg.n_head, cfg.head_dim))
    pieces = {   # name: (function, its per-row inputs at `top` rows, its other inputs)
        "rms_norm (xla)": (xla_norm, [rows], [normal(cfg.d_model)]),
        "rms_norm (xla, head)": (xla_norm, [heads], [normal(cfg.head_dim)]),
        "rms_norm (pallas)": (pallas_norm, [rows], [normal(cfg.d_model)]),
        "rms_norm (pallas, head)": (pallas_norm, [heads], [normal(cfg.head_dim)]),
        "rope": (rope, [normal((top, cfg.n_head, cfg.head_dim)),
                        np.full(top, DECODE_AT + 3)], []),
        "silu x up": (layers.silu_times, [normal((top, cfg.d_ffn)), normal((top, cfg.d_ffn))],
                      []),
    }

    def device(a):
        return jnp.asarray(a, jnp.int32 if a.dtype.kind == "i" else jnp.float32)
    out = {}
    for name, (f, per_row, fixed) in pieces.items():
        g = jax.jit(f)

        def first_row(B):
            args = [device(a[:B]) for a in per_row] + [device(a) for a in fixed]
            return np.asarray(g(*args)[0]).tobytes()
        # XLA's code for rotary and silu as on a GPU, even on a CPU (whose steps run them
        # in C++); the Pallas norm as this backend runs it (interpreted on a CPU)
        as_gpu = "pallas" not in name and jax.default_backend() != "gpu"
        with target.for_gpu() if as_gpu else contextlib.nullcontext():
            alone = first_row(1)
            out[name] = {str(B): first_row(B) == alone for B in streams if B > 1}
    return out


def matmuls(model, bandwidth: float, reps: int, head: bool = True) -> dict:
    """Each of layer 0's projections and the output's, alone at one row (a decode step's
    matmul), and the ones layers.linear_many multiplies in one launch (q+k+v, gate+up:
    pallas_matmul.matmul_many): the tiling (kernels/pallas_matmul.tiling; bn, bk, chunks,
    each weight's), programs, ms and the fraction of its own bandwidth bound (its planes'
    bytes over the copy bandwidth's read half), so a step short of its bound shows whether
    the kernel or what surrounds it is short, and what one launch saves over several.
    head: the output's too (interpreted, a vocabulary's rows take seconds)."""
    import jax

    from kinetic.kernels import pallas_matmul as pm
    from kinetic.model.layers import PLANES
    layer = model.weights["blk"][0]
    weights = {**layer, **({"output": model.weights["output"]} if head else {})}
    groups = [[name] for name in weights]
    groups += [names for names in (["attn_q", "attn_k", "attn_v"], ["ffn_gate", "ffn_up"])
               if all(n in layer for n in names)]
    f = jax.jit(pm.matmul_many)
    out, seen = {}, []
    for names in groups:
        ws = [getattr(weights[n], "data", None) for n in names]
        if (any(getattr(weights[n], "fmt", None) != PLANES or weights[n].data.experts
                    for n in names) or (len(ws) == 1 and ws[0].shape in seen)):
            continue
        seen += [w.shape for w in ws]
        tiles = [pm.tiling(w.q.shape[0], w.shape[1]) for w in ws]
        x = jax.numpy.asarray(np.random.default_rng(0).standard_normal((1, ws[0].shape[1])),
                              jax.numpy.float32)
        ms = 1e3 * timed(lambda: jax.block_until_ready(f(x, ws)), reps)
        nbytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(ws))
        row = out["+".join(names)] = {
            "shape": (sum(w.shape[0] for w in ws), ws[0].shape[1]),
            "tiling": " / ".join(f"{t.bn}, {t.bk}, {t.chunks}" for t in tiles),
            "programs": sum(w.q.shape[0] // t.bn * t.chunks for w, t in zip(ws, tiles)),
            "ms": ms, "of_bound": 1e3 * nbytes / (bandwidth / 2) / ms}
        # the same call with one-row dots (pallas_matmul.dot_rows: a float weight's 16-row
        # dot does 16 times a row's FMAs; a block format's dots are exact integers either
        # way): its time, and whether the row's bytes are the 16-row dots'
        small = jax.jit(lambda x, ws: pm.matmul_many(x, ws))
        before, pm.DECODE_ROWS = pm.DECODE_ROWS, 1
        try:
            row["ms_1row_dot"] = 1e3 * timed(lambda: jax.block_until_ready(small(x, ws)), reps)
            row["same_1row_dot"] = all(np.asarray(a).tobytes() == np.asarray(b).tobytes()
                                       for a, b in zip(small(x, ws), f(x, ws)))
        finally:
            pm.DECODE_ROWS = before
    return out


def prompt_speed(bench: Bench, rng, vocab: int, args) -> float:
    """tok/s of one PROMPT_LEN-token prompt in steps of --prompt-step rows."""
    chunks = [np.arange(s, min(s + args.prompt_step, PROMPT_LEN))
              for s in range(0, PROMPT_LEN, args.prompt_step)]
    prompt = rng.integers(0, vocab, PROMPT_LEN)

    def whole_prompt():
        for pos in chunks:
            out = bench.step(prompt[pos], pos, np.zeros(len(pos), int))
        out.block_until_ready()
    return PROMPT_LEN / timed(whole_prompt, max(3, args.reps // 3))


def loop_step_ms(bench: Bench, rng, vocab: int, reps: int) -> tuple[int, float]:
    """(N, ms a step) of one sequence's greedy decode as the server runs it when nothing
    else can come: N steps from position 512 in one device call (Runner.decode_steps, N the
    engine's default decode_steps), so the host's work and the call's launch are paid once
    per N tokens, not once per token as in bench.step."""
    from kinetic.engine.engine_config import EngineConfig
    N = EngineConfig().decode_steps
    grid = DECODE_AT + np.arange(N)[:, None]
    write = bench.write_index(grid, 0)
    token, slot = rng.integers(0, vocab, 1), np.zeros(1, int)
    t = timed(lambda: bench.resume(slot, grid[0]) or bench.runner.decode_steps(
        token, grid, slot, write, bench.table, (None,)), reps)
    return N, 1e3 * t / N


def split_check(model, top: int, args, rng, vocab: int) -> dict:
    """The model through the split's code path over one device (`-sm row -tp 1`) beside
    an unsplit runner, both with empty caches: per row count, the same logits' bytes and
    both decode speeds."""
    from kinetic.engine.engine_config import Split
    step = max(top, args.prompt_step)
    bench, split = Bench(model, top, step), Bench(model, top, step, Split("row", 1))
    out = {}
    for B in args.streams:
        toks = rng.integers(0, vocab, B)
        at = np.full(B, DECODE_AT + 1)
        same = (np.asarray(split.step(toks, at, np.arange(B))).tobytes()
                == np.asarray(bench.step(toks, at, np.arange(B))).tobytes())
        times = [timed(lambda b=b: b.step(toks, np.full(B, DECODE_AT), np.arange(B))
                       .block_until_ready(), args.reps) for b in (bench, split)]
        out[str(B)] = {"same_bytes": same, "unsplit_tok_s": B / times[0],
                       "split1_tok_s": B / times[1]}
    del bench, split
    return out


def table(rows: list[dict], streams: list[int]) -> str:
    head = (["model", "qtype", "bitwise"] + [f"{B} tok/s" for B in streams]
            + ["prompt tok/s", "bound ms", "1-row ms", "of bound", "1-row ms (loop)",
               "of bound (loop)", "xla bf16@16 tok/s"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bad = [B for B, same in r["bitwise"].items() if not same]
        cells = ([r["model"], r["qtype"], "same" if not bad else "DIFFERS at " + ",".join(bad)]
                 + [f"{r['decode_tok_s'][str(B)]:.0f}" for B in streams]
                 + [f"{r['prompt_tok_s']:.0f}", f"{r['bound_ms']:.3f}",
                    f"{r.get('one_row_ms', float('nan')):.3f}",
                    f"{r['of_bound']:.2f}" if r["of_bound"] else "-",
                    f"{r['loop_one_row_ms']:.3f}", f"{r['of_bound_loop']:.2f}",
                    f"{r['xla_bf16_16_tok_s']:.0f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matmul_table(rows: list[dict]) -> str:
    lines = ["| model | qtype | weights | [N, K] | bn, bk, chunks | programs | ms | of bound "
             "| ms, 1-row dots | same bytes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for name, m in r["matmuls"].items():
            lines.append(f"| {r['model']} | {r['qtype']} | {name} | {list(m['shape'])} | "
                         f"{m['tiling']} | {m['programs']} | "
                         f"{m['ms']:.4f} | {m['of_bound']:.2f} | {m['ms_1row_dot']:.4f} | "
                         f"{'yes' if m['same_1row_dot'] else 'NO'} |")
    return "\n".join(lines)


def anchor_table(rows: list[dict], streams: list[int]) -> str:
    """llama.cpp's tok/s on the same files, each with kinetic's / llama.cpp's beside it."""
    head = (["model", "qtype"] + [f"{B} tok/s (x)" for B in streams] + ["prompt tok/s (x)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a = r.get("llama_cpp")
        if a is None:
            continue
        if "error" in a:
            lines.append(f"| {r['model']} | {r['qtype']} | failed: "
                         f"{a['error'].splitlines()[0][:120]} |")
            continue

        def cell(theirs, ours):
            return "-" if theirs is None else f"{theirs:.0f} ({ours / theirs:.2f}x)"
        where = "" if a.get("on_gpu") else " (llama.cpp on the CPU)"
        cells = ([r["model"], r["qtype"] + where]
                 + [cell(a["decode_tok_s"].get(str(B)), r["decode_tok_s"][str(B)])
                    for B in streams]
                 + [cell(a["prompt_tok_s"], r["prompt_tok_s"])])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", action="append", choices=sorted(SHAPES))
    p.add_argument("--qtype", action="append")
    p.add_argument("--streams", default="1,2,7,8,16,64,256")
    p.add_argument("--prompt-step", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--split-check", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="decode, the loop and the row bits only (an A/B of XLA_FLAGS, "
                        "KINETIC_PALLAS_DECODE_ROWS)")
    p.add_argument("--prompt", action="store_true",
                   help="with --quick: a 512-token prompt's tok/s too (Qwen3.5's delta rule "
                        "runs a prompt's tokens one after another)")
    p.add_argument("--llama-cpp", metavar="DIR",
                   help="a folder holding llama.cpp's llama-batched-bench, run on each file")
    args = p.parse_args(argv)
    args.streams = sorted({int(s) for s in args.streams.split(",")})
    import jax
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"devices {[d.device_kind for d in jax.devices()]}", flush=True)
    bandwidth = copy_bandwidth(args.reps, args.tiny)
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + written)", flush=True)
    rows: list[dict] = []
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        "jax": jax.__version__, "backend": jax.default_backend(),
                        "device": jax.devices()[0].device_kind, "copy_GBps": bandwidth / 1e9,
                        "command": " ".join(sys.argv), "rows": rows}
    with tempfile.TemporaryDirectory() as folder:
        for name in args.shape or list(SHAPES):
            d = SHAPES[name]["d_model"] if not args.tiny else TINY["d_model"]
            for qtype in args.qtype or ["Q4_0", "Q8_0", "Q4_K"]:
                if qtype.endswith("_K") and d % 256:
                    continue
                started = time.perf_counter()
                rows.append(measure(name, SHAPES[name], qtype, args, bandwidth, folder))
                print(f"{name} {qtype}: {time.perf_counter() - started:.0f} s "
                      f"{json.dumps(rows[-1])}", flush=True)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, "gpu.json"), "w") as f:
                        json.dump(result, f, indent=1)
    if args.quick:
        for r in rows:
            same = all(r["bitwise"].values())
            print(f"{r['model']} {r['qtype']} XLA_FLAGS={r['xla_flags']!r}, decode dots of "
                  f"at least {r['decode_dot_rows']} rows, KINETIC_GPU_NORM={r['gpu_norm']}, "
                  f"KINETIC_GPU_DELTA={r['gpu_delta']}, "
                  f"KINETIC_GPU_ATTENTION={r['gpu_attention']}, a row's bits "
                  f"{'the same' if same else 'DIFFER'} among B rows: "
                  + ", ".join(f"{B} rows {t:.0f} tok/s" for B, t in r["decode_tok_s"].items())
                  + f"; loop {r['loop_one_row_ms']:.3f} ms a step, "
                  f"{r['of_bound_loop']:.2f} of the bound ({r['bound_ms']:.3f} ms)"
                  + (f"; a {PROMPT_LEN}-token prompt {r['prompt_tok_s']:.0f} tok/s"
                     if "prompt_tok_s" in r else ""))
        return 0
    text = table(rows, args.streams)
    pieces = [f"{r['model']} {r['qtype']} {name}: DIFFERS at {', '.join(bad)}"
              for r in rows for name, same in r["row_pieces"].items()
              if (bad := [B for B, ok in same.items() if not ok])]
    text += ("\n\nrow-wise pieces: " + ("; ".join(pieces) if pieces else
             "every row the same bytes alone and among B rows, at every B"))
    text += "\n\nmatmuls alone, one row\n\n" + matmul_table(rows)
    if args.llama_cpp:
        text += ("\n\nllama.cpp on the same files (x: kinetic's tok/s over llama.cpp's)\n\n"
                 + anchor_table(rows, args.streams))
    if args.out:
        with open(os.path.join(args.out, "gpu.md"), "w") as f:
            f.write(f"{result['date']}, {result['device']}, jax {result['jax']}, copy "
                    f"{bandwidth / 1e9:.0f} GB/s\n\n{text}\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
