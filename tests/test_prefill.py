"""Prefills (/v1/prefill, Zero Wait): the engine's prefill job over the mock model, counted
in steps (tests/mock_model.py); where the route cuts a conversation, over real tokenizers
and chat templates; the route in-process on a tiny model (tests/app_client.py); and, on
SmolLM2, a request after a prefill of its conversation answering bitwise what a fresh
server answers. The scheduler's side (rows, slots, pages) is in tests/test_scheduler.py.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
from pathlib import Path

import pytest

from kinetic.api.params import parse_chat
from kinetic.api.dialects.prefill import before_last_word, prefill_prompt
from kinetic.engine.prefills import Prefilled
from kinetic.engine.request import GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from tests.app_client import assert_error_shape, in_process_app
from tests.mock_model import TIMEOUT, Collector, Paused, greedy, ids, run
from tests.tiny_models import DATA, vocab_file

HELLO = ids("hello")



def conversation(n: int) -> list[int]:
    return [(3 * j + 1) % 26 for j in range(n)]   # letters only: no end-of-generation token


# --- the engine's prefill job (mock model: 2 slots, 16-row steps) ----------------------------

def test_a_request_after_its_prefill_answers_as_cold_from_the_cached_pages(make_engine):
    engine = make_engine()   # 4-token pages
    prompt = ids("thequickbrownfoxjumps")   # 21 tokens
    first = engine.prefill(prompt[:14])
    assert (first.cached_tokens, first.computed_tokens) == (12, 12)   # 3 whole pages run
    request = GenerationRequest(prompt, SamplingParams(temperature=1.0, seed=7), max_tokens=6,
                                logprobs=3)
    warm = run(engine, request)
    cold_engine = make_engine()
    cold = run(cold_engine, request)
    assert warm.usage.cached_tokens == 12 and cold.usage.cached_tokens == 0
    assert warm.tokens == cold.tokens and warm.text == cold.text
    assert warm.logprobs == cold.logprobs
    c, cold_c = engine.counters(), cold_engine.counters()
    assert (c["prefills"], c["prefill_tokens"], c["requests"]) == (1, 12, 1)
    assert cold_c["prompt_tokens"] - c["prompt_tokens"] == 12   # not counted as the prompt's


def test_prefills_of_a_growing_conversation_each_run_only_what_is_new(make_engine):
    engine = make_engine()
    talk = conversation(40)
    got = [engine.prefill(talk[:n]) for n in (6, 10, 15, 15, 9, 30)]
    assert [(r.cached_tokens, r.computed_tokens) for r in got] == [
        (4, 4), (8, 4), (12, 4), (12, 0), (8, 0), (28, 16)]
    assert engine.counters()["prefill_tokens"] == 28
    assert run(engine, GenerationRequest(talk, max_tokens=3)).usage.cached_tokens == 28
    with Paused(engine) as p:
        p.assert_only_this_runs()


class Holds(Collector):
    """A sink that holds the engine thread in the step that hands out each of the given
    token deltas (mid-step: the step's rows are computed, `complete` has not run) until the
    test calls `go`."""

    def __init__(self, *at: int):
        super().__init__()
        self.at, self.seen = set(at), 0
        self.reached: queue.SimpleQueue = queue.SimpleQueue()
        self._go = threading.Semaphore(0)

    def __call__(self, delta) -> None:
        super().__call__(delta)
        if delta.token_ids:
            self.seen += 1
            if self.seen in self.at:
                self.reached.put(self.seen)
                if not self._go.acquire(timeout=TIMEOUT):
                    raise RuntimeError("the test never let the engine go on")

    def wait_at(self, n: int) -> None:
        assert self.reached.get(timeout=TIMEOUT) == n

    def go(self) -> None:
        self._go.release()


def test_a_request_ends_a_running_prefill_at_the_end_of_the_step_in_flight(make_engine):
    engine = make_engine(n_ctx=4096, page_size=16)
    a = Holds(1, 4)
    engine.start(GenerationRequest(HELLO, max_tokens=10, speculative=False), a)
    a.wait_at(1)   # step 1 computed the stream's prompt
    talk = conversation(600)
    answers: queue.SimpleQueue = queue.SimpleQueue()
    prefill_id = engine.start_prefill(talk, answers.put)
    a.go()   # steps 2, 3, 4: the stream's decode row and 15 prefill rows each
    a.wait_at(4)
    b = Collector()
    engine.start(GenerationRequest(talk + ids("xyz"), max_tokens=3), b)
    a.go()
    # step 4's rows were kept (2 whole pages of 45 rows), and the prefill ran no more
    assert answers.get(timeout=TIMEOUT) == Prefilled(prefill_id, 32, 45)
    rb = b.wait()
    assert rb.usage.cached_tokens == 32 and rb.tokens == greedy(talk + ids("xyz"), 3)[0]
    assert a.wait().tokens == greedy(HELLO, 10)[0]
    assert engine.counters()["prefill_tokens"] == 45
    with Paused(engine) as p:
        p.assert_only_this_runs()


def test_a_prefill_whose_caller_leaves_is_cancelled(make_engine):
    engine = make_engine(n_ctx=4096, page_size=16)

    async def leave() -> None:
        with Paused(engine):   # the prefill and its cancel reach the engine together
            task = asyncio.create_task(engine.submit_prefill(conversation(3000)))
            await asyncio.sleep(0)   # the task starts the prefill
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    asyncio.run(leave())
    with Paused(engine) as p:
        p.assert_only_this_runs()
    assert engine.counters()["prefill_tokens"] == 0


def test_a_prefill_that_cannot_fit_is_refused_at_once(make_engine):
    engine = make_engine()   # a 64-token context
    with pytest.raises(ValueError, match="64"):
        engine.prefill(conversation(64))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.prefill([1, 2, 99])


# --- where a conversation is cut: real tokenizers and templates ------------------------------

class TemplateModel:
    """What prefill_prompt reads of a model: its chat template and tokenizer."""

    def __init__(self, vocab: str, template: str):
        from kinetic.model.gguf_file import GGUFFile
        from kinetic.text.chat_template import ChatTemplate
        from kinetic.text.tokenizer import Tokenizer
        meta = GGUFFile(vocab_file(vocab)).metadata
        self.tokenizer = Tokenizer.from_metadata(meta)
        bos = self.tokenizer.bos_id
        self.chat_template = ChatTemplate(
            (DATA / "templates" / template).read_text(),
            self.tokenizer.token_piece(bos, special=True) if bos is not None else "")

    def apply_chat_template(self, messages, tools=None, **kwargs) -> str:
        return self.chat_template.render(messages, tools=tools, **kwargs)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False):
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)


MODELS = [("qwen2", "Qwen-Qwen3-0.6B.jinja"), ("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja"),
          ("llama-spm", "google-gemma-2-2b-it.jinja"), ("gpt-2", "Qwen-Qwen2.5-7B-Instruct.jinja"),
          ("qwen35", "Qwen3.5-4B.jinja")]
TYPED = "Here is the report: sales grew by 12% in May (see the table).\nWhat does it"
# what the message may become: the word grown, finished and followed, replaced, or more lines
LATER = [TYPED + "self", TYPED + " mean?", TYPED[:-2] + "that", TYPED + "s", TYPED + ", and why?",
         TYPED + "\n\nThanks", TYPED[:-2] + "42%", TYPED[:-2] + "(it)"]


def chat(messages, **body):
    return parse_chat({"messages": messages, **body}, SamplingParams())


@pytest.mark.parametrize("vocab,template", MODELS, ids=[v for v, _ in MODELS])
def test_the_cut_is_before_the_last_word_and_starts_every_later_prompt(vocab, template):
    model = TemplateModel(vocab, template)
    earlier = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]
    for shape in ("text", "parts"):
        def user(text):
            return {"role": "user", "content": text if shape == "text" else
                    [{"type": "text", "text": "Look:"}, {"type": "text", "text": text}]}
        ids_, cut = prefill_prompt(model, chat(earlier + [user(TYPED)]))
        assert 0 < cut < len(ids_)
        shown = model.tokenizer.decode(ids_[:cut], skip_special=False)
        assert shown.rstrip().endswith("What does"), (shown[-40:], vocab)
        for later in LATER:
            grown, _ = prefill_prompt(model, chat(earlier + [user(later)]))
            assert grown[:cut] == ids_[:cut], (later, vocab)


def test_the_cut_of_other_last_messages():
    model = TemplateModel("qwen2", "Qwen-Qwen3-0.6B.jinja")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    cases = [  # (messages, body, what the cut text ends with)
        ([{"role": "user", "content": "Weather in Paris"}], {"tools": tools}, "Weather in"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How"}],
         {}, "Hello!"),
        ([{"role": "user", "content": "Hi"}], {}, "user\n"),   # one word: the turn's head
        ([{"role": "user", "content": "Hi there   "}], {}, "Hi"),
    ]
    for messages, body, ends in cases:
        ids_, cut = prefill_prompt(model, chat(messages, **body))
        shown = model.tokenizer.decode(ids_[:cut], skip_special=False)
        assert shown.endswith(ends), (messages, shown[-60:])
        assert cut < len(ids_)


def test_before_last_word():
    assert before_last_word("What does it") == "What does "
    assert before_last_word("What does it  \n") == "What does "
    assert before_last_word("word") == "" and before_last_word("") == ""
    assert before_last_word("a\n\nb") == "a\n\n"


# --- the route, in-process on a tiny Qwen3 ----------------------------------------------------

@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("prefill")) as a:
        yield a


def test_the_route_answers_what_is_cached_and_the_chat_takes_it(app):
    text = ("Tell me about the old harbour town where the boats come in at dawn with the "
            "night's catch, and the market that opens on the quay before the sun is up. Why is")
    messages = [{"role": "user", "content": text}]
    status, answer = app.post("/v1/prefill", json.dumps({"messages": messages}).encode())
    assert status == 200 and set(answer) == {"object", "cached_tokens"}, answer
    n = answer["cached_tokens"]
    assert answer["object"] == "prefill" and n > 0 and n % 16 == 0
    state = app.app.extensions["kinetic"]
    assert state.activity.totals.prefill_requests_total == 1
    assert state.activity.totals.requests_total == 0
    messages[0]["content"] = text + " it so early?"
    status, answer = app.post("/v1/chat/completions", json.dumps(
        {"messages": messages, "max_tokens": 1}).encode())
    assert status == 200 and answer["usage"]["prompt_tokens_details"]["cached_tokens"] == n
    status, again = app.post("/prefill", json.dumps({"messages": messages}).encode())
    assert status == 200 and again["cached_tokens"] >= n


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"a": 1}}, "tools"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": [1]},
     "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
])
def test_bad_bodies_are_refused_as_chat_completions_refuse_them(app, body, param):
    for path in ("/v1/prefill", "/v1/chat/completions"):
        status, answer = app.post(path, json.dumps(body).encode())
        err = assert_error_shape(status, answer, path)
        assert status == 400 and err["param"] == param, (path, err)
    status, answer = app.post("/v1/prefill", json.dumps(body).encode(), "text/plain")
    assert status == 415


# --- on SmolLM2: the answer after a prefill is the fresh server's, bitwise --------------------

@pytest.mark.real_model
def test_a_chat_after_its_prefill_answers_bitwise_as_a_fresh_server(tmp_path):
    import kinetic
    from kinetic.api.app import create_app
    from kinetic.api.core import ServerConfig, ServerState
    from tests.app_client import AppClient
    from tests.conftest import real_model_file

    path = real_model_file("smollm2")
    servers = []
    for _ in range(2):   # the same flags as `kinetic serve -c 1024 -np 2`
        model = kinetic.load(path, n_ctx=1024, parallel=2)
        state = ServerState(ServerConfig(), Path(path).stem)
        state.set_ready(model)
        servers.append((AppClient(create_app(state)), state, model))
    (warm, warm_state, _), (fresh, _, _) = servers
    try:
        report = ("Quarterly report. Revenue rose eleven percent on the year, driven by the "
                  "northern region, where three new stores opened in March and April. Costs "
                  "rose four percent, mostly freight and energy; staff costs were flat. The "
                  "board proposes a dividend of forty cents a share, payable in June. ")
        typed = [report + "Summarise"]
        typed.append(typed[-1] + " it in one sentence: what rose, what fell, what stayed flat, "
                     "what the board proposes to pay the shareholders, and when it")
        typed.append(typed[-1] + " will be paid, in one short sentence please, and without "
                     "any figures other than the dividend that the board")
        cached, ran = [], []
        for text in typed:   # the user types on: each prefill runs only what is new
            before = warm_state.activity.totals.prefill_tokens_total
            status, answer = warm.post("/v1/prefill", json.dumps(
                {"messages": [{"role": "user", "content": text}]}).encode())
            assert status == 200, answer
            cached.append(answer["cached_tokens"])
            ran.append(warm_state.activity.totals.prefill_tokens_total - before)
        assert 64 <= cached[0] < cached[1] < cached[2]
        assert ran[0] == cached[0] and ran[1:] == [b - a for a, b in zip(cached, cached[1:])]
        body = json.dumps({"messages": [{"role": "user", "content": typed[-1] + " proposes."}],
                           "max_tokens": 12, "temperature": 0.8, "seed": 5, "logprobs": True,
                           "top_logprobs": 3}).encode()
        status, after = warm.post("/v1/chat/completions", body)
        assert status == 200, after
        status, cold = fresh.post("/v1/chat/completions", body)
        assert status == 200, cold
        assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == cached[-1]
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert after["choices"][0]["message"] == cold["choices"][0]["message"]
        assert after["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
        assert after["usage"]["completion_tokens"] == cold["usage"]["completion_tokens"] > 0
    finally:
        for client, _, model in servers:
            client.close()
            model.close()
