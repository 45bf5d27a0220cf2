"""Every POST route fuzzed with bodies drawn from its own fields (hypothesis): each answer is
a 200 or a 4xx in the OpenAI error shape, never a 5xx, within a timeout; afterwards the server
still answers a normal request. The table of known malformed bodies is
tests/test_malformed_bodies.py; this finds the ones nobody thought of.

Bodies are of three kinds: an object of the route's field names (its required ones nearly
always there) whose values are either plausible for the field or any JSON at all (lone
surrogates and huge integers included); any JSON value; and bytes, alone or spliced into an
object. Runs are derandomized (the same draws on every run and machine) and bounded, and use
the in-process app of tests/app_client.py on a tiny random-weight model.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kinetic.api.app import create_app
from kinetic.api.core import ServerConfig, ServerState
from kinetic.api.params import SAMPLING_FIELDS
from tests.app_client import SERVED_BODIES, assert_route_error, in_process_app, model_app
from tests.embedding_models import write_bert

EXAMPLES = 300          # per route; the whole file runs in about 30 s on 2 cores
REQUEST_TIMEOUT = 30.0  # seconds; a request still unanswered then is a hang, and fails

# --- values -------------------------------------------------------------------------------

# strings: any text but lone surrogates, which body.py refuses before anything else looks
# at the body, so drawn in values they would cut most draws short; `bodies` puts them in
plain = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
texts = st.one_of(plain, st.sampled_from(
    ["", "hi", "\U0001F600", "<|im_start|>", "<think>", "\x00", "é" * 40]))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                    allow_infinity=False), texts,
                    st.sampled_from([10**400, -(10**400), 2**64, 0, 1.5]))
any_json = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(plain, inner, max_size=4)), max_leaves=12)


def maybe(plausible: st.SearchStrategy, odds: int = 4) -> st.SearchStrategy:
    """A value for a field: one of the kind it takes, or once in `odds` any JSON at all (so
    that most draws get past the first check to the deeper ones)."""
    # (one_of(p, p, p, j) would not do: hypothesis merges the repeated branches)
    return st.integers(1, odds).flatmap(lambda i: any_json if i == 1 else plausible)


def rarely(plausible: st.SearchStrategy) -> st.SearchStrategy:
    """maybe() for values deep in a message: each of them would end the parse."""
    return maybe(plausible, 12)


small_ints = st.integers(-2, 4)
token_ids = st.lists(st.integers(-2, 160_000), max_size=6)
part = st.fixed_dictionaries(
    {"type": rarely(st.sampled_from(["text", "text", "text", "image_url", "input_audio",
                                     "media_marker", "refusal"]))},
    optional={"text": rarely(texts), "image_url": any_json})
call = st.fixed_dictionaries({}, optional={
    "type": rarely(st.just("function")), "id": rarely(texts),
    "function": rarely(st.fixed_dictionaries({"name": rarely(texts)}, optional={
        "arguments": rarely(st.sampled_from(["{}", '{"a": 1}', "{", ""]))}))})
message = st.fixed_dictionaries(
    {"role": rarely(st.sampled_from(["user", "user", "assistant", "system", "developer",
                                     "tool"])),
     "content": rarely(st.one_of(texts, st.lists(rarely(part), max_size=3)))},
    optional={"reasoning_content": rarely(texts), "name": rarely(texts),
              "tool_call_id": rarely(texts), "tool_calls": rarely(st.lists(rarely(call),
                                                                            max_size=2))})
KEYWORDS = ["type", "properties", "required", "items", "prefixItems", "additionalProperties",
            "enum", "const", "anyOf", "allOf", "oneOf", "$ref", "$defs", "pattern", "format",
            "minLength", "maxLength", "minItems", "maxItems", "minimum", "maximum",
            "dependencies", "uniqueItems", "not"]
schema = maybe(st.one_of(
    st.sampled_from([{"type": "object"}, {"type": "string", "maxLength": 3},
                     {"enum": ["a", 1]}, {"type": "array", "items": True}, True]),
    st.dictionaries(st.sampled_from(KEYWORDS), any_json, max_size=3)))
tool = st.fixed_dictionaries({"type": maybe(st.just("function")), "function": maybe(
    st.fixed_dictionaries({"name": maybe(texts)}, optional={
        "description": maybe(texts), "parameters": schema}))})

numbers = st.one_of(small_ints, st.floats(-3, 3), st.sampled_from([10**400, -(10**400), 1e308]))
SAMPLING = {name: maybe(numbers) for name, _, _ in SAMPLING_FIELDS}
SAMPLING.update(seed=maybe(small_ints), dry_sequence_breakers=maybe(st.lists(texts,
                max_size=3)), logit_bias=maybe(st.dictionaries(
                    st.integers(-1, 200_000).map(str), st.floats(-101, 101), max_size=3)))
GENERATING = dict(SAMPLING, stop=maybe(st.one_of(texts, st.lists(texts, max_size=3))),
                  stream=maybe(st.booleans()), grammar=maybe(st.sampled_from(
                      ['root ::= "a"', 'root ::= [a-z]{1,3}', "root ::= (", ""])),
                  json_schema=schema, response_format=maybe(st.fixed_dictionaries(
                      {"type": maybe(st.sampled_from(["text", "json_object", "json_schema"]))},
                      optional={"json_schema": maybe(st.fixed_dictionaries(
                          {}, optional={"schema": schema})), "schema": schema})))

SERVED = SERVED_BODIES
# endpoint -> {field: its values}
FIELDS = {
    "openai.chat_completions": dict(
        GENERATING, messages=maybe(st.lists(rarely(message), min_size=1, max_size=3)),
        max_tokens=maybe(st.integers(1, 3)), tools=maybe(st.lists(maybe(tool), max_size=2)),
        tool_choice=maybe(st.sampled_from(["auto", "none", "required", {
            "type": "function", "function": {"name": "f"}}])),
        parallel_tool_calls=maybe(st.booleans()), logprobs=maybe(st.booleans()),
        top_logprobs=maybe(small_ints), max_completion_tokens=maybe(st.integers(1, 3)),
        chat_template_kwargs=maybe(st.dictionaries(st.sampled_from(
            ["enable_thinking", "reasoning_effort", "x"]), any_json, max_size=2)),
        stream_options=maybe(st.fixed_dictionaries({}, optional={
            "include_usage": maybe(st.booleans())})),
        n=maybe(small_ints), receipt=maybe(st.booleans())),
    "openai.completions": dict(
        GENERATING, prompt=maybe(st.one_of(texts, token_ids, st.lists(texts, max_size=2))),
        max_tokens=maybe(st.integers(1, 3)), echo=maybe(st.booleans()), suffix=maybe(texts),
        best_of=maybe(small_ints), logprobs=maybe(small_ints), n=maybe(small_ints),
        receipt=maybe(st.booleans())),
    "llama_server.completion": dict(
        GENERATING, prompt=maybe(st.one_of(texts, token_ids)),
        n_predict=maybe(st.integers(1, 3)), n_probs=maybe(small_ints),
        return_tokens=maybe(st.booleans()), cache_prompt=maybe(st.booleans()),
        max_tokens=maybe(st.integers(1, 3)), receipt=maybe(st.booleans())),
    "llama_server.tokenize": dict(
        content=maybe(texts), **{name: maybe(st.booleans()) for name in (
            "add_special", "parse_special", "with_pieces")}),
    "llama_server.detokenize": dict(tokens=maybe(token_ids)),
    # a chat body: only the fields that shape the prompt matter, the others are checked
    "prefill.prefill": dict(
        GENERATING, messages=maybe(st.lists(rarely(message), min_size=1, max_size=3)),
        tools=maybe(st.lists(maybe(tool), max_size=2)),
        tool_choice=maybe(st.sampled_from(["auto", "none", "required", {
            "type": "function", "function": {"name": "f"}}])),
        chat_template_kwargs=maybe(st.dictionaries(st.sampled_from(
            ["enable_thinking", "reasoning_effort", "x"]), any_json, max_size=2))),
}
# Ollama's bodies: sampling in options (num_predict kept small), messages with its own fields
OLLAMA_OPTIONS = st.fixed_dictionaries({}, optional=dict(
    {name: maybe(numbers) for name in ("temperature", "top_k", "top_p", "min_p", "seed",
                                       "repeat_penalty", "repeat_last_n", "presence_penalty",
                                       "frequency_penalty", "typical_p", "mirostat",
                                       "num_ctx", "num_thread")},
    num_predict=maybe(st.sampled_from([1, 2, -1, -2, 0, -3])),
    stop=maybe(st.one_of(texts, st.lists(texts, max_size=3)))))
ollama_call = st.fixed_dictionaries({}, optional={"function": rarely(st.fixed_dictionaries(
    {"name": rarely(texts)}, optional={"arguments": rarely(st.one_of(
        st.dictionaries(plain, any_json, max_size=2), texts))}))})
ollama_message = st.fixed_dictionaries(
    {"role": rarely(st.sampled_from(["user", "user", "assistant", "system", "tool"])),
     "content": rarely(texts)},
    optional={"thinking": rarely(texts), "tool_name": rarely(texts),
              "images": rarely(st.lists(texts, max_size=1)),
              "tool_calls": rarely(st.lists(rarely(ollama_call), max_size=2))})
OLLAMA = dict(model=maybe(texts), options=maybe(OLLAMA_OPTIONS), stream=maybe(st.booleans()),
              format=maybe(st.one_of(st.sampled_from(["json", "", "yaml"]), schema)),
              think=maybe(st.sampled_from([True, False, "low", "high", "x"])),
              logprobs=maybe(st.booleans()), top_logprobs=maybe(small_ints),
              keep_alive=maybe(st.sampled_from([0, "5m", -1, "x"])))
FIELDS.update({
    "ollama.chat": dict(OLLAMA, messages=maybe(st.lists(rarely(ollama_message), max_size=3)),
                        tools=maybe(st.lists(maybe(tool), max_size=2))),
    "ollama.generate": dict(OLLAMA, prompt=maybe(texts), system=maybe(texts),
                            raw=maybe(st.booleans()), suffix=maybe(texts),
                            template=maybe(texts), context=maybe(token_ids),
                            images=maybe(st.lists(texts, max_size=1))),
})
ALL_NAMES = sorted({name for fields in FIELDS.values() for name in fields})
# how often the one field drawn is this one, against 1 for the others: the text fields carry
# the most shapes
WEIGHTS = {"messages": 12, "tools": 3, "prompt": 6, "content": 3, "tokens": 3}


def objects(endpoint: str) -> st.SearchStrategy:
    """Objects of the endpoint's fields: the body it serves with one field drawn (so that
    every other field is right and the drawn one reaches the deepest code that reads it),
    or up to four of its fields drawn together. An endpoint not in FIELDS gets any of
    every route's fields."""
    served = SERVED.get(endpoint, {})
    fields = FIELDS.get(endpoint, {name: any_json for name in ALL_NAMES})
    names = [name for name in sorted(fields) for _ in range(WEIGHTS.get(name, 1))]
    one = st.sampled_from(names).flatmap(
        lambda name: fields[name].map(lambda value: {**served, name: value}))
    few = st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))
    return st.one_of(one, few)


def _insert(body: bytes, at: int, what: bytes) -> bytes:
    at %= len(body) + 1
    return body[:at] + what + body[at:]


def _in_a_string(body: bytes, k: int, what: bytes) -> bytes:
    """`what` put after one of the body's quotes (the k-th, cyclically)."""
    quotes = [i + 1 for i, c in enumerate(body) if c == ord('"')] or [0]
    return _insert(body, quotes[k % len(quotes)], what)


def bodies(endpoint: str) -> st.SearchStrategy:
    as_json = objects(endpoint).map(lambda b: json.dumps(b).encode())
    spliced = st.builds(_insert, as_json, st.integers(0, 1 << 16),
                        st.binary(min_size=1, max_size=4))
    surrogate = st.builds(_in_a_string, as_json, st.integers(0, 64),
                          st.sampled_from([b"\\ud800", b"\\udfff", b"\xed\xa0\x80"]))
    return st.one_of(as_json, spliced, surrogate, any_json.map(lambda v: json.dumps(v).encode()),
                     st.binary(max_size=40))


# --- the routes ---------------------------------------------------------------------------

def _post_endpoints() -> dict[str, str]:
    """endpoint -> one of its POST paths, from the app's url_map (no model needed)."""
    app = create_app(ServerState(ServerConfig(), "none"))
    out: dict[str, str] = {}
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        if "POST" in rule.methods:
            out.setdefault(rule.endpoint, rule.rule)
    return out


ENDPOINTS = _post_endpoints()


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with in_process_app(tmp_path_factory.mktemp("fuzz")) as a:
        yield a


def test_the_fuzzed_routes_exist():
    assert set(FIELDS) == set(SERVED) and set(FIELDS) <= set(ENDPOINTS), \
        set(FIELDS) - set(ENDPOINTS)


def fuzz(app, path: str, strategy: st.SearchStrategy, examples: int) -> dict[str, int]:
    """Send `examples` bodies drawn from `strategy` to `path`: each a 200 or a 4xx in the
    route's error shape. Returns how many were answered ok and refused."""
    answered = {"ok": 0, "refused": 0}

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.filter_too_much])
    @given(body=strategy)
    def one(body: bytes) -> None:
        status, answer = app.post(path, body, timeout=REQUEST_TIMEOUT)
        if status == 200:
            answered["ok"] += 1
        else:
            assert_route_error(path, status, answer, f"{path} {body[:300]!r}")
            answered["refused"] += 1

    one()
    return answered


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_route_survives_fuzzing(app, endpoint):
    answered = fuzz(app, ENDPOINTS[endpoint], bodies(endpoint), EXAMPLES)
    assert answered["refused"], answered  # the draws reach the checks
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, answer = app.post("/v1/chat/completions", json.dumps(chat).encode())
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length", answer


# --- the routes of embedding and ranking models ----------------------------------------------

inputs = st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=3),
                   st.lists(st.one_of(st.integers(-2, 40_000), texts), max_size=4))
ENCODER_FIELDS = {
    "/v1/embeddings": ({"input": ["a cat", "a dog"]}, dict(
        input=maybe(inputs), encoding_format=maybe(st.sampled_from(["float", "base64", "x"])),
        dimensions=maybe(numbers), truncate=maybe(st.booleans()), model=maybe(texts),
        user=maybe(texts))),
    "/embedding": ({"content": "a cat"}, dict(
        content=maybe(inputs), input=maybe(inputs), embd_normalize=maybe(numbers),
        truncate=maybe(st.booleans()))),
    "/api/embed": ({"model": "m", "input": "a cat"}, dict(
        input=maybe(inputs), model=maybe(texts), truncate=maybe(st.booleans()),
        dimensions=maybe(numbers), options=maybe(OLLAMA_OPTIONS),
        keep_alive=maybe(st.sampled_from([0, "5m", -1, "x"])))),
    "/api/embeddings": ({"model": "m", "prompt": "a cat"}, dict(
        prompt=maybe(texts), model=maybe(texts), options=maybe(OLLAMA_OPTIONS))),
    "/v1/rerank": ({"query": "a cat", "documents": ["a dog", "a cat"]}, dict(
        query=maybe(texts), documents=maybe(st.lists(st.one_of(texts, st.fixed_dictionaries(
            {}, optional={"text": maybe(texts)})), max_size=3)), top_n=maybe(numbers),
        return_documents=maybe(st.booleans()), truncate=maybe(st.booleans()))),
}


def encoder_bodies(path: str) -> st.SearchStrategy:
    served, fields = ENCODER_FIELDS[path]
    one = st.sampled_from(sorted(fields)).flatmap(
        lambda name: fields[name].map(lambda value: {**served, name: value}))
    few = st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True).flatmap(
        lambda names: st.fixed_dictionaries({name: fields[name] for name in names}))
    # mostly the served body with one field drawn, so that most draws reach the encoder
    objs = st.integers(1, 4).flatmap(lambda i: few if i == 1 else one)
    as_json = objs.map(lambda b: json.dumps(b).encode())
    return st.integers(1, 4).flatmap(lambda i: as_json if i > 1 else st.builds(
        _insert, as_json, st.integers(0, 1 << 16), st.binary(min_size=1, max_size=4)))


@pytest.mark.parametrize("path", sorted(ENCODER_FIELDS))
def test_encoder_route_survives_fuzzing(tmp_path, path):
    """The embedding routes on an embedding model and rerank on a ranking one (the routes
    the text model above refuses at once), a fifth as many draws each."""
    rank = path == "/v1/rerank"
    model = write_bert(tmp_path / "tiny-bert.gguf", pooling="rank" if rank else "mean",
                       classifier=rank)
    with model_app(model) as app:
        answered = fuzz(app, path, encoder_bodies(path), EXAMPLES // 5)
        assert answered["ok"] and answered["refused"], answered
        served = ENCODER_FIELDS[path][0]
        assert app.post(path, json.dumps(served).encode())[0] == 200
