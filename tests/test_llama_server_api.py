"""Black-box tests of llama-server's API on `kinetic serve` (SmolLM2): /completion (and
/completions), /tokenize, /detokenize, /props, /slots, through raw HTTP on one real server
process for the module. The server has an API key, so these routes are checked to need it.
/metrics has its own module (tests/test_metrics.py).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import real_model_file
from tests.serve_process import raw_request, read_until, serving

pytestmark = pytest.mark.real_model

KEY = "sk-llama-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
N_CTX = 512
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = ("<|im_start|>user\nName three colours that you might see in a garden in the "
          "summer.<|im_end|>\n<|im_start|>assistant\n")  # over one cache page

# llama-server's /completion answer fields and their JSON types
ANSWER_FIELDS = {
    "index": int, "content": str, "tokens": list, "id_slot": int, "stop": bool, "model": str,
    "tokens_predicted": int, "tokens_evaluated": int, "generation_settings": dict,
    "prompt": str, "has_new_line": bool, "truncated": bool, "stop_type": str,
    "stopping_word": str, "tokens_cached": int, "timings": dict,
}
TIMINGS = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
           "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second")


@pytest.fixture(scope="module")
def server():
    with serving(real_model_file("smollm2"), "-c", str(2 * N_CTX), "-np", "2",
                 "--api-key", KEY) as s:
        yield s


@pytest.fixture(scope="module")
def tok():
    from kinetic.model.gguf_file import GGUFFile
    from kinetic.text.tokenizer import Tokenizer
    return Tokenizer.from_metadata(GGUFFile(real_model_file("smollm2")).metadata)


def post(server, path: str, body, headers: dict | None = None):
    return server.request("POST", path, body=body, headers=dict(AUTH, **(headers or {})))


def complete(server, **body) -> dict:
    status, _, answer = post(server, "/completion", dict({"prompt": PROMPT}, **body))
    assert status == 200, answer
    return answer


def stream_events(raw: bytes) -> list[dict]:
    """The `data:` events of a llama-server stream (it has no [DONE])."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [json.loads(e[len("data: "):]) for e in events]


def wait_for(condition, what: str, server, deadline: float = 120.0):
    end = time.monotonic() + deadline
    while not (value := condition()):
        assert time.monotonic() < end, f"{what}\n{server.output()}"
        time.sleep(0.1)
    return value


# --- /completion --------------------------------------------------------------------------

def test_completion_answer_fields(server, tok):
    answer = complete(server, n_predict=8, temperature=0, return_tokens=True)
    assert {k: type(v) for k, v in answer.items()} == ANSWER_FIELDS
    assert answer["content"] and answer["stop"] is True and answer["model"] == MODEL_ID
    assert answer["prompt"] == PROMPT and answer["truncated"] is False
    n_prompt = len(tok.encode(PROMPT, add_special=True, parse_special=True))
    assert answer["tokens_evaluated"] == n_prompt
    n = answer["tokens_predicted"]
    assert 1 <= n <= 8 and len(answer["tokens"]) == n
    assert answer["stop_type"] == ("limit" if n == 8 else "eos")
    assert answer["tokens_cached"] == n_prompt + n - (answer["stop_type"] == "limit")
    assert tok.decode_pieces(answer["tokens"]) == answer["content"]
    assert answer["id_slot"] in (0, 1)
    t = answer["timings"]
    assert list(t) == list(TIMINGS)
    assert t["prompt_n"] + t["cache_n"] == n_prompt and t["predicted_n"] == n
    settings = answer["generation_settings"]
    assert settings["temperature"] == 0 and settings["n_predict"] == 8
    assert settings["stream"] is False and settings["stop"] == []


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_completion_streamed_equals_whole(server, sampling):
    whole = complete(server, n_predict=10, return_tokens=True, **sampling)
    status, headers, raw = post(server, "/completion", dict(
        {"prompt": PROMPT, "n_predict": 10, "stream": True}, **sampling))
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    *pieces, last = stream_events(raw)
    assert pieces and all(p["stop"] is False and p["tokens"] for p in pieces)
    assert all(p["tokens_evaluated"] == whole["tokens_evaluated"] for p in pieces)
    assert [t for p in pieces for t in p["tokens"]] == whole["tokens"]
    assert [p["tokens_predicted"] for p in pieces] == sorted(p["tokens_predicted"] for p in pieces)
    assert "".join(p["content"] for p in pieces) == whole["content"]
    assert last["stop"] is True and last["content"] == ""
    assert set(last) == set(ANSWER_FIELDS)
    for key in ("tokens_predicted", "tokens_evaluated", "stop_type"):
        assert last[key] == whole[key], key
    assert last["generation_settings"]["stream"] is True
    # the same prompt ran just before: its full pages came from the prefix cache
    assert last["timings"]["cache_n"] > 0


def test_completions_path_and_token_id_prompt(server, tok):
    text = complete(server, n_predict=6, temperature=0)
    ids = tok.encode(PROMPT, add_special=True, parse_special=True)
    status, _, by_ids = post(server, "/completions", {"prompt": ids, "n_predict": 6,
                                                      "temperature": 0})
    assert status == 200
    assert by_ids["content"] == text["content"]
    assert by_ids["tokens_evaluated"] == len(ids)
    assert by_ids["prompt"] == tok.decode_pieces(ids)


def test_stop_string_and_limit(server):
    free = complete(server, n_predict=24, temperature=0, ignore_eos=True)
    assert free["stop_type"] == "limit" and free["tokens_predicted"] == 24
    words = free["content"].split()
    assert len(words) >= 3, free["content"]
    word = words[2]
    cut = complete(server, n_predict=24, temperature=0, ignore_eos=True, stop=[word])
    assert cut["content"] == free["content"][:free["content"].index(word)]
    assert cut["stop_type"] == "word" and cut["stopping_word"] == word
    assert cut["tokens_predicted"] < 24
    assert cut["generation_settings"]["stop"] == [word]


def test_sampling_fields_are_honoured(server):
    fields = dict(n_predict=12, temperature=1.2, top_k=20, top_p=0.9, min_p=0.02,
                  repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.3, seed=1234,
                  cache_prompt=False, n_probs=3)
    a, b = complete(server, **fields), complete(server, **fields)
    assert a["content"] == b["content"]
    settings = a["generation_settings"]
    for key in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                "presence_penalty", "frequency_penalty", "seed", "n_probs"):
        assert settings[key] == fields[key], key
    assert settings["n_predict"] == settings["max_tokens"] == 12
    other = [complete(server, **dict(fields, seed=s))["content"] for s in (1, 2, 3)]
    assert any(c != a["content"] for c in other)


def test_bodies_of_any_content_type(server):
    body = json.dumps({"prompt": "Hello", "n_predict": 2, "temperature": 0})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = dict(AUTH, **({"Content-Type": ctype} if ctype else {}))
        status, _, answer = server.request("POST", "/completion", body=body, headers=headers)
        assert status == 200 and answer["tokens_predicted"] >= 1, ctype
        status, _, answer = server.request("POST", "/tokenize", headers=headers,
                                           body=json.dumps({"content": "Hello"}))
        assert status == 200 and answer["tokens"], ctype


BAD_REQUESTS = [
    ("/completion", {}, "prompt", ""),
    ("/completion", {"prompt": 5}, "prompt", ""),
    ("/completion", {"prompt": ["a", ["b"]]}, "prompt[1]", ""),
    ("/completion", {"prompt": [999999]}, "prompt", "vocabulary"),
    ("/completion", {"prompt": "hi", "n_predict": "x"}, "n_predict", ""),
    ("/completion", {"prompt": "hi", "n_predict": 0}, "n_predict", ""),
    ("/completion", {"prompt": "hi", "n_predict": -2}, "n_predict", ""),
    ("/completion", {"prompt": "hi", "temperature": 101}, "temperature", ""),
    ("/completion", {"prompt": "hi", "top_p": 2}, "top_p", ""),
    ("/completion", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", ""),
    ("/completion", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop", ""),
    ("/completion", {"prompt": "hi", "stream": "yes"}, "stream", ""),
    ("/completion", {"prompt": "hi", "n_probs": -1}, "n_probs", ""),
    ("/completion", {"prompt": "hi", "grammar": 'root ::= "a" )'}, "grammar", "line 1"),
    ("/completion", {"prompt": "hi", "json_schema": {"type": "strin"}}, "json_schema.type", ""),
    ("/completion", {"prompt": "hi", "json_schema": {"type": "object"},
                     "grammar": 'root ::= "a"'}, "json_schema", "not grammar and json_schema"),
    ("/completions", {"prompt": " ".join(["word"] * (N_CTX + 10))}, "prompt", str(N_CTX)),
    ("/tokenize", {"content": 5}, "content", ""),
    ("/tokenize", {"content": "a", "with_pieces": "yes"}, "with_pieces", ""),
    ("/detokenize", {"tokens": "abc"}, "tokens", ""),
    ("/detokenize", {"tokens": [1, 99999999]}, "tokens", "vocabulary"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_REQUESTS,
                         ids=[f"{i}-{p}" for i, (_, _, p, _) in enumerate(BAD_REQUESTS)])
def test_bad_request_names_the_field(server, path, body, param, words):
    status, _, answer = post(server, path, body)
    assert status == 400, answer
    err = answer["error"]
    # a prompt over the context has llama-server's own type (tests/test_dropin_shapes.py)
    context = "exceeds the available context size" in err["message"]
    assert err["type"] == ("exceed_context_size_error" if context else "invalid_request_error")
    assert err["param"] == param and words in err["message"]


def test_malformed_json(server):
    for raw in ('{"prompt": ', "[1]", "\xff"):
        status, _, answer = post(server, "/completion", raw.encode("latin1"))
        assert status == 400 and answer["error"]["type"] == "invalid_request_error", raw


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_embedding_on_a_text_model_names_the_right_endpoint(server, path):
    status, _, body = post(server, path, {"content": "a cat"})
    assert status == 400 and "/v1/chat/completions" in body["error"]["message"]


# --- security -----------------------------------------------------------------------------

ROUTES = [("POST", "/completion"), ("POST", "/completions"), ("POST", "/tokenize"),
          ("POST", "/detokenize"), ("GET", "/props"), ("GET", "/slots"), ("GET", "/metrics"),
          ("GET", "/v1/metrics")]
BODIES = {"/completion": {"prompt": "Hi", "n_predict": 1},
          "/completions": {"prompt": "Hi", "n_predict": 1},
          "/tokenize": {"content": "Hi"}, "/detokenize": {"tokens": [1]}}


@pytest.mark.parametrize("method,path", ROUTES, ids=[p for _, p in ROUTES])
def test_key_and_origin_rules(server, method, path):
    body = BODIES.get(path)
    status, _, answer = server.request(method, path, body=body)
    assert status == 401 and answer["error"]["type"] == "authentication_error"
    status, _, answer = server.request(method, path, body=body, headers=dict(
        AUTH, Origin="http://evil.example"))
    assert status == 403 and answer["error"]["type"] == "permission_error"
    status, _, answer = server.request(method, path, body=body, headers=dict(
        AUTH, **{"Origin": "http://localhost:5173", "Content-Type": "text/plain"}))
    assert status == 200, answer


# --- tokens -------------------------------------------------------------------------------

def test_tokenize_options(server, tok):
    text = "Hello world<|im_end|> é 🎉"
    status, _, plain = post(server, "/tokenize", {"content": text})
    assert status == 200
    # llama-server's defaults: special tokens in the text are parsed, no BOS/EOS added
    assert plain["tokens"] == tok.encode(text, add_special=False, parse_special=True)
    assert 2 in plain["tokens"]  # <|im_end|>
    _, _, literal = post(server, "/tokenize", {"content": text, "parse_special": False,
                                               "add_special": True})
    assert literal["tokens"] == tok.encode(text, add_special=True, parse_special=False)
    assert 2 not in literal["tokens"]
    _, _, pieces = post(server, "/tokenize", {"content": text, "with_pieces": True})
    assert [p["id"] for p in pieces["tokens"]] == plain["tokens"]
    by_id = {p["id"]: p["piece"] for p in pieces["tokens"]}
    assert by_id[2] == "<|im_end|>" and by_id[plain["tokens"][0]] == "Hello"
    raw = b""
    for p in pieces["tokens"]:
        if isinstance(p["piece"], list):  # not valid UTF-8 alone: the emoji's bytes
            assert all(isinstance(b, int) and 0 <= b < 256 for b in p["piece"])
            raw += bytes(p["piece"])
        else:
            raw += p["piece"].encode()
    assert raw == text.encode()
    assert any(isinstance(p["piece"], list) for p in pieces["tokens"])


def test_detokenize(server, tok):
    text = "The capital of France is Paris."
    _, _, ids = post(server, "/tokenize", {"content": text})
    status, _, back = post(server, "/detokenize", {"tokens": ids["tokens"]})
    assert status == 200 and back["content"] == text
    _, _, special = post(server, "/detokenize", {"tokens": ids["tokens"] + [2]})
    assert special["content"] == text + "<|im_end|>"
    assert post(server, "/detokenize", {})[2] == {"content": ""}
    assert post(server, "/tokenize", {})[2] == {"tokens": []}


# --- the server ---------------------------------------------------------------------------

def test_props(server, tok):
    from kinetic.model.gguf_file import GGUFFile
    status, _, props = server.request("GET", "/props", headers=AUTH)
    assert status == 200
    assert props["total_slots"] == 2
    settings = props["default_generation_settings"]
    assert settings["n_ctx"] == N_CTX
    params = settings["params"]
    assert params["temperature"] == pytest.approx(0.8) and params["top_k"] == 40
    assert params["n_predict"] == -1 and params["seed"] == 4294967295
    assert props["model_path"] == real_model_file("smollm2")
    assert props["model_alias"] == MODEL_ID
    meta = GGUFFile(real_model_file("smollm2")).metadata
    assert props["chat_template"] == meta["tokenizer.chat_template"]
    assert props["modalities"]["vision"] is False
    assert props["build_info"].startswith("kinetic-")
    assert props["eos_token"] == tok.token_piece(tok.eos_id, special=True) == "<|im_end|>"
    assert props["chat_template_caps"]["supports_system_role"] is True
    assert props["cache_type_k"] == props["cache_type_v"] == "f16"   # kinetic's default


def slots(server) -> list[dict]:
    status, _, body = server.request("GET", "/slots", headers=AUTH)
    assert status == 200
    return body


def test_slots_report_the_last_request(server):
    answer = complete(server, n_predict=7, temperature=0, ignore_eos=True, top_k=17)
    listed = slots(server)
    assert [s["id"] for s in listed] == [0, 1]
    assert all(s["n_ctx"] == N_CTX and s["is_processing"] is False for s in listed)
    s = listed[answer["id_slot"]]
    assert s["n_prompt_tokens"] == answer["tokens_evaluated"]
    assert s["n_prompt_tokens_cache"] == answer["timings"]["cache_n"]
    assert s["n_prompt_tokens_processed"] == answer["timings"]["prompt_n"]
    assert s["params"]["top_k"] == 17 and s["params"]["n_predict"] == 7
    assert s["prompt"] == PROMPT
    assert s["next_token"] == [{"has_next_token": False, "has_new_line": answer["has_new_line"],
                                "n_remain": 0, "n_decoded": 7}]
    tasks = [x["id_task"] for x in listed if "id_task" in x]
    assert s["id_task"] == max(tasks)


def test_slots_while_running_and_after_a_disconnect(server):
    """A streamed request shows in its slot while it runs; dropping the connection cancels
    it and frees the slot, which then reports where it stopped."""
    n_predict = N_CTX - 64
    body = json.dumps({"prompt": PROMPT, "n_predict": n_predict, "temperature": 1.0, "seed": 5,
                       "ignore_eos": True, "stream": True}).encode()
    sock = server.connect()
    sock.sendall(raw_request("POST", "/completion", dict(AUTH, **{
        "Content-Length": str(len(body))}), body))
    read_until(sock, b'"content":"')

    def running():
        return [s for s in slots(server) if s["is_processing"]]
    (live,) = wait_for(running, "no slot is processing", server)
    assert live["next_token"][0]["has_next_token"] is True
    assert live["next_token"][0]["n_decoded"] >= 1
    assert live["params"]["stream"] is True and live["params"]["n_predict"] == n_predict
    task = live["id_task"]
    sock.close()

    wait_for(lambda: not running(), "the slot was not freed", server)
    after = slots(server)[live["id"]]
    assert after["id_task"] == task and after["next_token"][0]["has_next_token"] is False
    decoded = after["next_token"][0]["n_decoded"]
    assert 1 <= decoded < n_predict
    assert after["next_token"][0]["n_remain"] == n_predict - decoded
