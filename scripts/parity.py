"""Parity with llama.cpp on the real models: tokenization, chat prompts, next-token
distributions (teacher-forced) and greedy continuations, against tests/data/reference/.

    python scripts/parity.py [smollm2 gemma3 qwen25coder] [--dtype bfloat16] [-ctk f16]
        [--llama-server PATH [--save DIR]]

Prints one line of figures per model (the numbers in docs/parity.md come from here).
With --llama-server, the continuations are recorded again first by that llama-server on this
machine (its defaults, `-c 2048 -np 1 -t 2`, with -ctk/-ctv as kinetic's when -ctk is given;
the same prompt ids, POST /completion as tests/data/reference/README.md describes), and
kinetic is measured against those: the recorded files came from another CPU kind, whose
kernels round otherwise (docs/parity.md). --save DIR keeps the answers recorded here (one
JSON per model, the reference's layout).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference"
KEYS = ("smollm2", "gemma3", "qwen25coder")


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64) - row.max()
    return row - np.log(np.exp(row).sum())


def top_kl(lp: np.ndarray, ref_top: list[dict], renormalize: bool = False) -> float:
    """KL(llama.cpp || kinetic) over the reference's top tokens: `ref_top` [{id, logprob}]
    (llama.cpp's log-probabilities), `lp` kinetic's log-softmax over the whole vocabulary.
    As recorded, the sum runs over those tokens' share of both distributions; renormalize:
    each side is first renormalized over those ids (a true KL of two distributions, >= 0)."""
    p = np.array([t["logprob"] for t in ref_top], np.float64)
    q = np.array([lp[t["id"]] for t in ref_top], np.float64)
    if renormalize:
        p, q = log_softmax(p), log_softmax(q)
    return float(np.sum(np.exp(p) * (p - q)))


def continuation_figures(model, continuations: list[dict], greedy_tokens: int = 16) -> dict:
    """Teacher-forced top-1 agreement and KL, and greedy continuations, against recorded
    continuations ({prompt_ids, tokens, steps: [{id, top_logprobs}]}; KL over the steps
    whose top_logprobs are given): feed prompt_ids and the chosen ids but the last; the row
    at len(prompt_ids) - 1 + j predicts step j."""
    tok = model.tokenizer
    top1, kls, kls_renorm, greedy_ok = [], [], [], 0
    for c in continuations:
        steps = c["steps"]
        ids = c["prompt_ids"] + [s["id"] for s in steps[:-1]]
        logits = model.logits(ids)
        first = len(c["prompt_ids"]) - 1
        for j, s in enumerate(steps):
            lp = log_softmax(logits[first + j])
            ref_top = s["top_logprobs"]
            # null where llama-server gave no probabilities (scripts/record_arch_refs.py):
            # its greedy choice is the top-1 there
            top1.append(int(np.argmax(lp)) == (ref_top[0]["id"] if ref_top else s["id"]))
            if ref_top:
                kls.append(top_kl(lp, ref_top))
                kls_renorm.append(top_kl(lp, ref_top, renormalize=True))
        got = [t for d in model.stream(c["prompt_ids"], greedy_tokens) for t in d.token_ids]
        # llama-server lists the end-of-generation token it stopped at; kinetic does not emit it
        want = [t for t in c["tokens"] if t not in tok.eog_ids]
        greedy_ok += got[:greedy_tokens] == want[:greedy_tokens]
    return {
        "positions": len(top1),
        "top1": float(np.mean(top1)),
        "mean_kl": float(np.mean(kls)),
        "max_kl": float(np.max(kls)),
        "mean_kl_renormalized": float(np.mean(kls_renorm)),
        "max_kl_renormalized": float(np.max(kls_renorm)),
        "greedy_equal": greedy_ok,
        "prompts": len(continuations),
    }


def measure(model, ref: dict, greedy_tokens: int = 16) -> dict:
    """Figures for one model against its reference file (see tests/data/reference/README)."""
    tok = model.tokenizer
    tokenize_ok = sum(
        tok.encode(t["text"], add_special=False, parse_special=False) == t["ids"]
        and tok.encode(t["text"], add_special=True, parse_special=True)
        == t["ids_add_special_parse_special"] for t in ref["tokenize"])
    chat_ok = sum(model.apply_chat_template(c["messages"],
                                            add_generation_prompt=c["add_generation_prompt"])
                  == c["prompt"] for c in ref["chat_templates"])
    prompt_ids_ok = sum(model.prompt_ids(c["prompt"]) == c["prompt_ids"]
                        for c in ref["continuations"])
    f = continuation_figures(model, ref["continuations"], greedy_tokens)
    n = len(ref["continuations"])
    return {
        "tokenize": f"{tokenize_ok}/{len(ref['tokenize'])}",
        "chat_prompts": f"{chat_ok}/{len(ref['chat_templates'])}",
        "prompt_ids": f"{prompt_ids_ok}/{n}",
        "positions": f["positions"],
        "top1": f["top1"],
        "mean_kl": f["mean_kl"],
        "max_kl": f["max_kl"],
        "greedy16": f["greedy_equal"] / n,
    }


def record_here(ref: dict, binary: str, gguf: str, cache_type: str | None) -> dict:
    """`ref` with its continuations recorded again by llama-server `binary` on this machine:
    the same prompt ids, greedy, N tokens each as recorded, top-20 raw log-probabilities;
    with `cache_type` its -ctk and -ctv (None: its default, f16)."""
    sys.path.insert(0, str(REFERENCE.parents[2]))
    from bench.servers import ready_llama_server
    from scripts.record_arch_refs import N_PROBS, greedy_steps, post
    out = []
    with ready_llama_server(binary, gguf, threads=2, flags=["-c", "2048", "-np", "1"],
                            cache_type=cache_type, timeout=600) as server:
        for c in ref["continuations"]:
            r = post(server, "/completion", {
                "prompt": c["prompt_ids"], "n_predict": len(c["tokens"]), "temperature": 0,
                "n_probs": N_PROBS, "post_sampling_probs": False, "cache_prompt": False,
                "return_tokens": True})
            out.append({**c, "content": r["content"], "tokens": r["tokens"],
                        "steps": greedy_steps(r, c["prompt"])})
    return {**ref, "continuations": out,
            "recorded_here": {"server_command": " ".join(server.cmd[1:])}}


def main() -> int:
    import kinetic
    from kinetic.engine.engine_config import CACHE_TYPES, cache_type_name
    from kinetic.fetch import MODELS, fetch_model
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help=f"any of {', '.join(KEYS)} (default: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--no-llama-rounding", action="store_true",
                    help="do not round activations as llama.cpp's CPU matmul does")
    ap.add_argument("-ctk", "--cache-type", default=None, choices=sorted(CACHE_TYPES),
                    help="kinetic's KV cache type (default: kinetic's default)")
    ap.add_argument("--llama-server", metavar="PATH",
                    help="record the continuations again with this llama-server first")
    ap.add_argument("--save", metavar="DIR", help="with --llama-server: keep them here")
    args = ap.parse_args()
    unknown = set(args.models) - set(KEYS)
    if unknown:
        ap.error(f"unknown model {', '.join(sorted(unknown))}; choose from {', '.join(KEYS)}")
    for key in args.models or KEYS:
        ref = json.loads((REFERENCE / f"{key}.json").read_text())
        gguf = str(fetch_model(key))
        if args.llama_server:
            ref = record_here(ref, args.llama_server, gguf, args.cache_type)
            if args.save:
                Path(args.save).mkdir(parents=True, exist_ok=True)
                (Path(args.save) / f"{key}.json").write_text(json.dumps(ref, indent=1))
        cache = {} if args.cache_type is None else {"cache_type": args.cache_type}
        model = kinetic.load(gguf, n_ctx=2048, dtype=args.dtype,
                             llama_rounding=not args.no_llama_rounding, **cache)
        figures = measure(model, ref)
        print(json.dumps({"model": MODELS[key].filename, "dtype": args.dtype,
                          "cache_type": cache_type_name(model.engine.config.kv_dtype),
                          "against": "llama-server here" if args.llama_server else
                          "tests/data/reference", **figures}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
