"""Receipts (kinetic/receipts, docs/server.md "Receipts"): answers of a real model made
through the app with `"receipt": true` verify token for token, greedy, seeded (penalties, DRY,
Mirostat), constrained (JSON Schema, GBNF, a forced tool call), streamed, ended by a stop
string and cut by max_tokens, alone and inside a busy batch with drafting on; and each
tampering (a token id, a sampling parameter, a prompt id, a signature byte, the model file)
is refused with its message and exit status, through `kinetic verify-receipt` (cli.main).
The server's engine (4 slots, drafting on) made the answers; another engine (1 slot, no
drafts) checks them, and the CLI a third, built from the receipt's settings.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import threading

import pytest

import kinetic
from kinetic import receipts
from kinetic.cli import main
from kinetic.grammar import compile_gbnf, compile_json_schema
from kinetic.grammar.ir import GrammarBuilder, lit, seq
from tests.app_client import AppClient
from tests.conftest import real_model_file

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
ASK = [{"role": "user", "content": "Name three rivers of Europe."}]
# repetitive, so that n-gram drafts are proposed and accepted
DAYS = ("Days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
        "Again: Monday, Tuesday, Wednesday,")
PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


# --- without a model: the canonical form, signatures, grammar records -----------------------

def test_canonical_form_is_sorted_compact_utf8():
    assert receipts.canonical({"b": [1, 2.5], "a": "é"}) == '{"a":"é","b":[1,2.5]}'.encode()
    with pytest.raises(ValueError):
        receipts.canonical({"x": float("nan")})


def test_signature_covers_everything_else(tmp_path):
    key = tmp_path / "k.pem"
    public = receipts.write_signing_key(key)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    signer = receipts.load_signing_key(key)
    assert signer.public_key == public
    signed = signer.sign({"version": 1, "output": {"token_ids": [1, 2]}})
    assert receipts.check_signature(json.loads(json.dumps(signed))) == public
    changed = copy.deepcopy(signed)
    changed["output"]["token_ids"][0] = 3
    with pytest.raises(receipts.ReceiptError, match="bad signature"):
        receipts.check_signature(changed)
    other = receipts.write_signing_key(tmp_path / "other.pem")
    with pytest.raises(receipts.ReceiptError, match="another key"):
        receipts.check_signature(signed, receipts.parse_public_key(other))
    assert receipts.check_signature(signed, receipts.parse_public_key(str(key))) == public
    with pytest.raises(receipts.ReceiptError, match="not signed"):
        receipts.check_signature({"version": 1}, receipts.parse_public_key(public))


@pytest.mark.parametrize("content, words", [
    (None, "no such file"),
    (b"not a key", "not a PEM private key"),
    ("rsa", "not an Ed25519 key"),
])
def test_a_bad_signing_key_fails_at_start_in_one_line(tmp_path, content, words):
    from kinetic.cli import build_parser
    from kinetic.serve_cli import serve_options
    path = tmp_path / "key.pem"
    if content == "rsa":
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import rsa
        k = rsa.generate_private_key(public_exponent=65537, key_size=1024)
        content = k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    if content is not None:
        path.write_bytes(content)
    args = build_parser().parse_args(["serve", "smollm2", "--sign-key", str(path)])
    with pytest.raises(SystemExit) as e:
        serve_options(args)
    message = str(e.value)
    assert "\n" not in message and words in message and str(path) in message


def test_a_signing_key_others_can_read_is_warned_of(tmp_path, capsys):
    from kinetic.cli import build_parser
    from kinetic.serve_cli import serve_options
    path = tmp_path / "key.pem"
    receipts.write_signing_key(path)
    for mode, warned in ((0o600, False), (0o644, True)):
        os.chmod(path, mode)
        serve_options(build_parser().parse_args(["serve", "smollm2", "--sign-key", str(path)]))
        err = capsys.readouterr().err
        assert ("can be read by others (mode 0644)" in err) == warned, err


def test_keygen_writes_a_private_key_and_prints_the_public_one(tmp_path, capsys):
    path = tmp_path / "k.pem"
    assert main(["keygen", str(path)]) == 0
    public = capsys.readouterr().out.strip()
    assert receipts.load_signing_key(path).public_key == public
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert main(["keygen", str(path)]) == 1      # kept
    assert "exists" in capsys.readouterr().err
    assert main(["keygen", str(path), "--force"]) == 0


def test_grammar_records_compile_back_to_the_same_tables():
    from kinetic.chat.tool_calls import FORMATS
    schema = {"type": "object", "properties": {"zeta": {"type": "integer"},
                                               "alpha": {"type": "string"}}}
    b = GrammarBuilder()
    b.define("root", seq(lit("a"), lit("b")))
    grammars = [compile_gbnf('root ::= "yes" | "no"'), compile_json_schema(schema),
                compile_json_schema(True), FORMATS["hermes"].grammar(WEATHER, True, "optional"),
                b.build()]
    for g in grammars:
        rec = json.loads(receipts.canonical(receipts.grammar_record(g)))   # keys sorted
        assert receipts.compile_grammar(rec).kind == g.kind
        assert receipts.grammar_digest(receipts.compile_grammar(rec)) == rec["sha256"]
    assert receipts.grammar_record(grammars[-1])["type"] == "rules"
    swapped = receipts.grammar_record(compile_json_schema(
        {"type": "object", "properties": {"alpha": {"type": "string"},
                                          "zeta": {"type": "integer"}}}))
    assert swapped["sha256"] != receipts.grammar_record(grammars[1])["sha256"]


def test_the_command_exits_2_for_a_receipt_it_cannot_read(tmp_path):
    import subprocess
    import sys
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "model": ')
    proc = subprocess.run([sys.executable, "-m", "kinetic.cli", "verify-receipt", str(bad)],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr.startswith("kinetic verify-receipt: cannot check the receipt: not JSON")


def test_unreadable_receipts_are_unusable():
    for text, words in [("{", "not JSON"), ("[1]", "JSON object"),
                        ('{"version": 99}', "unknown receipt version 99")]:
        result = kinetic.verify_receipt(text)
        assert result.status == "unusable" and result.exit_code == 2
        assert words in result.message


# --- crafted receipts: refused before a model is read, or before it is re-run ----------------

def bare(model: dict | None = None, engine: dict | None = None, **request) -> dict:
    """A well-formed receipt of 3 prompt tokens and one output token, no model behind it."""
    from kinetic.engine.request import GenerationRequest
    from kinetic.engine.sampling_params import SamplingParams
    rec = receipts.request_record(GenerationRequest([1, 2, 3], SamplingParams(), 4), 7, None)
    eng = {"name": "kinetic", "version": kinetic.__version__, "backend": "cpu",
           "device": "cpu", "kernel": "ffi", "weights": "gguf",
           "activation_rounding": "llama.cpp", "step_tokens": 16, "n_ctx": 256,
           "page_size": 16, "kv_dtype": "float16", "max_candidates": 256,
           "history_width": 256, "split": {"mode": "none"}}
    return {"version": 1, "model": model or {"name": "none.gguf", "size": 1,
                                             "sha256": "0" * 64},
            "engine": dict(eng, **(engine or {})), "request": dict(rec, **request),
            "output": {"token_ids": [5], "text": "x", "finish_reason": "length"}}


def rules(table: dict) -> dict:
    return {"type": "rules", "rules": json.dumps(table), "sha256": "0" * 64}


@pytest.mark.parametrize("change, words", [
    # root ::= root <any byte>: the matcher's expansion of it would never end (it once took
    # all the memory there was)
    ({"grammar": rules({"root": 0, "names": ["root"], "rules": [[[[1, 0], [0, "ff"]]]]})},
     "left recursion in rule 'root'"),
    ({"grammar": rules({"root": 0, "names": ["root"], "rules": [[[[1, 3]]]]})},
     "not a grammar symbol"),
    ({"grammar": rules({"root": 0, "names": ["root"], "rules": [[[[0, 1]] * (1 << 20)]]})},
     "too large"),
    ({"top_k": 10**12}, "top_k must be between"),
    ({"seed": 2**200}, "seed must be an integer from 0 to"),
])
def test_a_crafted_request_is_refused_before_a_model_is_read(change, words):
    result = kinetic.verify_receipt(bare(**change))
    assert result.status == "unusable" and words in result.message, result.message


@pytest.mark.parametrize("name", ["/etc/passwd", "../../../etc/passwd", "a/b.gguf", "x" * 300])
def test_a_receipts_model_name_is_a_file_name_in_the_cache(name):
    result = kinetic.verify_receipt(bare(model={"name": name, "size": 1, "sha256": "0" * 64}))
    assert result.status == "unusable" and "is not a file name" in result.message, \
        result.message


def test_a_receipts_version_is_the_integer_1():
    for version in (True, 1.0, "1"):
        result = kinetic.verify_receipt(dict(bare(), version=version))
        assert result.status == "unusable" and "unknown receipt version" in result.message


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    from tests.tiny_models import write_tiny_model
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_model(path, "llama")
    return path


@pytest.mark.parametrize("engine, words", [
    ({"history_width": 10**9}, "engine.history_width must be an integer from 1 to"),
    ({"max_candidates": 0}, "engine.max_candidates must be an integer from 1 to"),
    ({"max_candidates": "x"}, "engine.max_candidates must be an integer"),
    ({"split": "row"}, "engine.split must be an object"),
    ({"weights": "int3"}, "not ones kinetic runs"),
    ({"backend": None}, "engine.backend is missing"),
])
def test_engine_settings_kinetic_never_runs_are_refused_before_loading(
        tiny_file, monkeypatch, engine, words):
    import kinetic.model.loader as loader

    def no_load(*args, **kwargs):
        raise AssertionError("loaded a model for a receipt it should have refused")
    monkeypatch.setattr(loader, "load_model", no_load)
    result = kinetic.verify_receipt(bare(receipts.model_record(tiny_file), engine),
                                    model=str(tiny_file))
    assert result.status == "unusable" and words in result.message, result.message


def test_a_model_that_is_a_folder_is_refused(tmp_path):
    result = kinetic.verify_receipt(bare(), model=str(tmp_path))
    assert result.status == "unusable" and "is not a file" in result.message, result.message


def test_a_signer_other_than_the_trusted_key_is_refused_before_a_rerun(tmp_path):
    """With a trusted key, a receipt signed by another is refused as such, even when it was
    changed after signing (which would otherwise be re-run to name the change: here no
    model is there to re-run it, and the message is the signer's)."""
    receipts.write_signing_key(tmp_path / "k1.pem")
    receipt = receipts.load_signing_key(tmp_path / "k1.pem").sign(bare())
    receipt["output"]["token_ids"] = [6]
    other = receipts.write_signing_key(tmp_path / "k2.pem")
    result = kinetic.verify_receipt(receipt, public_key=other)
    assert result.status == "unusable" and "signed by another key" in result.message, \
        result.message


def test_a_public_key_path_that_is_no_file_says_so(tmp_path):
    with pytest.raises(receipts.ReceiptError, match="no such file"):
        receipts.parse_public_key(str(tmp_path / "missing.pem"))
    with pytest.raises(receipts.ReceiptError, match="a folder"):
        receipts.parse_public_key(str(tmp_path))


def test_a_receipt_file_past_the_size_bound_is_not_read(tmp_path, monkeypatch, capsys):
    from kinetic.receipts import verify
    monkeypatch.setattr(verify, "MAX_RECEIPT_BYTES", 1000)
    path = tmp_path / "big.json"
    path.write_text(json.dumps(dict(bare(), padding="x" * 2000)))
    result = kinetic.verify_receipt(path)
    assert result.status == "unusable" and "larger than a receipt can be" in result.message
    code = main(["verify-receipt", str(path)])   # the command reads no more than the bound
    assert code == 2 and "larger than a receipt can be" in capsys.readouterr().err


# --- with smollm2 ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from kinetic.api.app import create_app
    from kinetic.api.core import ServerConfig, ServerState
    path = real_model_file("smollm2")
    tmp = tmp_path_factory.mktemp("receipts")
    key = tmp / "sign.pem"
    public = receipts.write_signing_key(key)
    served = kinetic.load(path, n_ctx=1024, parallel=4)          # drafting on
    state = ServerState(ServerConfig(sign_key=str(key)), "SmolLM2-135M-Instruct.Q4_1")
    state.set_ready(served)
    client = AppClient(create_app(state))
    checker = kinetic.load(path, n_ctx=1024, parallel=1, speculative=False)
    yield {"path": path, "client": client, "served": served, "checker": checker,
           "public": public, "tmp": tmp, "key": key}
    client.close()
    served.close()
    checker.close()


def post(setup, path: str, body: dict) -> dict:
    status, answer = setup["client"].post(path, json.dumps(body).encode())
    assert status == 200, answer
    return answer


def stream(setup, path: str, body: dict) -> list[dict]:
    status, raw = setup["client"].post(path, json.dumps(dict(body, stream=True)).encode())
    assert status == 200, raw
    events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    if path != "/completion":
        assert events[-1] == "[DONE]"
        events = events[:-1]
    return [json.loads(e) for e in events]


def check(setup, receipt: dict, signed: bool = True) -> receipts.Verification:
    result = kinetic.verify_receipt(receipt, model=setup["checker"])
    assert result.status == "verified", result.message
    assert result.exit_code == 0 and result.ok
    assert result.n_tokens == len(receipt["output"]["token_ids"])
    assert result.signed_by == (setup["public"] if signed else None)
    assert result.trusted is False   # no public_key asked for
    if signed:   # then a note says so plainly, naming the signer's fingerprint
        assert result.signer.startswith("SHA256:") and f"signed by key {result.signer}" in \
            result.message
        assert any("no trusted key" in n and result.signer in n for n in result.notes)
    return result


def unsigned(receipt: dict) -> dict:
    out = copy.deepcopy(receipt)
    del out["signature"]
    return out


@pytest.mark.real_model
def test_greedy_chat_receipt_holds_the_answer_and_verifies(setup):
    answer = post(setup, CHAT, {"messages": ASK, "temperature": 0, "max_tokens": 24,
                                "receipt": True})
    r = answer["receipt"]
    assert r["version"] == 1
    assert r["model"]["name"] == os.path.basename(setup["path"])
    assert r["model"]["size"] == os.path.getsize(setup["path"])
    from kinetic.fetch import MODELS
    assert r["model"]["sha256"] == MODELS["smollm2"].sha256
    e = r["engine"]
    assert (e["name"], e["kernel"], e["n_ctx"], e["step_tokens"]) == (
        "kinetic", setup["served"].config.kernel, 1024, 16)
    assert {"version", "backend", "row_buckets", "kv_dtype", "activation_rounding"} <= set(e)
    req = r["request"]
    assert req["prompt_ids"] == setup["served"].tokenize(
        setup["served"].apply_chat_template(ASK), parse_special=True)
    assert req["temperature"] == 0 and req["max_tokens"] == 24 and req["grammar"] is None
    assert len(r["output"]["token_ids"]) == answer["usage"]["completion_tokens"]
    assert r["output"]["text"] == answer["choices"][0]["message"]["content"]
    assert r["signature"]["alg"] == "ed25519" and r["signature"]["public_key"] == setup["public"]
    check(setup, r)


@pytest.mark.real_model
@pytest.mark.parametrize("fields", [
    {"temperature": 0.8, "seed": 42},
    {"temperature": 1.0, "seed": 7, "top_k": 0, "top_p": 0.9, "repeat_penalty": 1.3,
     "presence_penalty": 0.5, "frequency_penalty": 0.3, "dry_multiplier": 0.8,
     "logit_bias": {"11": 3, "28": -100}, "xtc_probability": 0.5, "typical_p": 0.9},
    {"temperature": 0.7, "seed": 3, "mirostat": 2},
    {"temperature": 0.9},                       # no seed: the one drawn is recorded
], ids=["seeded", "penalties-dry-bias", "mirostat", "fresh-seed"])
def test_seeded_chat_receipts_verify(setup, fields):
    r = post(setup, CHAT, dict(messages=ASK, max_tokens=32, receipt=True, **fields))["receipt"]
    if "seed" in fields:
        assert r["request"]["seed"] == fields["seed"]
    else:
        assert isinstance(r["request"]["seed"], int)
    check(setup, r)


@pytest.mark.real_model
@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}},
    {"response_format": {"type": "json_object"}},
    {"grammar": 'root ::= "The rivers are " river ", " river " and " river "."\n'
                'river ::= "the Rhine" | "the Danube" | "the Seine" | "the Po"'},
    {"tools": WEATHER, "tool_choice": "required", "messages": [
        {"role": "user", "content": "What is the weather in Paris?"}]},
], ids=["json-schema", "json-object", "gbnf", "forced-tool-call"])
def test_constrained_receipts_verify(setup, fields):
    body = dict({"messages": ASK, "temperature": 0.6, "seed": 11, "max_tokens": 60,
                 "receipt": True}, **fields)
    r = post(setup, CHAT, body)["receipt"]
    grammar = r["request"]["grammar"]
    assert grammar["type"] == ("tool_call" if "tools" in fields else
                               "gbnf" if "grammar" in fields else "json_schema")
    assert len(grammar["sha256"]) == 64
    check(setup, r)


@pytest.mark.real_model
def test_streamed_receipt_comes_in_the_last_chunk_and_verifies(setup):
    body = {"messages": ASK, "temperature": 0.8, "seed": 5, "max_tokens": 20, "receipt": True}
    chunks = stream(setup, CHAT, body)
    assert [("receipt" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    r = chunks[-1]["receipt"]
    assert r == post(setup, CHAT, body)["receipt"]   # Ed25519 signatures are deterministic
    check(setup, r)
    with_usage = stream(setup, CHAT, dict(body, stream_options={"include_usage": True}))
    assert with_usage[-1]["choices"] == [] and "receipt" in with_usage[-1]
    check(setup, with_usage[-1]["receipt"])


@pytest.mark.real_model
def test_stop_string_and_length_cut_receipts_verify(setup):
    body = {"prompt": DAYS, "temperature": 0, "max_tokens": 30, "stop": [" Friday"],
            "receipt": True}
    answer = post(setup, COMPLETIONS, body)
    r = answer["receipt"]
    assert r["output"]["finish_reason"] == "stop" and "Friday" not in r["output"]["text"]
    assert "Friday" in setup["served"].detokenize(r["output"]["token_ids"])   # its last token
    check(setup, r)
    cut = post(setup, COMPLETIONS, dict(body, stop=[], max_tokens=5))["receipt"]
    assert cut["output"]["finish_reason"] == "length" and len(cut["output"]["token_ids"]) == 5
    check(setup, cut)
    streamed = stream(setup, COMPLETIONS, dict(body, temperature=0.7, seed=9))
    check(setup, streamed[-1]["receipt"])


@pytest.mark.real_model
def test_llama_server_completion_receipts_verify(setup):
    body = {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0.5,
            "seed": 21, "receipt": True}
    whole = post(setup, "/completion", body)
    check(setup, whole["receipt"])
    events = stream(setup, "/completion", body)
    assert events[-1]["stop"] is True and "receipt" in events[-1]
    assert unsigned(events[-1]["receipt"]) == unsigned(whole["receipt"])


@pytest.mark.real_model
def test_receipts_made_in_a_busy_batch_with_drafts_verify(setup):
    """Receipts of answers that shared every step with three others and took drafted tokens
    verify on a one-slot engine that drafts nothing."""
    served = setup["served"]
    before = served.engine.counters()
    others = [{"prompt": DAYS + f" {i}", "temperature": 0.5, "seed": i, "max_tokens": 40}
              for i in range(3)]
    threads = [threading.Thread(target=post, args=(setup, COMPLETIONS, b)) for b in others]
    for t in threads:
        t.start()
    got = {}
    for kind, fields in {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.6,
                                                                "seed": 1}}.items():
        got[kind] = post(setup, COMPLETIONS, dict(prompt=DAYS, max_tokens=40, receipt=True,
                                                  **fields))["receipt"]
    for t in threads:
        t.join()
    after = served.engine.counters()
    assert after["draft_accepted"] > before["draft_accepted"]
    for r in got.values():
        check(setup, r)


def cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["verify-receipt", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def write(setup, name: str, receipt) -> str:
    path = setup["tmp"] / name
    path.write_text(receipt if isinstance(receipt, str) else json.dumps(receipt))
    return str(path)


@pytest.fixture(scope="module")
def seeded(setup):
    """A signed receipt of a seeded answer of at least 8 tokens."""
    r = post(setup, CHAT, {"messages": ASK, "temperature": 0.8, "seed": 42, "max_tokens": 24,
                           "receipt": True})["receipt"]
    assert len(r["output"]["token_ids"]) >= 8
    return r


@pytest.mark.real_model
def test_cli_verifies_a_good_receipt_with_its_signer(setup, seeded, capsys):
    code, out, err = cli([write(setup, "good.json", seeded), "--model", setup["path"],
                          "--public-key", setup["public"]], capsys)
    n = len(seeded["output"]["token_ids"])
    assert code == 0 and f"verified: {n} tokens identical" in out, err
    assert f"signed by key {receipts.signing.fingerprint(setup['public'])}" in out
    assert "no trusted key" not in err   # --public-key named the signer
    assert "verifying" in err          # the progress bar
    # the whole answer works too, the model found by name in kinetic's cache
    code, out, err = cli([write(setup, "answer.json", {"id": "x", "receipt": seeded})], capsys)
    assert code == 0 and "verified" in out, err
    # without --public-key any key's signature holds: stderr says so, naming the key
    assert "no trusted key was given" in err and "--public-key" in err


@pytest.mark.real_model
def test_a_changed_token_id_is_named_with_both_tokens(setup, seeded, capsys):
    r = unsigned(seeded)
    real = r["output"]["token_ids"][3]
    r["output"]["token_ids"][3] = (real + 1) % setup["checker"].config.vocab_size
    code, out, err = cli([write(setup, "token.json", r), "--model", setup["path"]], capsys)
    assert code == 1, err
    assert "differs at output position 3" in out
    assert f"token {real} " in out and f"token {r['output']['token_ids'][3]} " in out
    assert out.count("logprob") == 2
    result = kinetic.verify_receipt(r, model=setup["checker"])
    assert (result.status, result.position, result.n_tokens) == ("differs", 3, 3)
    assert result.engine_token.token == real
    assert result.receipt_token.token == r["output"]["token_ids"][3]
    assert result.engine_token.logprob > float("-inf")
    # signed, the same change breaks the signature too; the re-run still names the token
    # (exit 1), and says the signature does not hold
    code, out, err = cli([write(setup, "token-signed.json", dict(r, signature=seeded[
        "signature"])), "--model", setup["path"]], capsys)
    assert code == 1 and "differs at output position 3" in out and "bad signature" in out


@pytest.mark.real_model
def test_a_changed_sampling_parameter_is_refused(setup, seeded, capsys):
    r = unsigned(seeded)
    banned = r["output"]["token_ids"][2]
    first = r["output"]["token_ids"].index(banned)
    r["request"]["logit_bias"] = [[banned, -100.0]]
    code, out, err = cli([write(setup, "param.json", r), "--model", setup["path"]], capsys)
    assert code == 1 and f"differs at output position {first}" in out, (out, err)
    assert f"the receipt has token {banned} " in out


@pytest.mark.real_model
def test_a_changed_prompt_id_is_refused(setup, capsys):
    served = setup["served"]
    france, japan = (served.tokenize(w, add_special=False) for w in (" France", " Japan"))
    assert len(france) == len(japan) == 1
    r = unsigned(post(setup, COMPLETIONS, {"prompt": "The capital of France is",
                                           "temperature": 0, "max_tokens": 6,
                                           "receipt": True})["receipt"])
    ids = r["request"]["prompt_ids"]
    ids[ids.index(france[0])] = japan[0]
    code, out, err = cli([write(setup, "prompt.json", r), "--model", setup["path"]], capsys)
    assert code == 1 and "differs at output position" in out, (out, err)


@pytest.mark.real_model
def test_a_flipped_signature_byte_is_a_bad_signature(setup, seeded, capsys):
    import base64
    r = copy.deepcopy(seeded)
    value = bytearray(base64.b64decode(r["signature"]["value"]))
    value[10] ^= 1
    r["signature"]["value"] = base64.b64encode(bytes(value)).decode()
    code, out, err = cli([write(setup, "sig.json", r), "--model", setup["path"]], capsys)
    assert code == 2 and "bad signature" in err and not out
    other = receipts.write_signing_key(setup["tmp"] / "other.pem")
    code, out, err = cli([write(setup, "good2.json", seeded), "--model", setup["path"],
                          "--public-key", other], capsys)
    assert code == 2 and "another key" in err


@pytest.mark.real_model
def test_a_wrong_model_file_is_named_by_its_hash(setup, seeded, capsys):
    wrong = setup["tmp"] / "changed.gguf"
    shutil.copyfile(setup["path"], wrong)
    with open(wrong, "r+b") as f:      # one byte of the weights, far from the header
        f.seek(os.path.getsize(wrong) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    path = write(setup, "model.json", seeded)
    code, out, err = cli([path, "--model", str(wrong)], capsys)
    assert code == 2 and "wrong model file" in err and seeded["model"]["sha256"] in err, err
    assert receipts.model_record(wrong)["sha256"] in err
    from kinetic.fetch import model_path
    other = model_path("gemma3")        # another model, if cached: its size differs
    if other is not None:
        code, out, err = cli([path, "--model", str(other)], capsys)
        assert code == 2 and "wrong model file" in err and seeded["model"]["sha256"] in err


@pytest.mark.real_model
def test_unusable_receipts_exit_2_saying_why(setup, seeded, capsys):
    cases = [("bad.json", "{not json", "not JSON"),
             ("version.json", dict(seeded, version=7), "unknown receipt version 7"),
             ("missing.json", {k: v for k, v in unsigned(seeded).items() if k != "output"},
              "no output")]
    for name, receipt, words in cases:
        code, out, err = cli([write(setup, name, receipt), "--model", setup["path"]], capsys)
        assert code == 2 and words in err, (name, err)


@pytest.mark.real_model
def test_a_receipt_field_that_is_not_a_boolean_is_a_400(setup):
    status, answer = setup["client"].post(CHAT, json.dumps(
        {"messages": ASK, "max_tokens": 1, "receipt": "yes"}).encode())
    assert status == 400 and answer["error"]["param"] == "receipt"


@pytest.mark.real_model
def test_python_api_receipt_verifies_and_names_a_tampered_token(setup):
    m = setup["checker"]
    r = m.receipt("The capital of France is", max_tokens=8, temperature=0.7, seed=3,
                  sign_key=setup["key"])
    assert len(r["output"]["token_ids"]) >= 6
    assert kinetic.verify_receipt(r, model=m).ok
    assert kinetic.verify_receipt(unsigned(r), model=setup["path"]).ok
    r = unsigned(r)
    r["output"]["token_ids"][5] = (r["output"]["token_ids"][5] + 7) % m.config.vocab_size
    result = kinetic.verify_receipt(r, model=m)
    assert result.status == "differs" and result.position == 5 and result.exit_code == 1


@pytest.mark.real_model
def test_a_receipt_records_its_cache_type_and_replays_with_it(setup):
    """A q8_0 cache's answer names its cache type in the receipt, and verify-receipt replays
    it on a q8_0 engine, even when handed a model loaded with the default (f16) cache; the
    same request on the f16 cache records float16."""
    m = kinetic.load(setup["path"], n_ctx=1024, parallel=1, speculative=False, cache_type="q8_0")
    try:
        r = m.receipt("The capital of France is", max_tokens=12, temperature=0.7, seed=5)
    finally:
        m.close()
    assert r["engine"]["kv_dtype"] == "q8_0"
    result = kinetic.verify_receipt(r, model=setup["checker"])
    assert result.status == "verified", result.message
    assert kinetic.verify_receipt(r, model=setup["path"]).ok
    f16 = setup["checker"].receipt("The capital of France is", max_tokens=12, temperature=0.7,
                                   seed=5)
    assert f16["engine"]["kv_dtype"] == "float16" and kinetic.verify_receipt(
        f16, model=setup["checker"]).ok


@pytest.mark.real_model
def test_a_whole_answer_must_show_the_receipts_text(setup):
    """Given a whole saved answer, verifying also checks the text a reader saw: the chat
    message's content, a completion's text, /completion's content. An answer whose tokens
    re-derive but whose visible text was changed differs."""
    answers = [post(setup, CHAT, {"messages": ASK, "temperature": 0, "max_tokens": 12,
                                  "receipt": True}),
               post(setup, COMPLETIONS, {"prompt": DAYS, "temperature": 0, "max_tokens": 8,
                                         "receipt": True}),
               post(setup, "/completion", {"prompt": DAYS, "n_predict": 8, "temperature": 0,
                                           "receipt": True})]
    message = answers[0]["choices"][0]["message"]
    words = message["content"].split()
    assert len(words) >= 3, message
    edits = [lambda a: a["choices"][0]["message"].update(content="Paris is lovely."),
             lambda a: a["choices"][0].update(text=a["choices"][0]["text"] + " (edited)"),
             lambda a: a.update(content="Not what the model said"),
             # a part of the text, or none of it, is not the text: the message must be the
             # whole text (taken apart at <think> where the model thinks)
             lambda a: a["choices"][0]["message"].update(content=words[1]),
             lambda a: a["choices"][0]["message"].update(content="  ")]
    for answer, edit in zip(answers + [copy.deepcopy(answers[0])] * 2, edits):
        answer = copy.deepcopy(answer)
        good = kinetic.verify_receipt(answer, model=setup["checker"])
        assert good.status == "verified", good.message
        edit(answer)
        bad = kinetic.verify_receipt(answer, model=setup["checker"])
        assert bad.status == "differs" and bad.exit_code == 1, bad.message
        assert "is not the receipt's text" in bad.message


@pytest.mark.real_model
def test_each_of_n_choices_has_its_own_receipt(setup):
    """With n > 1 each choice carries the receipt of its own sequence (its seed the
    request's plus its index), and each verifies."""
    answer = post(setup, CHAT, {"messages": ASK, "temperature": 0.8, "seed": 5, "n": 2,
                                "max_tokens": 10, "receipt": True})
    assert "receipt" not in answer and len(answer["choices"]) == 2
    for i, choice in enumerate(answer["choices"]):
        r = choice["receipt"]
        assert r["request"]["seed"] == 5 + i
        assert r["output"]["text"] == choice["message"]["content"]
        check(setup, r)
    # the whole answer: every choice's receipt, and the text each choice shows
    whole = kinetic.verify_receipt(answer, model=setup["checker"])
    assert whole.status == "verified" and "all 2 choices" in whole.message, whole.message
    assert whole.n_tokens == sum(len(c["receipt"]["output"]["token_ids"])
                                 for c in answer["choices"])
    answer["choices"][1]["message"]["content"] = "Something else."
    bad = kinetic.verify_receipt(answer, model=setup["checker"])
    assert bad.status == "differs" and bad.message.startswith("choices[1]'s receipt: "), \
        bad.message
