"""Tokenizers built from GGUF metadata that give the same token ids and text as llama.cpp.

`Tokenizer.from_metadata(GGUFFile(path).metadata)` supports the tokenizer models `llama`
(SentencePiece), `gpt2` (byte-level BPE with the pre-tokenizer that `tokenizer.ggml.pre` names),
`gemma4` (SentencePiece-style BPE) and `bert` (WordPiece). Encoding first cuts special tokens out
of the text (user-defined ones always, control ones only with parse_special), then tokenizes the
remaining pieces with the model's algorithm; decoding follows llama.cpp's detokenizer, including
its leading-space and space-cleaning rules. For long texts, `encode_chunks` gives the same ids
in pieces a caller can stop between, and `min_tokens` a lower bound of their count from the
text's length alone (kinetic/text/chunks.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from kinetic.text import chunks
from kinetic.text import unicode_data as ud
from kinetic.text.bpe import BPE
from kinetic.text.pretokenize import Splitter
from kinetic.text.spm import SPM
from kinetic.text.vocab import (BYTE, CONTROL, LSTRIP, NORMAL, RSTRIP, UNKNOWN, USER_DEFINED,
                                Vocab, load_vocab)
from kinetic.text.wordpiece import WordPiece

_SPACE_MARK = "\u2581"   # SentencePiece's ▁, which stands for a space inside tokens
_C_SPACE = ud.ASCII_SPACE  # what C's isspace() strips around LSTRIP/RSTRIP tokens


class Tokenizer:
    """Text <-> token ids for one vocabulary. Build with `from_metadata`."""

    def __init__(self, vocab: Vocab):
        self._v = vocab
        self._tokens = vocab.tokens
        self._attrs = vocab.attrs
        self._ranks = vocab.ranks   # BPE's merges
        if vocab.kind == "spm":
            self._spm = SPM(vocab.token_to_id, vocab.scores)
        elif vocab.kind == "bpe":
            pre = vocab.pre
            self._splitter = Splitter(pre.regexes)
            self._bpe = BPE(vocab.token_to_id, self._ranks,
                            byte_encode=pre.byte_encode, ignore_merges=pre.ignore_merges,
                            newline_words_whole=pre.name == "gemma4")
        else:
            self._wpm = WordPiece(vocab.token_to_id, vocab.special.get("unk"),
                                  lowercase=vocab.lowercase, strip_accents=vocab.strip_accents)
        # each token's rendered bytes, filled as asked: [special][token id] (two lists of
        # pointers, where a dict keyed by (id, special) took 40 MB at 262,144 tokens once the
        # grammar's token trie had asked for every token)
        n = len(vocab.tokens)
        self._pieces: tuple[list[bytes | None], list[bytes | None]] = ([None] * n, [None] * n)
        self._junctions: frozenset[str] | None = None            # chunks.py, made on first use
        self._bounds: dict[bool, chunks.PieceBound | None] = {}  # per parse_special, likewise

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> "Tokenizer":
        """Returns the tokenizer described by GGUF metadata; raises ValueError naming the problem
        for an unknown tokenizer.ggml.model or tokenizer.ggml.pre, or inconsistent metadata."""
        return cls(load_vocab(metadata))

    # --- facts about the vocabulary ---

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._v.special.get("bos")

    @property
    def eos_id(self) -> int | None:
        return self._v.special.get("eos")

    @property
    def sep_id(self) -> int | None:
        return self._v.special.get("sep")

    @property
    def add_sep(self) -> bool:
        """Whether a pair of texts (a rerank prompt) takes SEP between them."""
        return self._v.add_sep

    @property
    def eog_ids(self) -> frozenset[int]:
        """Tokens that end generation (EOS, EOT, EOM, FIM pad/repo/sep, and tokens recognized by
        their text such as <|im_end|>, <|endoftext|>, <end_of_turn>, <|eot_id|>)."""
        return frozenset(self._v.eog)

    @property
    def add_bos(self) -> bool:
        return self._v.add_bos

    @property
    def add_eos(self) -> bool:
        return self._v.add_eos

    def is_special(self, token_id: int) -> bool:
        """True for control, user-defined and unknown tokens: those matched as a whole in text
        rather than produced by the tokenizer algorithm."""
        return bool(self._attrs[self._check(token_id)] & (CONTROL | USER_DEFINED | UNKNOWN))

    # --- encoding ---

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Returns the token ids of `text` as llama_tokenize does. `add_special` adds BOS/EOS as
        the vocabulary asks (for BERT: [CLS] ... [SEP]); `parse_special` lets control tokens
        written in the text become those tokens (user-defined tokens always do)."""
        out: list[int] = []
        for ids in self._encode_parts(text, add_special, parse_special, None):
            out.extend(ids)
        return out

    def encode_chunks(self, text: str, add_special: bool = True, parse_special: bool = False,
                      size: int = chunks.CHUNK_CHARS,
                      check: Callable[[], None] | None = None) -> Iterator[list[int]]:
        """encode()'s token ids in pieces, each from about `size` characters of the text (more
        where no cut is safe: kinetic/text/chunks.py). Their concatenation is exactly what
        encode() returns, so a caller can count them as they come and stop early. `check()`
        is also called inside the merging of a piece that stays long (it may raise to stop)."""
        return self._encode_parts(text, add_special, parse_special, size, check)

    def min_tokens(self, text: str, parse_special: bool = False) -> int:
        """At least how many tokens encode(text, add_special=False, parse_special) returns,
        from the text's UTF-8 length alone (kinetic/text/chunks.py); 0 where the vocabulary
        gives no bound (WordPiece, tokens that strip the spaces around them)."""
        if parse_special not in self._bounds:
            self._bounds[parse_special] = chunks.piece_bound(
                self._v, self._ranks, parse_special)
        bound = self._bounds[parse_special]
        return 0 if bound is None else bound.min_tokens(text)

    def _encode_parts(self, text: str, add_special: bool, parse_special: bool,
                      size: int | None,
                      check: Callable[[], None] | None = None) -> Iterator[list[int]]:
        """encode()'s ids in pieces: one per fragment between special tokens, or with `size`
        pieces of about that many characters, cut where chunks.py proves the ids the same."""
        v = self._v
        fragments = self._partition(text, parse_special)
        if v.kind == "wpm":
            if add_special and v.special.get("bos") is not None:
                yield [v.special["bos"]]
            for frag in fragments:
                if isinstance(frag, int):
                    yield [frag]
                    continue
                for piece in [frag] if size is None else chunks.cut_before_spaces(frag, size):
                    yield self._wpm.encode(piece)
            if add_special and v.special.get("sep") is not None:
                yield [v.special["sep"]]
            return
        if add_special and v.add_bos:
            yield [v.special["bos"]]
        if v.kind == "spm":
            # A space is prefixed to the text at the start and after every special token.
            prev_special = True
            for frag in fragments:
                if isinstance(frag, int):
                    yield [frag]
                    prev_special = True
                    continue
                if v.add_space_prefix and prev_special:
                    frag = " " + frag
                frag = frag.replace(" ", _SPACE_MARK)
                for piece in self._cut(frag, size):
                    yield self._spm.encode(piece, check)
                prev_special = False
        else:
            for frag in fragments:
                if isinstance(frag, int):
                    yield [frag]
                    continue
                if v.escape_whitespaces:
                    frag = frag.replace(" ", _SPACE_MARK)
                out: list[int] = []
                chars = 0
                for word in self._splitter.split(frag):
                    if size is not None and len(word) > size:
                        if out:
                            yield out
                        out, chars = [], 0
                        yield from self._long_word(word, size, check)
                        continue
                    out.extend(self._bpe.encode_word(word))
                    chars += len(word)
                    if size is not None and chars >= size:
                        yield out
                        out, chars = [], 0
                if out:
                    yield out
        if add_special and v.add_eos:
            yield [v.special["eos"]]

    def _cut(self, text: str, size: int | None) -> Iterator[str]:
        if size is None or len(text) <= size:
            return iter((text,))
        if self._junctions is None:
            self._junctions = (chunks.spm_junctions(self._v.token_to_id) if self._v.kind == "spm"
                               else chunks.bpe_junctions(self._ranks))
        return chunks.cut(text, size, self._junctions)

    def _long_word(self, word: str, size: int,
                   check: Callable[[], None] | None) -> Iterator[list[int]]:
        """One BPE word of more than `size` characters, in pieces: the same ids as
        encode_word(word) (chunks.py)."""
        bpe, t2i = self._bpe, self._v.token_to_id
        text = word
        if self._v.pre.byte_encode:   # a block at a time: no long call holds the lock
            data, block = word.encode("utf-8"), chunks.CHUNK_CHARS * 16
            text = "".join(ud.bytes_to_gpt2_chars(data[i:i + block])
                           for i in range(0, len(data), block))
        if text in t2i:   # a token as a whole, where the whole-word rules may apply
            yield list(bpe.encode_word(word))
            return
        for piece in self._cut(text, size):
            yield bpe.merged_ids(piece, check)

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Returns the text cut into raw pieces (str) and special tokens (int), processing the
        special tokens longest first, each one splitting every raw piece at all its occurrences."""
        fragments: list[str | int] = [text] if text else []
        for tid in self._v.special_ids_longest_first:
            attr = self._attrs[tid]
            if not parse_special and attr & (CONTROL | UNKNOWN):
                continue
            tok = self._tokens[tid]
            if tok not in text:   # every raw piece is a substring of text
                continue
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok not in frag:
                    split.append(frag)
                    continue
                pos = 0
                while (hit := frag.find(tok, pos)) >= 0:
                    left = frag[pos:hit]
                    if attr & LSTRIP:
                        left = left.rstrip(_C_SPACE)
                    if left:
                        split.append(left)
                    split.append(tid)
                    pos = hit + len(tok)
                    if attr & RSTRIP:
                        while pos < len(frag) and frag[pos] in _C_SPACE:
                            pos += 1
                if pos < len(frag):
                    split.append(frag[pos:])
            fragments = split
        return fragments

    # --- decoding ---

    def token_bytes(self, token_id: int, special: bool = False) -> bytes:
        """Returns the bytes the token adds to generated text: byte tokens their byte, ▁ as a
        space, byte-level BPE characters mapped back to bytes, control tokens nothing (their
        text with `special`), user-defined tokens their text."""
        return self._piece(self._check(token_id), special)

    def token_piece(self, token_id: int, special: bool = False) -> str:
        """Returns the token's text as llama-server shows it as a log-probability's "token":
        token_to_piece with control tokens empty (rendered with `special=True`), and an
        incomplete UTF-8 sequence at the end cut off (other invalid bytes become U+FFFD)."""
        data = self._piece(self._check(token_id), special)
        return data[:_complete_utf8_prefix(data)].decode("utf-8", errors="replace")

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """Returns the text of token ids as llama_detokenize does (remove_special=skip_special,
        unparse_special=not skip_special): with skip_special a leading BOS (and trailing EOS when
        the vocabulary adds one) is dropped and control tokens render as nothing. SentencePiece
        vocabularies with add_space_prefix drop the leading space of the first piece unless the
        ids start with BOS; vocabularies with clean_spaces undo " ." style spacing."""
        v = self._v
        ids = [self._check(t) for t in ids]
        remove_space = v.add_space_prefix
        if skip_special and v.add_bos and ids and ids[0] == v.special.get("bos"):
            remove_space = False
            ids = ids[1:]
        if skip_special and v.add_eos and ids and ids[-1] == v.special.get("eos"):
            ids = ids[:-1]
        parts = []
        for tid in ids:
            piece = self._piece(tid, not skip_special)
            if remove_space and piece.startswith(b" "):
                piece = piece[1:]
            remove_space = False
            parts.append(piece)
        data = b"".join(parts)
        if v.clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")

    def decode_pieces(self, ids: list[int]) -> str:
        """Returns the concatenated rendered pieces (special tokens included, no space rules):
        what llama-server's POST /detokenize answers."""
        data = b"".join(self._piece(self._check(t), True) for t in ids)
        return data.decode("utf-8", errors="replace")

    def _check(self, token_id: int) -> int:
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{len(self._tokens) - 1})")
        return token_id

    def _piece(self, tid: int, special: bool) -> bytes:
        cache = self._pieces[1 if special else 0]
        piece = cache[tid]
        if piece is None:
            piece = cache[tid] = self._render(tid, special)
        return piece

    def _render(self, tid: int, special: bool) -> bytes:
        attr = self._attrs[tid]
        text = self._tokens[tid]
        if attr & (UNKNOWN | CONTROL):
            return text.encode("utf-8") if special else b""
        if attr & USER_DEFINED:
            return text.encode("utf-8")
        if attr & NORMAL:
            if self._v.kind != "bpe" or self._v.escape_whitespaces:
                return text.replace(_SPACE_MARK, " ").encode("utf-8")
            return _gpt2_decode(text)
        if attr & BYTE:
            return bytes([int(text[3:5], 16)])
        return b""   # unused / undefined tokens render as nothing


def _gpt2_decode(text: str) -> bytes:
    # Each character of a byte-level token stands for one byte; a character outside the mapping
    # is shown the way llama.cpp shows it.
    out = bytearray()
    for ch in text:
        b = ud.CHAR_TO_BYTE.get(ch)
        if b is not None:
            out.append(b)
        else:
            out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
    return bytes(out)


def _complete_utf8_prefix(data: bytes) -> int:
    """Returns the length of `data` without a multi-byte UTF-8 sequence cut off at its end (the
    check llama-server makes before showing a token's text)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        c = data[n - back]
        needed = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
        if needed and back < needed:
            return n - back
    return n


def _clean_spaces(data: bytes) -> bytes:
    """Undoes tokenizer spacing the way llama.cpp's detokenizer does, in three passes over the
    bytes: drop a space before ? ! . , ; turn " ' " into "'"; drop a space before 's 'm 're 've."""
    # Pass 1.
    out = bytearray(data[:1])
    for i in range(1, len(data)):
        if data[i - 1] == 0x20 and data[i] in b"?!.,":
            out.pop()
        out.append(data[i])
    # Pass 2: the space after the apostrophe is skipped, and the check for the next character
    # then sees the skipped position as "not a space".
    src = bytes(out)
    out = bytearray(src[:1])
    i = 1
    skipped = -1
    while i < len(src):
        x = src[i]
        prev_is_space = src[i - 1] == 0x20 and skipped != i - 1
        if x == 0x27 and i + 1 < len(src) and prev_is_space and src[i + 1] == 0x20:
            out.pop()
            skipped = i + 1
            out.append(x)
            i += 2
            continue
        out.append(x)
        i += 1
    # Pass 3.
    src = bytes(out)
    out = bytearray(src[:1])
    n = len(src)
    for i in range(1, n):
        x = src[i]
        if src[i - 1] == 0x20 and x == 0x27 and i + 1 < n:
            x1 = src[i + 1]
            if x1 in b"sm":
                out.pop()
            elif x1 not in b"td" and i + 2 < n and (x1, src[i + 2]) in ((0x72, 0x65), (0x76, 0x65)):
                out.pop()
        out.append(x)
    return bytes(out)
