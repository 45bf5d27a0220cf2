"""One `kinetic serve` process per loaded model.

A worker listens on 127.0.0.1 at a port of its own with a random API key only the router
knows. `Workers.get(model)` starts one on first use and waits for its /v1/health (its
requests wait with it; `status` says "loading"), unloading first the least recently used
idle worker when --models-max are loaded. A worker that exits while loading fails its
model's requests with the end of its output; the others go on serving. `unload` ends the
process (SIGTERM, then SIGKILL after UNLOAD_SECONDS): its memory goes back to the system.
Ollama's keep_alive sets when an idle worker is unloaded (`expire`)."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kinetic.api.core import log
from kinetic.router.catalog import Model


UNLOAD_SECONDS = 10.0
LOAD_TIMEOUT = 1800.0
HEALTH_POLL = 0.03     # a loading worker's /v1/health is asked this often (s): the wait
                       # a switch adds past the worker's own start
FAILED_RETRY_SECONDS = 30.0   # a model that failed to load is tried again after this
RUNTIME_BYTES = 600 << 20   # a worker's memory beside its weights (JAX, compiled code, cache)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_models_max(sizes: list[int]) -> int:
    """--models-max 0: as many of the largest model as half the free memory holds (each
    counted at its file size plus RUNTIME_BYTES), at least 1."""
    from kinetic.engine.engine_config import available_memory   # imports no JAX
    biggest = max(sizes, default=0) + RUNTIME_BYTES
    return max(1, int(available_memory() * 0.5 // biggest))


@dataclass
class Worker:
    model: Model
    port: int
    key: str
    proc: subprocess.Popen
    log_path: Path
    state: str = "loading"          # loading, loaded, failed
    error: str | None = None
    busy: int = 0                   # requests passing through it now
    last_used: float = field(default_factory=time.monotonic)
    expires: float | None = None    # monotonic time it unloads once idle (keep_alive)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    key_file: Path | None = None    # removed once the worker has read it (or has ended)
    failed_at: float | None = None  # monotonic time its load failed (FAILED_RETRY_SECONDS)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " / ".join(line.strip() for line in text.strip().splitlines()[-lines:])


class Workers:
    """The router's workers by model name. `flags` are the `kinetic serve` flags every
    worker gets (the router's own engine flags), `presets` more per model name."""

    def __init__(self, flags: list[str], presets: dict[str, list[str]], models_max: int):
        self.flags, self.presets, self.models_max = flags, presets, models_max
        self.by_name: dict[str, Worker] = {}
        self._lock = asyncio.Lock()

    def status(self, name: str) -> str:
        w = self.by_name.get(name)
        return "unloaded" if w is None else w.state

    async def get(self, model: Model, retry: bool = False) -> Worker:
        """The loaded worker of `model`, started now if need be; APIError 503 (loading
        failed, saying why). A model that failed to load less than FAILED_RETRY_SECONDS ago
        is not started again (its 503 at once) unless `retry`."""
        from kinetic.api.errors import APIError
        async with self._lock:
            w = self.by_name.get(model.name)
            if (w is not None and w.failed_at is not None and not retry
                    and time.monotonic() - w.failed_at < FAILED_RETRY_SECONDS):
                # a model that just failed to load answers so at once: requests for a broken
                # file do not start a process each
                raise APIError(503, f"model {model.name} failed to load: {w.error}",
                               code="model_load_failed")
            if w is None or w.state == "failed" or w.proc.poll() is not None:
                if w is not None:
                    await self._end(w)
                await self._make_room()
                w = self._start(model)
        await w.ready.wait()
        if w.state != "loaded":
            raise APIError(503, f"model {model.name} failed to load: "
                           f"{w.error or 'it was unloaded while it loaded'}",
                           code="model_load_failed")
        w.last_used = time.monotonic()
        return w

    def _start(self, model: Model) -> Worker:
        port, key = free_port(), secrets.token_urlsafe(24)
        # the log's name holds the model's, cut to what a file name can hold
        stem = "".join(c if c.isalnum() or c in "._-" else "_" for c in model.path.stem)[:64]
        out = tempfile.NamedTemporaryFile(prefix=f"kinetic-worker-{stem}-",
                                          suffix=".log", delete=False)
        # the key in a file only this user can read (mkstemp's 0600), not on the command
        # line, which every local user can see; removed once the worker has read it
        fd, key_file = tempfile.mkstemp(prefix="kinetic-worker-key-")
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        args = [sys.executable, "-m", "kinetic.cli", "serve", str(model.path), "--host",
                "127.0.0.1", "--port", str(port), "--api-key-file", key_file,
                "--alias", model.name,
                *self.flags, *self.presets.get("*", []), *self.presets.get(model.name, [])]
        # the worker ends with this process, even one killed by SIGKILL
        # (serve_cli.die_with_router)
        env = dict(os.environ, KINETIC_ROUTER_PID=str(os.getpid()))
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env)
        out.close()
        w = Worker(model, port, key, proc, Path(out.name), key_file=Path(key_file))
        self.by_name[model.name] = w
        log.info("loading %s (%s, worker pid %d)", model.name, model.path, proc.pid)
        asyncio.get_running_loop().create_task(self._watch_load(w))
        return w

    async def _watch_load(self, w: Worker) -> None:
        began = time.monotonic()
        while True:
            if w.proc.poll() is not None:
                w.state, w.error = "failed", (w.output_tail() or
                                              f"its process exited with {w.proc.returncode}")
                log.error("%s failed to load: %s", w.model.name, w.error)
                break
            if await asyncio.to_thread(_healthy, w):
                w.state = "loaded"
                log.info("%s loaded in %.1f s", w.model.name, time.monotonic() - began)
                break
            if time.monotonic() - began > LOAD_TIMEOUT:
                w.state, w.error = "failed", f"not ready within {LOAD_TIMEOUT:.0f} s"
                w.proc.kill()
                break
            await asyncio.sleep(HEALTH_POLL)
        if w.state == "failed":
            w.failed_at = time.monotonic()
        _remove(w.key_file)   # read at the worker's start, before it listened
        w.ready.set()

    async def _make_room(self) -> None:
        """Unload least recently used idle workers until one more fits --models-max."""
        while len(self.by_name) >= self.models_max:
            idle = [w for w in self.by_name.values() if w.busy == 0 and w.state != "loading"]
            if not idle:
                log.info("every loaded model is busy: loading past --models-max %d",
                         self.models_max)
                return
            await self._end(min(idle, key=lambda w: w.last_used))

    async def unload(self, name: str) -> bool:
        async with self._lock:
            w = self.by_name.get(name)
            if w is None:
                return False
            await self._end(w)
            return True

    async def _end(self, w: Worker) -> None:
        self.by_name.pop(w.model.name, None)
        if w.proc.poll() is None:
            log.info("unloading %s", w.model.name)
            w.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(w.proc.wait, UNLOAD_SECONDS)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                await asyncio.to_thread(w.proc.wait)
        w.ready.set()
        _remove(w.log_path)
        _remove(w.key_file)

    async def expire(self) -> None:
        """Unload the idle workers whose keep_alive has run out (called every second)."""
        now = time.monotonic()
        for w in list(self.by_name.values()):
            if w.busy == 0 and w.expires is not None and now >= w.expires:
                async with self._lock:
                    if self.by_name.get(w.model.name) is w:
                        await self._end(w)

    async def close(self) -> None:
        for w in list(self.by_name.values()):
            await self._end(w)


def _remove(path: Path | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _healthy(w: Worker) -> bool:
    try:
        with urllib.request.urlopen(w.url + "/v1/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
