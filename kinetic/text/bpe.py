"""Byte-pair-encoding merges (`tokenizer.ggml.model` = gpt2, and Gemma 4's SentencePiece-style BPE).

A word (one pre-tokenizer piece) starts as its characters; the adjacent pair whose merge has the
lowest rank (earliest in `tokenizer.ggml.merges`) is merged, the leftmost one on ties, until no
adjacent pair has a merge. Final symbols that are not in the vocabulary fall back to byte tokens.
Results are cached per word, since real text repeats its words. The ranks come from
kinetic/text/vocab.py's parse_merges.
"""

from __future__ import annotations

from collections.abc import Callable

from kinetic.text import unicode_data as ud
from kinetic.text.chunks import bpe_merge

_CACHE_LIMIT = 1 << 16


class BPE:
    """Encodes pre-tokenized words to token ids.

    `byte_encode`: the vocabulary spells bytes GPT-2 style (each UTF-8 byte as one printable
    character), so words are converted before merging; otherwise words merge as raw text and
    byte fallback uses <0xXX> tokens (Gemma 4). `ignore_merges`: a word that is a token as a whole
    is that token (Llama 3). `newline_words_whole`: a word of only newlines that is a token is
    that token (Gemma 4)."""

    def __init__(self, token_to_id: dict[str, int], ranks: dict[tuple[str, str], int], *,
                 byte_encode: bool, ignore_merges: bool = False,
                 newline_words_whole: bool = False):
        self._token_to_id = token_to_id
        self._ranks = ranks
        self._byte_encode = byte_encode
        self._ignore_merges = ignore_merges
        self._newline_words_whole = newline_words_whole
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode_word(self, word: str) -> tuple[int, ...]:
        """Returns the token ids of one pre-tokenizer word (raw text, not yet byte-encoded)."""
        hit = self._cache.get(word)
        if hit is not None:
            return hit
        ids = tuple(self._encode(word))
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[word] = ids
        return ids

    def _encode(self, word: str) -> list[int]:
        text = ud.bytes_to_gpt2_chars(word.encode("utf-8")) if self._byte_encode else word
        if not text:
            return []
        whole = self._token_to_id.get(text)
        if whole is not None and (self._ignore_merges or (
                self._newline_words_whole and text.strip("\n") == "")):
            return [whole]
        return self.merged_ids(text)

    def merged_ids(self, text: str, check: Callable[[], None] | None = None) -> list[int]:
        """The ids of `text` (already byte-encoded) merged whole, with no whole-word rule: a
        word's, or a piece of a long word that the tokenizer cut where no merge can join
        (kinetic/text/chunks.py). `check` as bpe_merge's."""
        out: list[int] = []
        for symbol in merge(list(text), self._ranks, check):
            tid = self._token_to_id.get(symbol)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._fallback(symbol))
        return out

    def _fallback(self, symbol: str) -> list[int]:
        out = []
        if self._byte_encode:
            # llama.cpp looks up each UTF-8 byte of the byte-encoded symbol as a one-byte token;
            # only ASCII bytes can be tokens, the others are dropped.
            for ch in symbol:
                if ord(ch) < 128 and ch in self._token_to_id:
                    out.append(self._token_to_id[ch])
        else:
            for b in symbol.encode("utf-8"):
                tid = self._token_to_id.get(f"<0x{b:02X}>")
                if tid is not None:
                    out.append(tid)
        return out


def merge(symbols: list[str], ranks: dict[tuple[str, str], int],
          check: Callable[[], None] | None = None) -> list[str]:
    """Applies BPE merges to a list of symbols; returns the merged symbols in order. A long
    list merges in bpe_merge, which calls `check()` every few thousand merges."""
    n = len(symbols)
    if n < 2:
        return symbols
    if n <= 24:
        # Short words (nearly all of them): rescanning the pairs is cheaper than a heap.
        while len(symbols) > 1:
            best = None
            best_i = -1
            for i in range(len(symbols) - 1):
                r = ranks.get((symbols[i], symbols[i + 1]))
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best_i < 0:
                break
            symbols[best_i:best_i + 2] = [symbols[best_i] + symbols[best_i + 1]]
        return symbols
    return bpe_merge(symbols, ranks, check)   # the heap loop, for long words: chunks.py
