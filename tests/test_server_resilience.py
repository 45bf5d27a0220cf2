"""The server under overload, when it is stopped, and when its engine is stuck.

Real `kinetic serve` processes on a tiny random-weight model (tests/tiny_models.py): a
connection past --max-connections is answered 503 at once, before it has sent anything;
SIGTERM ends a long generation within seconds; SIGTERM, or a second signal at once, ends a
server whose engine thread is stuck in a step (the child patches Stepper.turn to hang:
nothing in kinetic helps it), and /health says so first. In this process, on the mock
engine: the stall clock and the engine's death as /health reports them, Engine.close's
timeout, the watchdog.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import socket
import threading
import time
import types

import pytest

from kinetic.api import listener as server_module
from kinetic.api.app import create_app
from kinetic.api.core import ServerConfig, ServerState, generation
from kinetic.api.errors import APIError
from kinetic.engine.request import GenerationRequest
from tests import mock_model as mm
from tests.serve_process import (ServeProcess, raw_request, read_to_end, read_until,
                                 serving, split_response)
from tests.tiny_models import write_tiny_model

LIMIT = 4
RUNNING = mm.ids("a")  # the mock answers b d h p a...: no end-of-generation for a while
STOP_BOUND = 15.0  # seconds from SIGTERM to exit the issue allows (the watchdog is at 10)
STUCK_TOKENS = 777  # the patched engine hangs in the turn of a request for this many tokens

STUCK_CLI = f'''"""kinetic's command, with an engine that hangs in any turn of a request for
{STUCK_TOKENS} tokens, as in a device call that never returns."""
import sys
import threading

from kinetic.cli import main
from kinetic.engine.turn import Stepper

turn = Stepper.turn


def stuck_turn(self, quiet):
    if any(job.request.max_tokens == {STUCK_TOKENS} for job in self.jobs.values()):
        print("test: the engine is stuck", flush=True)
        threading.Event().wait()
    turn(self, quiet)


Stepper.turn = stuck_turn
sys.exit(main())
'''


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("llama") / "tiny.gguf", "llama",
                                context_length=32768))


@pytest.fixture(scope="module")
def server(tiny_model):
    # slots of 16,500 tokens: a long generation (about 400 tokens/s here) outlives the 5 s a
    # stop gives it
    with serving(tiny_model, "-c", "33000", "-np", "2", "--max-connections", str(LIMIT)) as s:
        yield s


def completion(server, **fields) -> socket.socket:
    """A socket that has sent POST /v1/completions with `fields`."""
    body = json.dumps({"prompt": "Once upon a time", **fields}).encode()
    sock = server.connect()
    sock.sendall(raw_request("POST", "/v1/completions", {"Content-Type": "application/json",
                                                         "Content-Length": str(len(body))},
                             body))
    return sock


def assert_refused(data: bytes) -> None:
    status, headers, body = split_response(data)
    assert status == 503, data
    assert headers["content-type"] == "application/json"
    assert headers["connection"] == "close" and int(headers["retry-after"]) > 0
    assert int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "unavailable_error" and err["param"] is None and err["code"] is None
    assert f"{LIMIT} open connections" in err["message"]


def hold_a_place(server) -> http.client.HTTPConnection:
    """A connection the server has served, left open and idle (kept alive), so it surely
    holds a place. The server may not yet have seen an earlier connection close (then it
    refuses this one): try again."""
    end = time.monotonic() + 10
    while True:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        try:
            conn.request("GET", "/v1/health")
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                return conn
        except ConnectionError:
            pass
        conn.close()
        assert time.monotonic() < end, server.output()
        time.sleep(0.05)


def test_a_connection_past_the_limit_is_answered_at_once(server):
    idle = [hold_a_place(server) for _ in range(LIMIT)]
    try:
        with server.connect(timeout=1.0) as silent:  # sends nothing; recv times out in 1 s
            assert_refused(read_to_end(silent))
        with server.connect(timeout=1.0) as asking:
            asking.sendall(raw_request("GET", "/v1/health", {}))
            assert_refused(read_to_end(asking))
    finally:
        for sock in idle:
            sock.close()
    end = time.monotonic() + 10  # the server sees the idle ones close, then serves again
    while (answer := server.request("GET", "/v1/health"))[0] != 200:
        assert answer[0] == 503 and time.monotonic() < end, (answer, server.output())
        time.sleep(0.05)
    assert answer[2]["status"] == "ok"


def test_sigterm_during_a_long_generation_stops_within_seconds(server):
    with completion(server, max_tokens=16000, ignore_eos=True, temperature=1.0, seed=1,
                    stream=True) as sock:
        read_until(sock, b'"text":"')  # generating
        began = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        status = server.proc.wait(timeout=60)
        took = time.monotonic() - began
        rest = read_to_end(sock)
    out = server.output()
    assert status == 0 and took < STOP_BOUND, (took, out)
    assert b"[DONE]" not in rest  # cut, not finished: an error event says why
    assert b'"type":"unavailable_error"' in rest and b"the server is stopping" in rest
    assert "cancelled after" in out and out.rstrip().endswith("kinetic: stopped"), out


@pytest.mark.parametrize("second_signal", [False, True])
def test_a_stuck_engine_fails_health_and_sigterm_still_ends_the_process(
        tiny_model, tmp_path, second_signal):
    """SIGTERM: the stop waits for the engine as long as it may, then leaves it (status 1).
    A second signal (Ctrl+C again) does not wait at all."""
    script = tmp_path / "stuck_cli.py"
    script.write_text(STUCK_CLI)
    s = ServeProcess(tiny_model, "-c", "2048", "-np", "2", "--stall-timeout", "1",
                     cli=(str(script),))
    try:
        s.wait_ready()
        sock = completion(s, max_tokens=STUCK_TOKENS)
        end = time.monotonic() + 60
        while True:  # the engine sticks, then health fails once the step is a second old
            status, _, body = s.request("GET", "/v1/health", timeout=10)
            if status != 200:
                break
            assert time.monotonic() < end, s.output()
            time.sleep(0.2)
        assert "test: the engine is stuck" in s.output()
        assert status == 503 and body["error"]["type"] == "unavailable_error", body
        assert "has not finished a step for" in body["error"]["message"], body
        began = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        if second_signal:
            while "kinetic: stopping" not in s.output():
                assert time.monotonic() - began < STOP_BOUND, s.output()
                time.sleep(0.05)
            began = time.monotonic()
            s.proc.send_signal(signal.SIGINT)
        code = s.proc.wait(timeout=60)
        took = time.monotonic() - began
        sock.close()
        out = s.output()
        last = out.strip().splitlines()[-1]
        if second_signal:
            assert code == 1 and took < 3, (took, out)  # not the 9 s of waiting for the engine
            assert last == "kinetic: SIGINT again: stopped at once", out
        else:
            assert code == 1 and took < STOP_BOUND, (took, out)
            assert "stuck in a step" in last, out
    finally:
        s.close()


# --- in this process: the mock engine behind the app -------------------------------------

def health(state: ServerState) -> tuple[int, dict]:
    async def get():
        resp = await create_app(state).test_client().get("/v1/health")
        return resp.status_code, json.loads(await resp.get_data())
    return asyncio.run(get())


def ready_state(engine, **config) -> ServerState:
    state = ServerState(ServerConfig(**config), "mock")
    state.set_ready(types.SimpleNamespace(engine=engine))
    return state


def test_health_fails_while_a_step_runs_past_the_stall_timeout():
    engine = mm.make_engine()
    gate = mm.Gate(at=1)  # holds the engine thread inside its turn
    try:
        state = ready_state(engine, stall_timeout=0.2)
        assert engine.stalled_for() == 0.0
        assert health(state) == (200, {"status": "ok", "slots_idle": 2, "slots_processing": 0})
        engine.start(GenerationRequest(RUNNING, max_tokens=3), gate)
        gate.wait_reached()
        time.sleep(0.3)
        assert engine.stalled_for() > 0.2
        status, body = health(state)
        assert status == 503 and body["error"]["type"] == "unavailable_error"
        assert "has not finished a step for" in body["error"]["message"]
        assert "limit is 0.2 s" in body["error"]["message"]
        assert health(ready_state(engine, stall_timeout=60))[0] == 200  # a step, not a stall
        gate.release()
        assert gate.wait().finish_reason == "length"
        end = time.monotonic() + mm.TIMEOUT  # the last delta goes out before the turn ends
        while engine.stalled_for() != 0.0:
            assert time.monotonic() < end
            time.sleep(0.01)
        assert health(state)[0] == 200
    finally:
        gate.release()
        engine.close()


def test_health_fails_once_the_engine_thread_has_died(monkeypatch):
    died = []
    monkeypatch.setattr(threading, "excepthook", died.append)
    engine = mm.make_engine()
    try:
        def broken(*args, **kw):
            raise RuntimeError("device lost")
        engine.runner.step_device = broken
        result = mm.run(engine, GenerationRequest(RUNNING, max_tokens=3))
        assert result.finish_reason == "error"
        status, body = health(ready_state(engine))
        assert status == 503 and body["error"]["type"] == "unavailable_error"
        assert "device lost" in body["error"]["message"]
        assert [type(d.exc_value) for d in died] == [RuntimeError]

        async def new_request():   # a request after the death: 503, saying why
            with pytest.raises(APIError) as e:
                await generation(ready_state(engine), GenerationRequest(RUNNING),
                                 "test").__anext__()
            return e.value
        refused = asyncio.run(new_request())
        assert refused.status == 503 and "the engine has stopped" in refused.message
        assert "device lost" in refused.message
    finally:
        engine.close()


def test_close_waits_at_most_its_timeout_for_a_stuck_turn():
    engine = mm.make_engine()
    gate = mm.Gate(at=1)
    engine.start(GenerationRequest(RUNNING, max_tokens=3), gate)
    gate.wait_reached()
    began = time.monotonic()
    assert engine.close(timeout=0.2) is False  # stuck in its turn: not joined
    assert time.monotonic() - began < 5
    gate.release()  # the turn ends; the loop stops before the next one
    assert gate.wait().finish_reason == "cancelled"
    assert engine.close(timeout=10) is True


def test_the_watchdog_ends_the_process_unless_called_off():
    exits = []
    fired = threading.Event()

    def exit(message: str, status: int) -> None:
        exits.append((message, status))
        fired.set()

    began = time.monotonic()
    server_module.start_watchdog(0.2, exit)
    assert fired.wait(10) and time.monotonic() - began >= 0.2
    message = "not stopped after 0.2 s (the engine thread may be stuck in a step); exiting now"
    assert exits == [(message, 1)]
    fired.clear()
    server_module.start_watchdog(0.2, exit).set()
    assert not fired.wait(0.5)
