"""A real `kinetic serve` process for black-box server tests, and raw HTTP helpers."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m kinetic.cli serve MODEL --port P ARGS...`, its output in a temporary file.
    `cli` replaces `-m kinetic.cli` (a test's script that patches kinetic, then runs it)."""

    def __init__(self, model: str, *args: str, cli: tuple[str, ...] = ("-m", "kinetic.cli")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="kinetic-serve-", suffix=".log",
                                                delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, *cli, "serve", model, "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT)

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def first_answer(self, path: str = "/v1/health", deadline: float = 120.0):
        """The first answer the server gives to GET `path` (it takes a moment to listen)."""
        end = time.monotonic() + deadline
        while True:
            self.check_alive()
            try:
                return self.request("GET", path)
            except OSError:
                if time.monotonic() > end:
                    raise
            time.sleep(0.2)

    def wait_ready(self, deadline: float = 900.0, poll: float = 0.5) -> None:
        """Poll /v1/health every `poll` seconds until it answers 200 (loading and compiling
        take a while)."""
        end = time.monotonic() + deadline
        while True:
            self.check_alive()
            try:
                status, _, _ = self.request("GET", "/v1/health")
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > end:
                raise AssertionError(f"server not ready after {deadline} s:\n{self.output()}")
            time.sleep(poll)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(f"kinetic serve exited with {self.proc.returncode}:\n"
                                 f"{self.output()}")

    def request(self, method: str, path: str, body=None, headers: dict | None = None,
                timeout: float = 300.0):
        """(status, headers (lower-case names), parsed JSON or raw bytes) of one request on a
        new connection."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            hdrs = dict(headers or {})
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
                hdrs.setdefault("Content-Type", "application/json")
            conn.request(method, path, body=body, headers=hdrs)
            resp = conn.getresponse()
            data = resp.read()
            try:
                parsed = json.loads(data)
            except ValueError:
                parsed = data
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, parsed
        finally:
            conn.close()

    def stream(self, method: str, path: str, body: dict, headers: dict | None = None) -> list:
        """The parsed JSON events of a server-sent-events answer, up to data: [DONE]
        (which must end it)."""
        status, _, data = self.request(method, path, body, headers)
        assert status == 200, data
        events = [e for e in data.decode().split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-3:]
        return [json.loads(e[len("data: "):]) for e in events[:-1]]

    def connect(self, timeout: float = 120.0) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=timeout)

    def signal(self, sig: int = signal.SIGTERM, wait: float = 120.0) -> int:
        """Send `sig` and wait for the exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=wait)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


@contextmanager
def serving(model: str, *args: str) -> Iterator[ServeProcess]:
    """A `kinetic serve` process, ready to answer, killed on leaving (a module fixture's
    body: `with serving(path, "-c", "512") as s: yield s`)."""
    s = ServeProcess(model, *args)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    """Bytes from `sock` until `marker` has arrived (or the peer closed)."""
    data = b""
    while marker not in data and len(data) < limit:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def raw_request(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def split_response(data: bytes) -> tuple[int, dict, bytes]:
    """(status, headers with lower-case names, body) of one raw HTTP/1.1 response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, body
