"""One model served by two processes (kinetic/engine/hosts.py): `kinetic serve --coordinator
--num-processes 2 --process-id I`, each process with two CPU devices of its own
(XLA_FLAGS=--xla_force_host_platform_device_count=2), joined by jax.distributed over
localhost. Process 0 serves HTTP; process 1 follows its steps."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.serve_process import ROOT, ServeProcess, free_port, raw_request, read_until
from tests.tiny_models import write_tiny_model

TWO = "--xla_force_host_platform_device_count=2"
BODY = {"prompt": "hello there", "n_predict": 8, "temperature": 0, "n_probs": 2}
FLAGS = ("-c", "256", "-np", "1", "--draft-max", "0")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hosts") / "m.gguf"
    write_tiny_model(path, "llama", qtype="Q8_0", d_model=128, d_ffn=256, n_kv_head=4,
                     context_length=32768)
    return str(path)


class Follower:
    """`kinetic serve MODEL ... --process-id 1`, its output in a temporary file."""

    def __init__(self, model: str, *args: str):
        self._log = tempfile.NamedTemporaryFile(prefix="kinetic-follower-", suffix=".log")
        self.proc = subprocess.Popen([sys.executable, "-m", "kinetic.cli", "serve", model,
                                      *args], stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT)

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def two_processes(model: str, *flags: str) -> tuple[ServeProcess, Follower]:
    join = ("--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2")
    leader = ServeProcess(model, *FLAGS, *flags, *join, "--process-id", "0")
    follower = Follower(model, *FLAGS, *flags, *join, "--process-id", "1")
    return leader, follower


def alone_then_two(model: str, flags: tuple, ask, monkeypatch) -> tuple:
    """(ask(one process on one device), ask(the leader of two processes of two CPU devices
    each)), both serving `model` with `flags`; the follower still running after."""
    alone = ServeProcess(model, *FLAGS, *flags)
    try:
        alone.wait_ready()
        want = ask(alone)
    finally:
        alone.close()
    monkeypatch.setenv("XLA_FLAGS", TWO)
    leader, follower = two_processes(model, *flags)
    try:
        leader.wait_ready()
        got = ask(leader)
        assert follower.proc.poll() is None, follower.output()[-2000:]
    finally:
        leader.close()
        follower.close()
    return want, got


def answer(serve: ServeProcess):
    status, _, got = serve.request("POST", "/completion", BODY)
    assert status == 200, got
    return got["content"], got["completion_probabilities"]


@pytest.fixture(scope="module")
def expected(model_path) -> tuple:
    """The answer of one process on one device."""
    alone = ServeProcess(model_path, *FLAGS)
    try:
        alone.wait_ready()
        return answer(alone)
    finally:
        alone.close()


def test_two_processes_answer_as_one_and_stop_together(model_path, expected, monkeypatch):
    """A row split over the four devices of two processes gives the one-process answer;
    /props says how the model is split; stopping the leader stops the follower."""
    monkeypatch.setenv("XLA_FLAGS", TWO)
    leader, follower = two_processes(model_path, "-sm", "row")
    try:
        leader.wait_ready()
        status, _, props = leader.request("GET", "/props")
        assert status == 200 and props["split"] == {"mode": "row", "devices": 4}
        assert answer(leader) == expected
        assert "split by row over 4 devices" in leader.output()
        assert leader.signal(signal.SIGTERM) == 0
        assert follower.proc.wait(timeout=60) == 0, follower.output()[-2000:]
        assert "process 1 stopped with the leader" in follower.output()
    finally:
        leader.close()
        follower.close()


def test_a_follower_that_dies_mid_stream_ends_the_leader_cleanly(model_path, expected,
                                                                monkeypatch):
    """A layer split (the default across processes) answers as one process; then SIGKILL
    on the follower while a long answer streams: the stream ends with an error event
    naming the cause, and the leader exits on its own within seconds; nothing hangs,
    nothing is left running."""
    monkeypatch.setenv("XLA_FLAGS", TWO)
    leader, follower = two_processes(model_path, "-c", "32768")   # a long answer
    try:
        leader.wait_ready()
        status, _, props = leader.request("GET", "/props")
        assert props["split"] == {"mode": "layer", "devices": 4}
        assert answer(leader) == expected
        body = json.dumps({"prompt": "hello", "max_tokens": 100000, "temperature": 0,
                           "stream": True, "ignore_eos": True}).encode()
        sock = leader.connect(timeout=60)
        sock.sendall(raw_request("POST", "/v1/completions", {
            "Content-Type": "application/json", "Content-Length": str(len(body))}, body))
        first = read_until(sock, b'"text"')   # tokens are streaming
        assert b" 200 " in first.split(b"\r\n", 1)[0]
        follower.proc.kill()
        killed = time.monotonic()
        rest = read_until(sock, b'"error"')
        rest += read_until(sock, b"}}\n")
        # (the events arrive in HTTP/1.1 chunks: a chunk's size line before each)
        events = re.findall(rb'data: (\{"error".*?\}\})\n', first + rest)
        assert events, (first[-300:], rest[-500:])
        error = json.loads(events[0])["error"]
        assert "a process serving this model stopped or cannot be reached" in error["message"]
        assert error["type"] == "server_error"
        assert leader.proc.wait(timeout=60) == 1
        assert time.monotonic() - killed < 30
        assert "cannot go on" in leader.output()
    finally:
        leader.close()
        follower.close()


def test_a_recurrent_model_resumes_a_cached_prefix_across_processes(tmp_path, monkeypatch):
    """Qwen3.5's delta-rule layers split by layer over two processes: a prompt asked twice
    answers as one process both times, the second from the cached prefix (its recurrent
    state restored on every process from the leader's host copy: Runner.load_state)."""
    path = str(write_tiny_model(tmp_path / "qwen35.gguf", "qwen35", qtype="Q8_0", d_model=128,
                                d_ffn=256, n_kv_head=4, context_length=4096))
    body = dict(BODY, prompt="The quick brown fox jumps over the lazy dog. " * 8)

    def twice(serve: ServeProcess) -> list:
        out = []
        for _ in range(2):
            status, _, got = serve.request("POST", "/completion", body)
            assert status == 200, got
            out.append((got["content"], got["completion_probabilities"],
                        got["timings"]["cache_n"]))
        return out

    want, got = alone_then_two(path, (), twice, monkeypatch)
    assert got[1][2] > 16, got[1][2]   # the second resumed from the cached prefix
    assert [g[:2] for g in got] == [w[:2] for w in want] and want[0][:2] == want[1][:2]


def test_an_image_is_read_across_processes(tmp_path, monkeypatch):
    """--mmproj: the leader runs the vision projector and sends the image's rows with the
    step's inputs; the answer is one process's."""
    from tests import tiny_vision
    from tests.test_vision_api import CHATML, data_url, png
    text = str(tiny_vision.write_tiny_text_model(
        tmp_path / "text.gguf", "idefics3", qtype="Q8_0", output_scale=16.0, d_model=64,
        chat_template=CHATML))
    mmproj = str(tiny_vision.write_tiny_mmproj(tmp_path / "mmproj.gguf", "idefics3",
                                               projection_dim=64))
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": data_url(png(40, 30, 1))}}]}],
        "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}

    def ask(serve: ServeProcess):
        status, _, got = serve.request("POST", "/v1/chat/completions", body)
        assert status == 200, got
        choice = got["choices"][0]
        return choice["message"]["content"], choice["logprobs"], got["usage"]["prompt_tokens"]

    want, got = alone_then_two(text, ("-c", "1024", "--mmproj", mmproj), ask, monkeypatch)
    assert got == want and want[2] > 20


def test_a_draft_model_drafts_across_processes(model_path, monkeypatch):
    """--model-draft: the draft's Runner is split over the processes as the target's is,
    its calls mirrored to the followers' draft Runner; the answer is one process's with the
    same draft."""
    def ask(serve: ServeProcess):
        status, _, slots = serve.request("GET", "/slots")
        assert status == 200 and slots[0]["speculative"] is True
        return answer(serve)

    want, got = alone_then_two(model_path, ("-md", model_path, "--draft-max", "4"), ask,
                               monkeypatch)
    assert got == want
