"""A GGUF vocabulary as llama.cpp interprets it: token attributes, special token ids, end-of-generation
tokens and the per-model tokenizer flags, with llama.cpp's defaults and text-based fix-ups.

llama.cpp does not take the metadata literally: it supplies defaults per tokenizer model (BOS=1
for SentencePiece, 11 for BPE, ...), recognizes end-of-turn and fill-in-the-middle tokens by their
text, promotes such tokens to control tokens, and applies a few per-model workarounds. The token
ids a model sees depend on all of it, so it is reproduced here in one place.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kinetic.text.pretokenize import PRE_TOKENIZERS, PreTokenizer

# Token attributes (llama.cpp's llama_token_attr bits).
UNKNOWN = 1 << 0
UNUSED = 1 << 1
NORMAL = 1 << 2
CONTROL = 1 << 3
USER_DEFINED = 1 << 4
BYTE = 1 << 5
LSTRIP = 1 << 7
RSTRIP = 1 << 8

# tokenizer.ggml.token_type values -> attributes; anything else is "undefined" (0).
_TYPE_TO_ATTR = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

_KEY = "tokenizer.ggml."

# The arrays that only load_vocab reads: a GGUFFile may drop them once the Vocab is made
# (kinetic.llm.open_model). tokenizer.ggml.tokens stays: Vocab.tokens is that same list.
VOCAB_ONLY_KEYS = (_KEY + "merges", _KEY + "scores", _KEY + "token_type")

# Texts that mark end-of-turn and fill-in-the-middle tokens when the metadata does not name them.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
              "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# Texts that end generation whatever their metadata says.
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~["))

# Metadata key suffix -> special-token slot; the deprecated FIM keys fill the same slots.
_SPECIAL_KEYS = (
    ("bos_token_id", "bos"), ("eos_token_id", "eos"), ("eot_token_id", "eot"),
    ("eom_token_id", "eom"), ("unknown_token_id", "unk"), ("seperator_token_id", "sep"),
    ("padding_token_id", "pad"), ("mask_token_id", "mask"),
    ("fim_pre_token_id", "fim_pre"), ("fim_suf_token_id", "fim_suf"),
    ("fim_mid_token_id", "fim_mid"), ("fim_pad_token_id", "fim_pad"),
    ("fim_rep_token_id", "fim_rep"), ("fim_sep_token_id", "fim_sep"),
    ("prefix_token_id", "fim_pre"), ("suffix_token_id", "fim_suf"),
    ("middle_token_id", "fim_mid"),
)


@dataclass
class Vocab:
    """Everything the tokenizer needs from the metadata. `kind` is "spm", "bpe" or "wpm".
    Each part is held in the form the tokenizer uses, not as the metadata has it: BPE's
    merges as `ranks` (parse_merges), never the lines, and `scores` (float64) only for
    SentencePiece, which alone merges by them."""

    model: str
    kind: str
    pre: PreTokenizer | None
    tokens: list[str]
    scores: array
    attrs: list[int]
    token_to_id: dict[str, int]
    special: dict[str, int | None]
    eog: set[int] = field(default_factory=set)
    add_bos: bool = False
    add_eos: bool = False
    add_sep: bool = False        # a SEP between the two texts of a pair (rerank prompts)
    add_space_prefix: bool = False
    clean_spaces: bool = False
    escape_whitespaces: bool = True
    ranks: dict[tuple[str, str], int] = field(default_factory=dict)   # BPE's merges
    lowercase: bool = True
    strip_accents: bool = True
    special_ids_longest_first: list[int] = field(default_factory=list)


def load_vocab(md: dict[str, Any]) -> Vocab:
    """Returns the Vocab of a GGUF metadata dict; raises ValueError naming the problem."""
    model = md.get(_KEY + "model")
    if model is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.model")
    pre_name = md.get(_KEY + "pre") or ""
    tokens = md.get(_KEY + "tokens")
    if tokens is None:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")

    pre: PreTokenizer | None = None
    add_bos = add_eos = add_space_prefix = clean_spaces = False
    escape_whitespaces = True
    if model == "llama":
        kind = "spm"
        special: dict[str, int | None] = {"bos": 1, "eos": 2, "unk": 0}
        add_space_prefix = add_bos = True
    elif model == "bert":
        kind = "wpm"
        special = {"bos": 101, "unk": 100, "sep": 102, "pad": 0, "mask": 103}
        add_bos = clean_spaces = True
    elif model in ("gpt2", "gemma4"):
        kind = "bpe"
        special = {"bos": 11, "eos": 11} if model == "gpt2" else {}
        if model == "gemma4":
            pre_name = "gemma4"
        elif not pre_name:
            pre_name = "default"   # llama.cpp warns and degrades to its default splitting
        pre = PRE_TOKENIZERS.get(pre_name)
        if pre is None:
            raise ValueError(f"unknown pre-tokenizer type tokenizer.ggml.pre = {pre_name!r}")
        add_bos = pre.add_bos
        clean_spaces = pre.clean_spaces
        escape_whitespaces = pre.escape_whitespaces
        if pre_name in ("glm4", "chatglm-bpe"):
            special["bos"] = None
    else:
        raise ValueError(f"unknown tokenizer model tokenizer.ggml.model = {model!r}")
    if kind == "bpe" and not md.get(_KEY + "merges"):
        raise ValueError("BPE vocabulary without tokenizer.ggml.merges")
    add_space_prefix = bool(md.get(_KEY + "add_space_prefix", add_space_prefix))

    if not isinstance(tokens, list) or not all(tokens):
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    # else the metadata's list itself, which its GGUFFile keeps too: one list, not two
    n = len(tokens)
    token_to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if token_to_id.setdefault(t, i) != i:
            raise ValueError(f"duplicate token in vocabulary: {t!r} has ids {token_to_id[t]} and {i}")
    scores = array("d")
    if kind == "spm":
        raw_scores = md.get(_KEY + "scores")
        # float32 -> float64 is exact, so score comparisons are the same as llama.cpp's; an
        # array takes 8 bytes a score where a list of floats took 32 (8 MB at 262,144 tokens)
        scores.frombytes(np.asarray(raw_scores[:n], dtype=np.float64).tobytes()
                         if raw_scores is not None else bytes(8 * n))
    types = md.get(_KEY + "token_type")
    attrs = ([_TYPE_TO_ATTR.get(t, 0) for t in np.asarray(types[:n]).tolist()]
             if types is not None else [NORMAL] * n)

    for slot, default in list(special.items()):
        if default is not None and default >= n:
            special[slot] = None
    for suffix, slot in _SPECIAL_KEYS:
        value = md.get(_KEY + suffix)
        if value is not None and 0 <= int(value) < n:
            special[slot] = int(value)

    add_bos = bool(md.get(_KEY + "add_bos_token", add_bos))
    add_eos = bool(md.get(_KEY + "add_eos_token", add_eos))
    add_sep = bool(md.get(_KEY + "add_sep_token", kind == "wpm"))
    if pre is not None and pre.name == "gemma4":
        add_bos = True   # llama.cpp overrides Gemma 4's metadata here
    if add_bos and special.get("bos") is None:
        raise ValueError("tokenizer.ggml.add_bos_token is true, but there is no BOS token id")
    if add_eos and special.get("eos") is None:
        raise ValueError("tokenizer.ggml.add_eos_token is true, but there is no EOS token id")
    lowercase = bool(md.get(_KEY + "normalizer.lowercase", True))
    strip_accents = bool(md.get(_KEY + "normalizer.strip_accents", lowercase))

    vocab = Vocab(model=model, kind=kind, pre=pre, tokens=tokens, scores=scores, attrs=attrs,
                  token_to_id=token_to_id, special=special, add_bos=add_bos, add_eos=add_eos, add_sep=add_sep,
                  add_space_prefix=add_space_prefix, clean_spaces=clean_spaces,
                  escape_whitespaces=escape_whitespaces,
                  ranks=parse_merges(md.get(_KEY + "merges") or ()) if kind == "bpe" else {},
                  lowercase=lowercase, strip_accents=strip_accents)
    _detect_special_tokens(vocab)
    _apply_model_attrs(vocab, str(md.get("general.name", "")).lower(), pre_name,
                       str(md.get("general.architecture", "")))
    return vocab


def parse_merges(merges: Sequence[str]) -> dict[tuple[str, str], int]:
    """Returns {(left, right): rank} for merge lines "left right"; the first of duplicates wins.
    The split is at the first space after the first character, so a left part that is itself a
    space survives. Each distinct part is one string object, shared by every pair it is in
    (Llama 3's 280,147 merges: 65 MB of pairs, 38 MB shared)."""
    ranks: dict[tuple[str, str], int] = {}
    parts: dict[str, str] = {}
    for rank, line in enumerate(merges):
        pos = line.find(" ", 1)
        left, right = (line[:pos], line[pos + 1:]) if pos >= 0 else ("", "")
        ranks.setdefault((parts.setdefault(left, left), parts.setdefault(right, right)), rank)
    return ranks


def _mark_control(vocab: Vocab, tid: int) -> None:
    vocab.attrs[tid] |= CONTROL


def _detect_special_tokens(vocab: Vocab) -> None:
    """Fills end-of-turn / FIM slots from token texts, builds the end-of-generation set and the
    list of specially-matched tokens, with llama.cpp's fix-ups."""
    special, attrs, t2i = vocab.special, vocab.attrs, vocab.token_to_id
    for slot, texts in (("eot", _EOT_TEXTS), ("eom", _EOM_TEXTS), *_FIM_TEXTS.items()):
        if special.get(slot) is not None:
            continue
        found = [t2i[t] for t in texts if t in t2i]
        if found:
            # llama.cpp takes whichever its hash map yields first; the lowest id is our choice.
            special[slot] = min(found)
            _mark_control(vocab, special[slot])

    eog = vocab.eog
    for slot in ("fim_pad", "fim_rep", "fim_sep"):
        if special.get(slot) is not None:
            eog.add(special[slot])
    for text in _EOG_TEXTS:
        tid = t2i.get(text)
        if tid is not None:
            eog.add(tid)
            _mark_control(vocab, tid)
    # gpt-oss: these are always rendered, so they must not be control tokens.
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        if text in t2i:
            attrs[t2i[text]] = USER_DEFINED
    for slot in ("eos", "eot", "eom"):
        if special.get(slot) is not None:
            eog.add(special[slot])
    texts = {vocab.tokens[t]: t for t in eog}
    # o200k_harmony / solar-open: <|end|> ends a message, not the generation.
    if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                               or (("<|call|>" in texts or "<|calls|>" in texts)
                                   and "<|flush|>" in texts)):
        eog.discard(texts["<|end|>"])
        attrs[texts["<|end|>"]] = USER_DEFINED
    # Gemma 4 / PaddleOCR: </s> is an ordinary token there.
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = NORMAL

    matched = [i for i, a in enumerate(attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
    matched.sort(key=lambda i: -len(vocab.tokens[i].encode("utf-8")))
    vocab.special_ids_longest_first = matched


def _apply_model_attrs(vocab: Vocab, name: str, pre_name: str, arch: str) -> None:
    """Per-model whitespace stripping around special tokens (llama.cpp keys these on names)."""
    t2i, attrs = vocab.token_to_id, vocab.attrs
    if (any(s in pre_name for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))
            or any(s in arch for s in ("nomic-bert-moe", "jina-bert-v3"))):
        if "<mask>" in t2i:
            attrs[t2i["<mask>"]] |= LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for tid in vocab.special_ids_longest_first:
            attrs[tid] |= RSTRIP
        if "</s>" in t2i:
            attrs[t2i["</s>"]] |= RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in t2i:
                attrs[t2i[text]] &= ~RSTRIP
    elif "modern-bert" in name and "[MASK]" in t2i:
        attrs[t2i["[MASK]"]] |= LSTRIP
