"""`kinetic serve`'s limits, on a real server with small ones: a client has 1 second to send
its request, and 2 connections are served at once. Also: 503 while loading, and SIGINT /
SIGTERM ending the process cleanly."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.conftest import real_model_file
from tests.serve_process import (ServeProcess, raw_request, read_to_end, read_until,
                                 serving, split_response)

pytestmark = pytest.mark.real_model

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    # -c 8192: each slot holds 4096 tokens, so a stream outlives the 5 s a stop gives it
    with serving(real_model_file("smollm2"), "-c", "8192", "-np", "2", "--timeout", "1",
                 "--max-connections", "2") as s:
        yield s


def test_slow_headers_are_cut(server):
    with server.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        assert read_to_end(sock) == b""  # closed without an answer; the socket would time out


def test_slow_body_is_cut_with_408(server):
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}]}).encode()
    with server.connect() as sock:
        sock.sendall(raw_request("POST", CHAT, {"Content-Type": "application/json",
                                                "Content-Length": str(len(body))}) + body[:10])
        status, headers, rest = split_response(read_to_end(sock))
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(rest)["error"]["type"] == "invalid_request_error"


def test_an_answer_sent_before_the_body_has_come_closes_the_connection(server):
    """/v1/embeddings on a text model is refused before its body is read: that answer says
    Connection: close, so that no client sends its next request on a connection the server
    then drops (a request was lost so before). Here the body never comes whole."""
    body = b'{"input": "' + b"x" * 100_000
    with server.connect() as sock:
        sock.sendall(raw_request("POST", "/v1/embeddings", {
            "Content-Type": "application/json", "Content-Length": str(len(body) + 1000)}) + body)
        status, headers, rest = split_response(read_to_end(sock))
    assert status == 400 and headers["connection"] == "close", (status, headers)
    assert json.loads(rest.partition(b"HTTP/1.1")[0])["error"]["type"] == \
        "invalid_request_error"


@pytest.mark.parametrize("size", [17_000, 40_000])
def test_headers_past_16_kib_are_a_431_however_they_come(server, size):
    """In one write too: h11's own limit holds only while the headers are incomplete, and
    Hypercorn reads up to 64 KiB at a time."""
    with server.connect() as sock:
        sock.sendall(raw_request("GET", "/v1/models", {"X-Big": "x" * size}))
        status, headers, rest = split_response(read_to_end(sock))
    assert status == 431 and headers["connection"] == "close", (status, headers)
    assert "16 KiB" in json.loads(rest)["error"]["message"]


def _start_stream(server):
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": 80, "temperature": 1.0, "seed": 1, "ignore_eos": True,
                       "stream": True}).encode()
    sock = server.connect()
    sock.sendall(raw_request("POST", CHAT, {"Content-Type": "application/json",
                                            "Content-Length": str(len(body))}, body))
    assert b"200" in read_until(sock, b"\r\n")
    read_until(sock, b'"content":"')  # generating: the connection is busy, not idle
    return sock


def test_connections_past_the_limit_get_503(server):
    streams = []
    try:
        streams = [_start_stream(server), _start_stream(server)]
        with server.connect() as extra:
            extra.sendall(raw_request("GET", "/v1/health", {}))
            status, headers, body = split_response(read_to_end(extra))
        assert status == 503 and headers["connection"] == "close"
        err = json.loads(body)["error"]
        assert err["type"] == "unavailable_error" and "2 open connections" in err["message"]
    finally:
        for s in streams:
            s.close()
    end = time.monotonic() + 120  # the server sees the streams close, then serves again
    while server.request("GET", "/v1/health")[0] != 200:
        assert time.monotonic() < end, server.output()
        time.sleep(0.2)


@pytest.mark.parametrize("path", [b"/v1/mod\xc3\xa9ls", b"/v1/\x00models", b"/v1/a b"])
def test_a_path_http_cannot_carry_gets_a_json_400(server, path):
    with server.connect() as sock:
        sock.sendall(b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, body = split_response(read_to_end(sock))
    assert status == 400 and headers["content-type"] == "application/json"
    err = json.loads(body)["error"]
    assert err["type"] == "invalid_request_error" and "percent-encode" in err["message"]


def _chunked_body(sock) -> bytes:
    """The rest of a chunked answer, decoded, checked to end with the terminating chunk."""
    data = read_to_end(sock)
    assert data.endswith(b"0\r\n\r\n"), data[-200:]
    out, rest = b"", data
    while True:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, rest = out + rest[:n], rest[n + 2:]


def test_sigterm_ends_running_streams_with_an_error_then_stops(server):
    # a stream in each shape: OpenAI's SSE and Ollama's NDJSON; both would run for thousands
    # of tokens, far past the 5 s a stop gives them
    chat = json.dumps({"messages": [{"role": "user", "content": "Tell me a story."}],
                       "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
                       "stream": True}).encode()
    generate = json.dumps({"model": "m", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "raw": True,
                           "options": {"num_predict": 4000, "temperature": 0}}).encode()
    streams = []
    for path, body, marker in (("/v1/chat/completions", chat, b'"content":"'),
                               ("/api/generate", generate, b'"response":')):
        sock = server.connect()
        sock.sendall(raw_request("POST", path, {"Content-Type": "application/json",
                                                "Content-Length": str(len(body))}, body))
        head = read_until(sock, marker)
        assert b" 200 " in head.split(b"\r\n")[0], head
        streams.append((sock, head.partition(b"\r\n\r\n")[2]))
    server.proc.send_signal(signal.SIGTERM)
    (sse, sse_start), (ndjson, ndjson_start) = streams
    with sse, ndjson:
        sse_rest, ndjson_rest = _chunked_body(sse), _chunked_body(ndjson)
    events = [e for e in sse_rest.decode().split("\n\n") if e]
    assert events[-1].startswith("data: {"), events[-3:]
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error["type"] == "unavailable_error" and "stopping" in error["message"]
    last = json.loads(ndjson_rest.decode().strip().splitlines()[-1])
    assert set(last) == {"error"} and "stopping" in last["error"]
    assert server.proc.wait(timeout=120) == 0
    assert "kinetic: stopped" in server.output()


def test_503_while_loading_then_sigint():
    s = ServeProcess(real_model_file("smollm2"), "-c", "128")
    try:
        status, _, body = s.first_answer("/v1/health")
        if "kinetic: serving" not in s.output():  # printed before it serves: still loading
            assert status == 503, body
            assert body["error"]["type"] == "unavailable_error"
            assert body["error"]["message"].startswith("Loading model")
        assert s.signal(signal.SIGINT) == 0
        assert "stopped" in s.output()
    finally:
        s.close()
