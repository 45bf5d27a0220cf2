"""kinetic.text.tokenizer against llama.cpp: its vocab test vectors, llama-server's answers on the
real models, and the decoding, special-token and per-model rules behind them."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from kinetic.model.gguf_file import GGUFFile
from kinetic.text.bpe import merge
from kinetic.text.tokenizer import Tokenizer
from kinetic.text.vocab import parse_merges
from tests.conftest import real_model_file
from tests.tiny_models import vocab_file

DATA = Path(__file__).parent / "data"
VOCAB_DIR = DATA / "vocab"
REFERENCE_DIR = DATA / "reference"


REAL_MODELS = ["gemma3", "qwen25coder", "smollm2"]  # kinetic.fetch keys
VOCABS = ["bert-bge", "deepseek-llm", "gemma-4", "gpt-2", "llama-bpe", "llama-spm", "phi-3",
          "qwen2", "qwen35"]


@functools.cache
def vocab(name: str) -> Tokenizer:
    return Tokenizer.from_metadata(GGUFFile(vocab_file(name)).metadata)


def vectors(name: str) -> list[tuple[str, list[int]]]:
    """The (text, expected ids) pairs of one vocab's .inp/.out files."""
    base = VOCAB_DIR / f"ggml-vocab-{name}.gguf"   # the vectors beside the packed file
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split(
        "\n__ggml_vocab_test__\n")
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    if texts[-1] == "":   # the file ends with a separator
        texts.pop()
    assert lines[-1] == "" and len(lines) - 1 == len(texts), f"{name}: .inp and .out disagree"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@functools.cache
def _real(key: str) -> tuple[Tokenizer, dict]:
    path = real_model_file(key)
    reference = json.loads((REFERENCE_DIR / f"{key}.json").read_text(encoding="utf-8"))
    return Tokenizer.from_metadata(GGUFFile(path).metadata), reference


@pytest.fixture(params=REAL_MODELS)
def real(request) -> tuple[Tokenizer, dict]:
    """(tokenizer, llama-server reference) of a real model; skips, saying why, when it cannot
    be fetched."""
    return _real(request.param)


# --- llama.cpp's vocab test vectors ---

@pytest.mark.parametrize("name", VOCABS)
def test_vocab_vectors(name):
    tok = vocab(name)
    wrong = [(text, want, got) for text, want in vectors(name)
             if (got := tok.encode(text, add_special=False, parse_special=False)) != want]
    assert not wrong, f"{len(wrong)} texts differ, first: {wrong[0]!r}"


@pytest.mark.parametrize("name", VOCABS)
def test_vectors_were_made_without_special_tokens(name):
    # The .out ids hold none of the tokens add_special adds (BOS, EOS, BERT's [CLS]/[SEP]),
    # and parse_special changes nothing: no text spells a control token.
    tok = vocab(name)
    added = {tok.bos_id, tok.eos_id, *tok.encode("", add_special=True)} - {None}
    for text, want in vectors(name):
        assert not added & set(want), text
        if tok.add_bos and want:
            assert tok.encode(text, add_special=True)[0] == tok.bos_id != want[0]
        assert tok.encode(text, add_special=False, parse_special=True) == want


def test_vector_counts():
    assert {n: len(vectors(n)) for n in VOCABS} == {
        **{n: 46 for n in VOCABS}, "qwen35": 50}


# --- llama-server's answers on the real models ---

@pytest.mark.real_model
def test_real_tokenize(real):
    tok, ref = real
    for case in ref["tokenize"]:
        assert tok.encode(case["text"], add_special=False, parse_special=False) == case["ids"]
        assert (tok.encode(case["text"], add_special=True, parse_special=True)
                == case["ids_add_special_parse_special"])


@pytest.mark.real_model
def test_real_prompt_ids(real):
    tok, ref = real
    for cont in ref["continuations"]:
        assert tok.encode(cont["prompt"], add_special=True, parse_special=True) == cont["prompt_ids"]


@pytest.mark.real_model
def test_real_step_tokens_and_content(real):
    tok, ref = real
    for cont in ref["continuations"]:
        for step in cont["steps"]:
            for entry in [step, *step["top_logprobs"]]:
                assert tok.token_piece(entry["id"]) == entry["token"], entry
        assert tok.decode([s["id"] for s in cont["steps"]]) == cont["content"]


@pytest.mark.real_model
def test_real_special_tokens(real):
    tok, ref = real
    eog_text = {tok.token_piece(i, special=True) for i in tok.eog_ids}
    if "qwen" in ref["model"]:
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (151643, 151645, False)
        # FIM pad / repo / file-sep tokens end generation too, as in llama.cpp.
        assert {"<|im_end|>", "<|endoftext|>", "<|fim_pad|>", "<|repo_name|>",
                "<|file_sep|>"} <= eog_text
    elif "gemma" in ref["model"]:
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (2, 1, True)
        assert {"<eos>", "<end_of_turn>"} <= eog_text
    else:
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
        assert {"<|endoftext|>", "<|im_end|>"} <= eog_text


# --- decoding ---

@pytest.mark.parametrize("name", [n for n in VOCABS if n != "bert-bge"])
def test_round_trip(name):
    tok = vocab(name)
    cleans_spaces = name in ("gpt-2", "llama-bpe", "gemma-4")
    for text, _ in vectors(name):
        # Vocabularies with clean_spaces turn " ?" into "?" (two texts have one).
        want = text.replace(" ?", "?") if cleans_spaces else text
        assert tok.decode(tok.encode(text, add_special=False)) == want
        # SentencePiece keeps the prefixed space when a BOS was dropped (llama_detokenize).
        assert tok.decode(tok.encode(text, add_special=True)) == (
            " " + want if want and name in ("llama-spm", "phi-3") else want)


def test_spm_leading_space_rule():
    tok = vocab("llama-spm")
    ids = tok.encode("Hello world")
    assert ids == [1, 15043, 3186]   # BOS, ▁Hello, ▁world
    # llama_detokenize drops the prefixed space only when the ids do not start with BOS.
    assert tok.decode(ids) == " Hello world"
    assert tok.decode(ids[1:]) == "Hello world"
    assert tok.decode(ids, skip_special=False) == "<s> Hello world"
    assert tok.decode_pieces(ids) == "<s> Hello world"


def test_bert_normalizes_and_wraps():
    tok = vocab("bert-bge")
    ids = tok.encode("Hello world")
    assert ids[0] == 101 and ids[-1] == 102   # [CLS] ... [SEP]
    assert tok.decode(ids) == " hello world"
    assert tok.decode(tok.encode("Cửa Việt", add_special=False)) == " cua viet"
    assert tok.decode(ids, skip_special=False) == "[CLS] hello world[SEP]"


def test_clean_spaces_rules():
    tok = vocab("gpt-2")
    text = "Hello , world . I ' m here ! It 's ok ? They 've gone"
    assert tok.decode(tok.encode(text)) == "Hello, world. I'm here! It's ok? They've gone"
    assert tok.decode_pieces(tok.encode(text)) == text   # llama-server's /detokenize
    assert vocab("qwen2").decode(vocab("qwen2").encode(text)) == text   # qwen2: no cleaning


def test_token_bytes_and_pieces():
    spm = vocab("llama-spm")
    assert spm.token_bytes(13) == b"\n"                  # <0x0A>
    assert spm.token_bytes(15043) == b" Hello"           # ▁Hello
    assert spm.token_bytes(1) == b"" and spm.token_piece(1, special=True) == "<s>"
    gpt2 = vocab("gpt-2")
    assert gpt2.token_bytes(18435) == b" Hello"          # ĠHello
    qwen = vocab("qwen2")
    assert qwen.token_piece(151644) == "" and qwen.token_piece(151644, special=True) == "<|im_start|>"
    # A token holding part of a UTF-8 sequence: its bytes are exact, its shown text cut.
    partial = qwen.encode("🫠", add_special=False)
    assert [qwen.token_bytes(i) for i in partial] == [b"\xf0\x9f", b"\xab", b"\xa0"]
    # llama-server cuts an unfinished sequence at the end; a lone continuation byte shows as U+FFFD.
    assert [qwen.token_piece(i) for i in partial] == ["", "\ufffd", "\ufffd"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        qwen.token_bytes(qwen.vocab_size)


# --- special tokens ---

def test_parse_special():
    tok = vocab("qwen2")
    assert tok.encode("<|im_start|>user\nHi<|im_end|>", parse_special=True) == [
        151644, 872, 198, 13048, 151645]
    plain = tok.encode("<|im_start|>user", parse_special=False)
    assert 151644 not in plain and tok.decode(plain) == "<|im_start|>user"
    # User-defined tokens are matched even without parse_special.
    assert tok.encode("a[PAD151646]b") == [64, 151646, 65]
    assert tok.is_special(151646) and tok.is_special(151644) and not tok.is_special(64)


def test_spm_space_prefix_after_special_tokens():
    tok = vocab("llama-spm")
    hi = tok.encode("Hi", add_special=False)
    assert tok.encode("<s>Hi</s>", add_special=False, parse_special=True) == [1, *hi, 2]
    assert 1 not in tok.encode("<s>Hi</s>", add_special=False)


def test_phi3_special_tokens_eat_following_whitespace():
    tok = vocab("phi-3")
    assert tok.encode("<|end|>\n Hi", add_special=False, parse_special=True) == [
        32007, *tok.encode("Hi", add_special=False)]


def test_user_defined_tokens_split_text():
    tok = vocab("deepseek-llm")   # its vocab has user-defined single characters such as "ö"
    ids = tok.encode("Äpfel ö", add_special=False)
    assert ids[-1] == 100003 and tok.token_bytes(100003) == "ö".encode()


@pytest.mark.parametrize("name, add_bos, bos, eog", [
    ("llama-spm", True, 1, {"</s>"}),
    ("phi-3", True, 1, {"</s>", "<|endoftext|>", "<|end|>"}),
    ("llama-bpe", True, 128000, {"<|end_of_text|>", "<|eot_id|>"}),   # llama3 adds BOS by default
    ("gpt-2", False, 50256, {"<|endoftext|>"}),
    ("qwen2", False, 151643, {"<|endoftext|>", "<|im_end|>", "</s>"}),
    ("gemma-4", True, 2, {"<eos>", "<turn|>", "<|tool_response>"}),   # add_bos forced for Gemma 4
    ("bert-bge", True, 101, {"[PAD]"}),
])
def test_special_ids_and_defaults(name, add_bos, bos, eog):
    tok = vocab(name)
    assert (tok.add_bos, tok.bos_id, tok.add_eos) == (add_bos, bos, False)
    assert {tok.token_piece(i, special=True) for i in tok.eog_ids} == eog


def test_unknown_model_or_pre_tokenizer():
    base = {"tokenizer.ggml.tokens": ["a", "b", "ab"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ValueError, match="rwkv"):
        Tokenizer.from_metadata({**base, "tokenizer.ggml.model": "rwkv"})
    with pytest.raises(ValueError, match="no-such-pre"):
        Tokenizer.from_metadata({**base, "tokenizer.ggml.model": "gpt2",
                                 "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata(base)


# --- algorithms ---

def _merge_by_rescanning(symbols, ranks):
    while True:
        pairs = [(ranks[p], i) for i, p in enumerate(zip(symbols, symbols[1:])) if p in ranks]
        if not pairs:
            return symbols
        _, i = min(pairs)
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]


def test_heap_merge_matches_rescanning_on_long_words():
    ranks = parse_merges(["a a", "aa aa", "b c", "a b", "aaaa a", "bc a"])
    for word in ["a" * 37, "ab" * 20, "abca" * 11, "bcaaaab" * 6]:
        assert merge(list(word), ranks) == _merge_by_rescanning(list(word), ranks), word


def test_long_whitespace_run_tokenizes_like_short_ones():
    tok = vocab("qwen2")
    text = " " * 300 + "x"
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
