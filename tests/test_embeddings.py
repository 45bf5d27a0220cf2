"""Embedding and ranking models: loading, exactness in batches, and the routes
(/v1/embeddings, /embedding, /v1/rerank) with their limits and errors. The models are tiny
random-weight files (tests/embedding_models.py); vectors and scores against llama-server's are
in tests/test_embedding_parity.py."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

import kinetic
from kinetic.api.embeddings import MAX_INPUTS
from kinetic.engine.encoder import normalize
from tests.app_client import assert_error_shape, model_app
from tests.embedding_models import write_bert, write_qwen3_embedding

TEXTS = ["a cat", "The quick brown fox jumps over the lazy dog.", "Où est la gare ?",
         "日本語のテキスト", "def f(x):\n    return x * 2", "🙂🙃", "   ", "!!!", "word"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("embedding-models")
    return {
        "bert": write_bert(d / "tiny-bert.gguf", pooling="mean", dtype="f16"),
        "bert-none": write_bert(d / "tiny-bert-none.gguf", pooling="none"),
        "bert-rank": write_bert(d / "tiny-bert-rank.gguf", pooling="rank", classifier=True),
        "qwen3": write_qwen3_embedding(d / "tiny-qwen3-embed.gguf", pooling="last",
                                       dtype="q8_0"),
        "qwen3-rank": write_qwen3_embedding(d / "tiny-qwen3-rank.gguf", pooling="rank"),
    }


@pytest.fixture(scope="module")
def models(files):
    return {name: kinetic.load(path) for name, path in files.items()}


def post(app, path, body):
    return app.post(path, json.dumps(body).encode())


# --- the model -----------------------------------------------------------------------------

def test_what_a_model_serves_comes_from_its_file(models):
    kinds = {name: (m.kind, m.pooling) for name, m in models.items()}
    assert kinds == {"bert": ("embedding", "mean"), "bert-none": ("embedding", "none"),
                     "bert-rank": ("rerank", "rank"), "qwen3": ("embedding", "last"),
                     "qwen3-rank": ("rerank", "rank")}


@pytest.mark.parametrize("name", ["bert", "qwen3", "bert-rank", "qwen3-rank"])
def test_a_text_gives_the_same_bits_alone_and_in_a_batch_of_256(models, name):
    """A text's vector (or score) alone equals its vector among 255 others of mixed lengths
    (several steps of many texts each), bit for bit."""
    m = models[name]
    rng = np.random.default_rng(0)
    words = "cat dog sky river the of and quick brown fox jumps over lazy 42 🙂 été".split()
    batch = [" ".join(rng.choice(words, rng.integers(1, 60))) for _ in range(MAX_INPUTS)]
    picks = [0, 7, 100, 255]
    if m.kind == "rerank":
        together = m.rank("which animal", batch)
        for i in picks:
            assert np.float64(m.rank("which animal", [batch[i]])[0]).tobytes() == \
                np.float64(together[i]).tobytes()
        return
    together = m.embed(batch)
    for i in picks:
        assert m.embed(batch[i]).tobytes() == together[i:i + 1].tobytes()


def test_pooled_vectors_are_normalized_and_differ(models):
    v = models["bert"].embed(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    sims = v @ v.T
    assert (sims[~np.eye(len(TEXTS), dtype=bool)] < 0.9999).all()


def test_pooling_picks_rows_of_the_hidden_states(models):
    """mean, last and none agree with the per-token hidden states they pool."""
    bert, none = models["bert"], models["bert-none"]
    ids = bert.input_ids("a cat sat")
    h = bert.encoder.hidden([ids])[0]
    np.testing.assert_array_equal(bert.embed(ids, -1)[0], h.mean(axis=0, dtype=np.float32))
    q = models["qwen3"]
    hq = q.encoder.hidden([q.input_ids("a cat sat")])[0]
    np.testing.assert_array_equal(q.embed("a cat sat", -1)[0], hq[-1])
    rows = none.token_vectors("a cat sat", normalize_kind=-1)[0]
    assert rows.shape == (len(none.input_ids("a cat sat")), none.dim)
    with pytest.raises(ValueError, match="pooling is none"):
        none.embed("a cat")


def test_rank_prompt_layouts(models):
    bert = models["bert-rank"]
    tok = bert.tokenizer
    ids = bert.rank_prompt("a query", "a document")
    assert ids == ([tok.bos_id] + tok.encode("a query", add_special=False) + [tok.eos_id]
                   + tok.encode("a document", add_special=False) + [tok.eos_id])
    q = models["qwen3-rank"]
    ids = q.rank_prompt("capital of China?", "Beijing.")
    text = q.detokenize(ids)
    assert "<Query>: capital of China?" in text and "<Document>: Beijing." in text
    assert ids[0] == q.tokenizer.encode("<|im_start|>", parse_special=True, add_special=False)[0]


def test_normalize_as_llama_cpp():
    v = np.array([3.0, -4.0, 0.0], np.float32)
    np.testing.assert_allclose(normalize(v, 2), [0.6, -0.8, 0.0], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 1), [3 / 7, -4 / 7, 0.0], rtol=1e-6)
    np.testing.assert_allclose(normalize(v, 0), v * (32760 / 4), rtol=1e-6)
    assert normalize(v, -1).tobytes() == v.tobytes()
    np.testing.assert_allclose(normalize(v, 3), v / (27 + 64) ** (1 / 3), rtol=1e-6)
    assert not normalize(np.zeros(3, np.float32), 2).any()


# --- /v1/embeddings ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bert_app(files):
    with model_app(files["bert"]) as app:
        yield app


def test_v1_embeddings_answer_shape_and_input_forms(bert_app, models):
    m = models["bert"]
    status, body = post(bert_app, "/v1/embeddings", {"input": ["a cat", "a dog"]})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "tiny-bert"
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "embedding" for d in body["data"])
    got = np.array([d["embedding"] for d in body["data"]], np.float32)
    assert got.tobytes() == m.embed(["a cat", "a dog"]).tobytes()
    n = len(m.input_ids("a cat")) + len(m.input_ids("a dog"))
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    # a string, token ids, lists of token ids, mixed: the same vectors
    ids = m.input_ids("a cat")
    for form in ("a cat", ids, [ids], [ids, "a dog"]):
        status, body = post(bert_app, "/v1/embeddings", {"input": form})
        assert status == 200, (form, body)
        assert np.array(body["data"][0]["embedding"], np.float32).tobytes() == got[0].tobytes()


def test_v1_embeddings_base64_is_the_float_vector(bert_app):
    _, as_float = post(bert_app, "/v1/embeddings", {"input": "a cat"})
    status, as_b64 = post(bert_app, "/v1/embeddings",
                          {"input": "a cat", "encoding_format": "base64"})
    assert status == 200
    raw = base64.b64decode(as_b64["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tobytes() == \
        np.array(as_float["data"][0]["embedding"], np.float32).tobytes()


LONG = "word " * 600   # past the 512-token context


@pytest.mark.parametrize("body, param, says", [
    ({"input": ""}, "input", "empty"),
    ({"input": []}, "input", "empty"),
    ({"input": ["a", ""]}, "input", "input[1]"),
    ({"input": ["a", []]}, "input", "input[1]"),
    ({}, "input", "must be a string"),
    ({"input": 5}, "input", "must be a string"),
    ({"input": [1.5]}, "input", "input[0]"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"input": ["short", LONG]}, "input", "input[1] is"),
    ({"input": [[1, 2, 10 ** 9]]}, "input", "outside the vocabulary"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format", "float or base64"),
    ({"input": "a", "dimensions": 3}, "dimensions", "64 dimensions"),
    ({"input": "a", "truncate": "yes"}, "truncate", "true or false"),
])
def test_v1_embeddings_refuses_bad_input_with_a_400(bert_app, body, param, says):
    status, answer = post(bert_app, "/v1/embeddings", body)
    err = assert_error_shape(status, answer, str(body)[:80])
    assert status == 400 and err["param"] == param and says in err["message"], err


def test_truncate_runs_the_first_n_ctx_tokens(bert_app, models):
    m = models["bert"]
    status, body = post(bert_app, "/v1/embeddings", {"input": LONG, "truncate": True})
    assert status == 200, body
    cut = m.input_ids(LONG)[:m.n_ctx]
    assert body["usage"]["prompt_tokens"] == m.n_ctx
    assert np.array(body["data"][0]["embedding"], np.float32).tobytes() == m.embed(cut).tobytes()


def test_the_openai_client_gets_float_and_base64_vectors(files, models):
    """The official client over a real server. Asked for floats, the client itself asks for
    base64 and decodes it; asked for base64, it hands the string over."""
    openai = pytest.importorskip("openai")
    from tests.serve_process import serving
    with serving(str(files["bert"])) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        want = models["bert"].embed(["a cat", "a dog"])
        for fmt in ("float", "base64"):
            r = client.embeddings.create(model="tiny-bert", input=["a cat", "a dog"],
                                         encoding_format=fmt)
            got = [np.frombuffer(base64.b64decode(d.embedding), "<f4") if fmt == "base64"
                   else np.array(d.embedding, np.float32) for d in r.data]
            assert np.stack(got).tobytes() == want.tobytes(), fmt
            assert r.usage.prompt_tokens > 0


# --- /embedding (llama-server's) -----------------------------------------------------------

def test_llama_server_embedding_shape_and_normalization(bert_app, models):
    m = models["bert"]
    status, body = post(bert_app, "/embedding", {"content": "a cat"})
    assert status == 200, body
    assert len(body) == 1 and body[0]["index"] == 0 and len(body[0]["embedding"]) == 1
    assert np.array(body[0]["embedding"][0], np.float32).tobytes() == m.embed("a cat").tobytes()
    status, raw = post(bert_app, "/embeddings", {"input": ["a cat", "a dog"],
                                                 "embd_normalize": -1})
    assert status == 200 and [r["index"] for r in raw] == [0, 1]
    assert np.array(raw[1]["embedding"][0], np.float32).tobytes() == \
        m.embed("a dog", -1).tobytes()
    status, answer = post(bert_app, "/embedding", {"content": "a", "embd_normalize": "x"})
    assert assert_error_shape(status, answer)["param"] == "embd_normalize"


def test_pooling_none_gives_a_vector_per_token_and_the_openai_route_refuses(files, models):
    m = models["bert-none"]
    with model_app(files["bert-none"]) as app:
        status, body = post(app, "/embedding", {"content": "a cat sat"})
        assert status == 200
        rows = np.array(body[0]["embedding"], np.float32)   # not normalized, as llama-server
        assert rows.tobytes() == m.token_vectors("a cat sat")[0].tobytes()
        assert abs(np.linalg.norm(rows[0]) - 1.0) > 1e-3
        status, answer = post(app, "/v1/embeddings", {"input": "a cat"})
        assert status == 400 and "/embedding" in assert_error_shape(status, answer)["message"]


# --- /v1/rerank ----------------------------------------------------------------------------

DOCS = ["The capital of China is Beijing.", "Gravity pulls bodies together.",
        "Beijing is a large city.", "Cats sleep a lot."]


@pytest.mark.parametrize("name", ["bert-rank", "qwen3-rank"])
def test_rerank_orders_by_score_with_top_n_and_documents(files, models, name):
    m = models[name]
    scores = m.rank("What is the capital of China?", DOCS)
    with model_app(files[name]) as app:
        for path in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"):
            status, body = post(app, path, {"query": "What is the capital of China?",
                                            "documents": DOCS, "top_n": 3,
                                            "return_documents": True})
            assert status == 200, body
            order = sorted(range(len(DOCS)), key=lambda i: -scores[i])[:3]
            assert [r["index"] for r in body["results"]] == order
            assert [r["relevance_score"] for r in body["results"]] == [scores[i] for i in order]
            assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order]
            n = sum(len(m.rank_prompt("What is the capital of China?", d)) for d in DOCS)
            assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        # objects with text, no documents back, all of them by default
        status, body = post(app, "/v1/rerank", {"query": "What is the capital of China?",
                                                "documents": [{"text": d} for d in DOCS]})
        assert status == 200 and len(body["results"]) == len(DOCS)
        assert "document" not in body["results"][0]
        for bad, param in [({"documents": DOCS}, "query"),
                           ({"query": "q", "documents": []}, "documents"),
                           ({"query": "q", "documents": [3]}, "documents"),
                           ({"query": "q", "documents": ["d"] * (MAX_INPUTS + 1)}, "documents"),
                           ({"query": "q", "documents": DOCS, "top_n": -1}, "top_n"),
                           ({"query": "q", "documents": [LONG]}, "documents")]:
            status, answer = post(app, "/v1/rerank", bad)
            assert status == 400 and assert_error_shape(status, answer)["param"] == param, bad
        if name == "qwen3-rank":   # probabilities
            assert all(0.0 < s < 1.0 for s in scores)


# --- endpoints the model does not serve, metrics, props -------------------------------------

def test_each_kind_names_its_own_endpoint(files, bert_app):
    status, answer = post(bert_app, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "/v1/embeddings" in assert_error_shape(status, answer)["message"]
    for path in ("/v1/completions", "/completion", "/v1/rerank"):
        status, answer = post(bert_app, path, {"prompt": "hi", "query": "q", "documents": ["d"]})
        assert status == 400 and "/v1/embeddings" in answer["error"]["message"], path
    with model_app(files["bert-rank"]) as app:
        for path in ("/v1/embeddings", "/embedding", "/v1/chat/completions"):
            status, answer = post(app, path, {"input": "hi", "content": "hi",
                                              "messages": [{"role": "user", "content": "x"}]})
            assert status == 400 and "/v1/rerank" in answer["error"]["message"], path


def test_metrics_models_and_props_show_the_model(files):
    with model_app(files["bert"]) as app:
        post(app, "/v1/embeddings", {"input": ["a cat", "a dog"]})
        post(app, "/embedding", {"content": "a cat"})
        status, text = app.get("/metrics")
        lines = dict(line.rsplit(" ", 1) for line in text.decode().splitlines()
                     if not line.startswith("#"))
        assert lines["llamacpp:requests_total"] == "2"
        assert lines["llamacpp:prompt_tokens_total"] == "12"   # 4 + 4 + 4: [CLS] a cat [SEP]
        status, body = app.get("/v1/models")
        assert body["data"][0]["capabilities"] == ["embedding"]
        status, props = app.get("/props")
        assert props["capabilities"] == ["embedding"] and props["pooling"] == "mean"
        status, health = app.get("/health")
        assert status == 200 and health["status"] == "ok"
        status, slots = app.get("/slots")
        assert status == 200 and slots[0]["n_ctx"] == 512


def test_kinetic_run_refuses_an_embedding_model_with_a_line(files, capsys):
    from kinetic.cli import main
    assert main(["run", str(files["bert"]), "hi"]) == 1
    assert "is an embedding model, which does not generate text" in capsys.readouterr().err


# --- fuzzing: every body is a 200 or a 400 in the OpenAI shape, never a 5xx ---------------

def test_embedding_and_rerank_routes_survive_fuzzing(files):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.test_fuzz_routes import any_json, maybe, plain, token_ids
    inputs = st.one_of(plain, st.lists(plain, max_size=3), token_ids,
                       st.lists(token_ids, max_size=3), any_json)
    bodies = st.fixed_dictionaries({}, optional={
        "input": inputs, "content": inputs, "encoding_format": maybe(st.sampled_from(
            ["float", "base64"])), "embd_normalize": maybe(st.integers(-3, 4)),
        "truncate": maybe(st.booleans()), "dimensions": maybe(st.integers(0, 100)),
        "query": maybe(plain), "documents": maybe(st.lists(st.one_of(
            plain, st.fixed_dictionaries({"text": plain})), max_size=3)),
        "top_n": maybe(st.integers(-2, 5)), "return_documents": maybe(st.booleans())})
    for name, paths in (("bert", ("/v1/embeddings", "/embedding")),
                        ("bert-rank", ("/v1/rerank",))):
        with model_app(files[name]) as app:
            @settings(max_examples=60, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(body=bodies, path=st.sampled_from(paths))
            def check(body, path):
                status, answer = post(app, path, body)
                if status != 200:
                    err = assert_error_shape(status, answer, f"{path} {body!r:.200}")
                    assert status == 400, err
            check()


def test_pooling_flag_overrides_an_embedding_models_own(tmp_path):
    """llama-server's --pooling: an embedding model pools as asked; a text model refuses."""
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.llm import open_model
    from tests.embedding_models import write_bert
    path = write_bert(tmp_path / "bert.gguf")
    model = open_model(path, EngineConfig(n_ctx=64), pooling="none")
    assert model.pooling == "none"
    vectors = model.token_vectors(["hello world"])
    assert vectors[0].shape[0] == len(model.input_ids("hello world"))
    assert open_model(path, EngineConfig(n_ctx=64), pooling="cls").pooling == "cls"


def test_pooling_flag_is_refused_for_a_text_model(tmp_path):
    from kinetic.engine.engine_config import EngineConfig
    from kinetic.llm import open_model
    from tests.tiny_models import write_tiny_model
    path = write_tiny_model(tmp_path / "t.gguf", "qwen3", context_length=64)
    with pytest.raises(ValueError, match="text model"):
        open_model(path, EngineConfig(n_ctx=64), pooling="mean")


def test_a_split_is_refused_for_an_embedding_model(tmp_path):
    """(rather than the model running on one device while the flags say otherwise)"""
    from kinetic.engine.engine_config import EngineConfig, Split
    from kinetic.llm import open_model
    path = write_bert(tmp_path / "bert.gguf", pooling="mean", dtype="f16")
    with pytest.raises(ValueError, match="embedding model, which runs on one device"):
        open_model(path, EngineConfig(n_ctx=64, split=Split("row", 2)))


def test_inputs_may_mix_ids_and_texts(tmp_path):
    from kinetic.api.embeddings import parse_inputs
    assert parse_inputs([12, 34, "text", 56], "input") == [[12, 34, "text", 56]]
    assert parse_inputs([[12, 34], [12, "t", 34]], "input") == [[12, 34], [12, "t", 34]]
    for bad in ([12, ""], [[None]]):
        with pytest.raises(Exception):
            parse_inputs(bad, "input")
