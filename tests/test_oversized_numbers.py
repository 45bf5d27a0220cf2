"""Numbers no field can hold, in every numeric field of every POST route: each answer is a 200
or a 4xx in the route's error shape, never a 5xx (an integer of 400 digits once raised
OverflowError in /embedding's embd_normalize). A table, not a fuzzer: every (route, field,
value) is sent, on a text model and on an embedding and a ranking model, through the
in-process app (tests/app_client.py).
"""

from __future__ import annotations

import json

import pytest

from kinetic.api.params import SAMPLING_FIELDS
from tests.app_client import SERVED_BODIES, assert_route_error, in_process_app, model_app
from tests.embedding_models import write_bert

HUGE = [10**400, -(10**400), 2**64, 1e308]

# every field a route reads as a number (SAMPLING_FIELDS, and each route's own), and
# Ollama's options
NUMERIC = sorted({name for name, _, _ in SAMPLING_FIELDS if name not in (
    "dry_sequence_breakers", "ignore_eos")} | {
    "max_tokens", "max_completion_tokens", "n", "best_of", "logprobs", "top_logprobs",
    "n_predict", "n_probs", "n_keep", "n_discard", "id_slot", "n_cmpl", "n_indent",
    "t_max_predict_ms", "t_max_prompt_ms", "top_n", "dimensions", "embd_normalize",
    "keep_alive"})
OLLAMA_OPTIONS = ["temperature", "top_k", "top_p", "min_p", "seed", "num_predict",
                  "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
                  "typical_p", "mirostat", "mirostat_tau", "mirostat_eta", "num_ctx",
                  "num_batch", "num_thread", "num_keep"]

# path -> a body the route serves, for the routes SERVED_BODIES does not have
TEXT_ROUTES = {
    "/v1/chat/completions": SERVED_BODIES["openai.chat_completions"],
    "/v1/completions": SERVED_BODIES["openai.completions"],
    "/completion": SERVED_BODIES["llama_server.completion"],
    "/tokenize": SERVED_BODIES["llama_server.tokenize"],
    "/detokenize": SERVED_BODIES["llama_server.detokenize"],
    "/v1/prefill": SERVED_BODIES["prefill.prefill"],
    "/api/chat": SERVED_BODIES["ollama.chat"],
    "/api/generate": SERVED_BODIES["ollama.generate"],
    "/apply-template": {"messages": [{"role": "user", "content": "hi"}]},
    "/api/show": {"model": "m"},
    "/slots/0?action=erase": {},
}
EMBEDDING_ROUTES = {
    "/v1/embeddings": {"input": ["a cat", "a dog"]},
    "/embedding": {"content": "a cat"},
    "/api/embed": {"model": "m", "input": "a cat"},
    "/api/embeddings": {"model": "m", "prompt": "a cat"},
}
RANK_ROUTES = {"/v1/rerank": {"query": "a cat", "documents": ["a dog", "a cat"]}}


def _bodies(path: str, served: dict):
    """(what, body) for every numeric field at every HUGE value, Ollama's options too."""
    for name in NUMERIC:
        for value in HUGE:
            yield f"{name}={value!r:.20}", dict(served, **{name: value})
    if path.startswith("/api/"):
        for name in OLLAMA_OPTIONS:
            for value in HUGE:
                options = dict(served.get("options", {}), **{name: value})
                yield f"options.{name}={value!r:.20}", dict(served, options=options)


def _check_routes(app, routes: dict[str, dict]) -> int:
    sent = 0
    for path, served in routes.items():
        status, answer = app.post(path, json.dumps(served).encode())
        assert status == 200, (path, answer)   # the base body is served
        for what, body in _bodies(path, served):
            status, answer = app.post(path, json.dumps(body).encode())
            if status != 200:
                assert_route_error(path, status, answer, f"{path} {what}")
            sent += 1
    return sent


def test_text_routes_take_oversized_numbers(tmp_path):
    with in_process_app(tmp_path) as app:
        assert _check_routes(app, TEXT_ROUTES) > 1000


@pytest.mark.parametrize("pooling,routes", [("mean", EMBEDDING_ROUTES), ("rank", RANK_ROUTES)])
def test_encoder_routes_take_oversized_numbers(tmp_path, pooling, routes):
    path = write_bert(tmp_path / f"tiny-bert-{pooling}.gguf", pooling=pooling,
                      classifier=pooling == "rank")
    with model_app(path) as app:
        assert _check_routes(app, routes) > 100
