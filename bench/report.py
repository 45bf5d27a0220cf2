"""The throughput benchmark's output: the table with its ratios, the JSON file, the PNG plot.

    table(res)              the figures of every server, the ratios to llama-server, the CPUs
                            other processes kept busy during each figure's best run, and the
                            memory-bandwidth bound of each decode figure
    write_json(res, path)
    save_run(path, started, cpu, argv, **fields)   another benchmark's run, with its header
    plot(res, path)         aggregate decode tokens/s against the number of streams, one line
                            per server (matplotlib, Agg backend, imported only here)

`res` is what bench/throughput.py's measure() returns, plus its header fields: "servers"
(name -> label, command, drafting), "best" (name -> figures), "streams", "prompt_tokens",
"decode_tokens", "bandwidth_used" (bytes/s), "step_bytes" (weight bytes read per decode
step), "model".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# kinetic (drafting off) / llama-server, the Speed II issue's (docs/performance.md): prompt,
# 1-stream decode, 4- and 8-stream aggregate at least; peak RSS at most, issue 40's (default
# caches; with q8_0 caches on both sides its target is 0.7x)
TARGETS = {"prompt_tps": 1.0, "decode_1": 0.9, "agg_4": 2.0, "agg_8": 2.5, "rss": -1.0}
BASE = "llama-server"


def fmt(x, spec="9.2f", unit="") -> str:
    if x is None:
        return "-".rjust(int(spec.split(".")[0] or 0))
    return f"{x:{spec}}{unit}"


def rows(res: dict) -> list[tuple]:
    """(label, key, {server: value}, {server: others' CPUs}, bound tokens/s or None)."""
    best, P = res["best"], res["prompt_tokens"]
    bound1 = res["bandwidth_used"] / res["step_bytes"]
    out = []

    def row(label, key, value, bound=None, others_key=None):
        vals = {n: value(b) for n, b in best.items()}
        others = {n: b.get((others_key or key) + "_others") for n, b in best.items()}
        out.append((label, key, vals, others, bound))

    row(f"prompt tok/s ({P}-token prompt)", "prompt_tps",
        lambda b: P / b["ttft"] if b.get("ttft") else None, others_key="ttft")
    row(f"time to first token, s ({P} tok)", "ttft", lambda b: b.get("ttft"))
    row("decode tok/s, 1 stream", "decode_1", lambda b: b.get("decode_1"), bound1)
    for k in res["streams"]:
        row(f"aggregate tok/s, {k} stream{'s' if k > 1 else ''}", f"agg_{k}",
            lambda b, k=k: b.get(f"agg_{k}"), k * bound1)
    row("peak RSS (VmHWM), MiB", "rss",
        lambda b: b["hwm"] / 2**20 if b.get("hwm") else None, others_key="-")
    return out


def table(res: dict) -> str:
    names = list(res["best"])
    others = [n for n in names if n != BASE]
    has_base = BASE in names
    w = 34
    short = {n: res["servers"][n]["short"] for n in names}
    head = f"{'':{w}}" + "".join(f" {short[n]:>10}" for n in names)
    if has_base:
        head += "".join(f" {short[n] + '/l':>8}" for n in others) + f" {'target':>10}"
    head += f"  {'others*':>14}  {'bound**':>8}"
    out = [head]
    for label, key, vals, busy, bound in rows(res):
        line = f"{label:{w}}" + "".join(f" {fmt(vals[n], '10.2f')}" for n in names)
        ratio = None
        if has_base:
            for n in others:
                r = vals[n] / vals[BASE] if vals[n] and vals[BASE] else None
                ratio = r if n == "kinetic" else ratio
                line += f" {fmt(r, '7.2f', 'x'):>8}"
            target = TARGETS.get(key)
            tgt = ""
            if target is not None:   # a negative target is an upper bound
                met = ratio is not None and (ratio >= target if target > 0
                                             else ratio <= -target)
                tgt = (f">={target:.2f}x" if target > 0 else f"<={-target:.2f}x") + (
                    "" if ratio is None else " ok" if met else " NO")
            line += f" {tgt:>10}"
        load = "/".join(fmt(busy[n], ".1f") for n in names) if key != "rss" else ""
        line += f"  {load:>14}  {fmt(bound, '8.1f')}" if bound else f"  {load:>14}"
        out.append(line.rstrip())
    legend = ", ".join(f"{short[n]} = {res['servers'][n]['label']}" for n in names)
    out.append(f"columns: {legend}.")
    if has_base:
        out.append("x/l: that server's figure over llama-server's; target: the Speed II "
                   "issue's (peak RSS: issue 40's, default caches), for kinetic with drafting "
                   "off.")
    out.append(f"*  CPUs kept busy by other processes during that (best) run, "
               f"{'/'.join(short[n] for n in names)}.")
    out.append(f"** tokens/s the memory bandwidth allows: {res['bandwidth_used'] / 1e9:.1f} "
               f"GB/s read (half of a copy's bytes moved) / {res['step_bytes'] / 1e6:.0f} MB "
               f"of weights read per step, "
               f"xK for K streams sharing each step's reads (drafted tokens aside).")
    return "\n".join(out)


def write_json(res: dict, path: str) -> None:
    Path(path).write_text(json.dumps(res, indent=1, default=str) + "\n")


def save_run(path: str, started, cpu: str, argv, **fields) -> None:
    """A benchmark run's JSON at `path`: when it started, the CPU, the arguments (argv, or
    sys.argv's when None), then its own fields; says where it went."""
    write_json({"date": started.isoformat(timespec="minutes"), "cpu": cpu,
                "argv": sys.argv[1:] if argv is None else list(argv), **fields}, path)
    print(f"figures written to {path}")


def plot(res: dict, path: str) -> None:
    """Aggregate decode tokens/s against streams, one line per server, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = res["streams"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    styles = {"llama-server": ("tab:gray", "s"), "kinetic": ("tab:blue", "o"),
              "kinetic+draft": ("tab:orange", "^")}
    for name, b in res["best"].items():
        ys = [b.get(f"agg_{k}") for k in ks]
        pts = [(k, y) for k, y in zip(ks, ys) if y is not None]
        if not pts:
            continue
        color, marker = styles.get(name, (None, "o"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color,
                label=res["servers"][name]["label"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks)
    ax.set_xticklabels([str(k) for k in ks])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    busy = [b.get(f"agg_{k}_others") for b in res["best"].values() for k in ks]
    busy = max((x for x in busy if x is not None), default=0.0)
    ax.set_title(f"{res['model']}: {res['decode_tokens']} tokens per stream, best of "
                 f"{res['reps']}; other processes kept up to {busy:.1f} CPUs busy\n"
                 f"{res['cpu_short']}, {res['date']}", fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
