"""/metrics on a real `kinetic serve` process (SmolLM2, 2 slots): Prometheus text with exactly
docs/server.md's llamacpp: names, counters that add up to what the answers reported, whatever the
dialect and with requests running at once, and the requests_processing / requests_deferred
gauges while requests are in flight.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

from tests.conftest import real_model_file
from tests.serve_process import raw_request, read_until, serving

pytestmark = pytest.mark.real_model

N_CTX = 1024
COUNTERS = ["requests_total", "prompt_tokens_total", "prompt_tokens_cached_total",
            "prompt_seconds_total", "tokens_predicted_total", "tokens_predicted_seconds_total",
            "n_tokens_max"]
GAUGES = ["prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
          "requests_deferred"]
KINETIC = ["prefill_requests_total", "prefill_tokens_total"]   # kinetic's own, under kinetic:
PROMPT = ("<|im_start|>user\nWrite a few words about the sea, its waves, its colours and the "
          "boats that sail on it.<|im_end|>\n<|im_start|>assistant\n")  # over one cache page


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("smollm2"), "-c", str(2 * N_CTX), "-np", "2") as s:
        yield s


def scrape(server, path: str = "/metrics") -> dict[str, float]:
    status, headers, body = server.request("GET", path)
    assert status == 200 and headers["content-type"].startswith("text/plain")
    values = {}
    for line in body.decode().splitlines():
        if not line.startswith("#"):
            name, value = line.split(" ")
            assert name not in values
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


def wait_for(condition, what: str, server, deadline: float = 120.0):
    end = time.monotonic() + deadline
    while not (value := condition()):
        assert time.monotonic() < end, f"{what}\n{server.output()}"
        time.sleep(0.1)
    return value


def idle(server) -> dict[str, float]:
    """The metrics once nothing runs or waits (earlier tests' cancelled requests included)."""
    return wait_for(lambda: (m := scrape(server))["requests_processing"] == 0
                    and m["requests_deferred"] == 0 and m, "the server stayed busy", server)


def test_prometheus_text_with_specs_names(server):
    status, _, body = server.request("GET", "/metrics")
    text = body.decode()
    assert text.endswith("\n")
    blocks = re.findall(r"# HELP llamacpp:(\w+) .+\n# TYPE llamacpp:(\w+) (\w+)\n"
                        r"llamacpp:(\w+) ([0-9.e+-]+)\n", text)
    ours = re.findall(r"# HELP kinetic:(\w+) .+\n# TYPE kinetic:(\w+) (\w+)\n"
                      r"kinetic:(\w+) ([0-9.e+-]+)\n", text)
    assert status == 200 and (len(blocks) + len(ours)) * 3 == len(text.splitlines())
    assert all(h == t == n for h, t, _, n, _ in blocks + ours)
    assert [b[0] for b in blocks] == COUNTERS + GAUGES
    assert {b[0]: b[2] for b in blocks} == dict(
        [(c, "counter") for c in COUNTERS] + [(g, "gauge") for g in GAUGES])
    assert [(b[0], b[2]) for b in ours] == [(k, "counter") for k in KINETIC]
    assert set(scrape(server, "/v1/metrics")) == set(
        COUNTERS + GAUGES + [f"kinetic:{k}" for k in KINETIC])


def completion(server, **body) -> tuple[int, int, int]:
    """(prompt tokens run, prompt tokens reused, tokens generated) of a /completion."""
    status, _, answer = server.request("POST", "/completion", body=dict(
        {"prompt": PROMPT}, **body))
    assert status == 200, answer
    t = answer["timings"]
    assert t["prompt_n"] + t["cache_n"] == answer["tokens_evaluated"]
    return t["prompt_n"], t["cache_n"], answer["tokens_predicted"]


def streamed_completion(server, **body) -> tuple[int, int, int]:
    status, _, raw = server.request("POST", "/completion", body=dict(
        {"prompt": PROMPT, "stream": True}, **body))
    assert status == 200
    last = json.loads(raw.decode().strip().split("\n\n")[-1][len("data: "):])
    return last["timings"]["prompt_n"], last["timings"]["cache_n"], last["tokens_predicted"]


def chat(server, **body) -> tuple[int, int, int]:
    status, _, answer = server.request("POST", "/v1/chat/completions", body=dict(
        {"messages": [{"role": "user", "content": "Name a river."}]}, **body))
    assert status == 200, answer
    u = answer["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"] - cached, cached, u["completion_tokens"]


def openai_completion_streamed(server, **body) -> tuple[int, int, int]:
    status, _, raw = server.request("POST", "/v1/completions", body=dict(
        {"prompt": "Rivers of Europe:", "stream": True,
         "stream_options": {"include_usage": True}}, **body))
    assert status == 200
    u = json.loads(raw.decode().split("\n\n")[-3][len("data: "):])["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return u["prompt_tokens"] - cached, cached, u["completion_tokens"]


def test_counters_add_up_to_the_answers(server):
    before = idle(server)
    jobs = [(completion, dict(n_predict=6, temperature=0)),
            (completion, dict(n_predict=6, temperature=0)),          # cached this time
            (streamed_completion, dict(n_predict=5, temperature=0.7, seed=3)),
            (chat, dict(max_tokens=4, temperature=0)),
            (openai_completion_streamed, dict(max_tokens=3, temperature=0))]
    results = [fn(server, **kw) for fn, kw in jobs]
    # and some at once, more than the 2 slots
    at_once: list = [None] * 4

    def run(i: int) -> None:
        at_once[i] = completion(server, n_predict=3 + i, temperature=1.0, seed=i,
                                ignore_eos=True)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in at_once)
    results += at_once
    after = idle(server)

    def grew(name: str) -> float:
        return after[name] - before[name]
    assert grew("requests_total") == len(results)
    assert grew("prompt_tokens_total") == sum(r[0] for r in results)
    assert grew("prompt_tokens_cached_total") == sum(r[1] for r in results)
    assert grew("tokens_predicted_total") == sum(r[2] for r in results)
    assert sum(r[1] for r in results) > 0 and [r[2] for r in at_once] == [3, 4, 5, 6]
    assert after["n_tokens_max"] == max(before["n_tokens_max"],
                                        max(r[0] + r[1] + r[2] for r in results))
    assert grew("prompt_seconds_total") > 0 and grew("tokens_predicted_seconds_total") > 0
    assert after["prompt_tokens_seconds"] == pytest.approx(
        after["prompt_tokens_total"] / after["prompt_seconds_total"], rel=1e-4)
    assert after["predicted_tokens_seconds"] == pytest.approx(
        after["tokens_predicted_total"] / after["tokens_predicted_seconds_total"], rel=1e-4)


def test_gauges_while_requests_are_in_flight(server):
    """Three long streams on two slots: two run and one waits; dropping one lets the third
    in; dropping all empties both gauges. Dropped requests still count as requests."""
    before = idle(server)
    body = json.dumps({"prompt": PROMPT, "n_predict": N_CTX - 64, "temperature": 1.0,
                       "seed": 1, "ignore_eos": True, "stream": True}).encode()

    def start():
        sock = server.connect()
        sock.sendall(raw_request("POST", "/completion", {"Content-Length": str(len(body))},
                                 body))
        return sock

    def gauges() -> tuple[float, float]:
        m = scrape(server)
        return m["requests_processing"], m["requests_deferred"]

    a, b = start(), start()
    for sock in (a, b):
        read_until(sock, b'"content":"')
    assert gauges() == (2, 0)
    c = start()
    wait_for(lambda: gauges() == (2, 1), "the third request was not deferred", server)
    a.close()
    read_until(c, b'"content":"')  # it got the freed slot
    wait_for(lambda: gauges() == (2, 0), "the third request did not take the slot", server)
    b.close()
    c.close()
    after = idle(server)
    assert after["requests_total"] - before["requests_total"] == 3
    assert after["tokens_predicted_total"] > before["tokens_predicted_total"]


def test_prefills_count_apart_from_requests(server):
    """A prefill is counted under kinetic:prefill_*, never as a request or its prompt
    tokens; a second prefill of the same conversation finds it all cached and runs nothing."""
    body = {"messages": [{"role": "user", "content": "Here is my list of the rivers of "
                          "Europe that I have sailed on, with the boats and the towns: the "
                          "Danube, the Rhine, the Elbe, the Loire, the Seine. Which one is"}]}
    before = idle(server)
    status, _, first = server.request("POST", "/v1/prefill", body=body)
    assert status == 200 and first["object"] == "prefill" and first["cached_tokens"] > 0
    middle = idle(server)
    status, _, second = server.request("POST", "/v1/prefill", body=body)
    assert status == 200 and second["cached_tokens"] == first["cached_tokens"]
    after = idle(server)
    for name in COUNTERS:
        if name != "n_tokens_max":
            assert after[name] == before[name], name
    assert after["kinetic:prefill_requests_total"] - before["kinetic:prefill_requests_total"] == 2
    ran = middle["kinetic:prefill_tokens_total"] - before["kinetic:prefill_tokens_total"]
    assert 0 < ran <= first["cached_tokens"]   # pages of the template's start may be cached
    assert after["kinetic:prefill_tokens_total"] == middle["kinetic:prefill_tokens_total"]
