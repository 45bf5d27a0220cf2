"""WordPiece tokenization (`tokenizer.ggml.model` = bert) for BERT-style embedding models.

The GGUF vocabulary spells word-initial pieces with a leading ▁ and continuation pieces bare (the
converter rewrites BERT's "##" that way). Text is normalized the way llama.cpp's BertNormalizer
emulation does it (accents stripped by keeping only the first code point of each character's NFD
form, lowercased, control characters dropped), split at whitespace and around punctuation and CJK
ideographs, and each word is then matched greedily longest-piece-first; a word with any unmatched
position becomes the unknown token as a whole.
"""

from __future__ import annotations

from functools import lru_cache

from kinetic.text import unicode_data as ud

_PHANTOM_SPACE = "\u2581"


def _is_cjk(cp: int) -> bool:
    # The CJK ideograph blocks BERT's tokenizer isolates (its table, including its 0x2B920 start).
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B920 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


@lru_cache(maxsize=1 << 16)
def _normalize_char(cp: int, lowercase: bool, strip_accents: bool) -> tuple[str, str]:
    """Returns (kind, text) for one input code point: kind "space" (word break), "drop",
    "alone" (a word by itself) or "join" (appended to the current word)."""
    if strip_accents:
        cp = ud.nfd_first(cp)
    if ud.is_whitespace(cp):
        return "space", ""
    cat = ud.major_category(cp)
    if cp == 0 or cp == 0xFFFD or cat == "C":
        return "drop", ""
    if strip_accents and cat == "M":
        return "drop", ""
    text = chr(ud.simple_lower(cp) if lowercase else cp)
    if cat == "P" or (cp < 0x7F and cat == "S") or _is_cjk(cp):
        return "alone", text
    return "join", text


def split_words(text: str, lowercase: bool = True, strip_accents: bool = True) -> list[str]:
    """Returns the normalized words of `text`, in order."""
    words: list[str] = []
    current: list[str] = []
    for ch in text:
        kind, piece = _normalize_char(ord(ch), lowercase, strip_accents)
        if kind == "join":
            current.append(piece)
            continue
        if kind == "drop":
            continue
        if current:
            words.append("".join(current))
            current = []
        if kind == "alone":
            words.append(piece)
    if current:
        words.append("".join(current))
    return words


class WordPiece:
    """Greedy longest-match-first WordPiece over a ▁-marked vocabulary."""

    def __init__(self, token_to_id: dict[str, int], unk_id: int | None, *,
                 lowercase: bool = True, strip_accents: bool = True):
        self._token_to_id = token_to_id
        self._unk_id = unk_id
        self._lowercase = lowercase
        self._strip_accents = strip_accents
        self._max_len = max((len(t) for t in token_to_id), default=1)

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of `text` (no [CLS]/[SEP])."""
        out: list[int] = []
        for word in split_words(text, self._lowercase, self._strip_accents):
            ids = self._match(_PHANTOM_SPACE + word)
            if ids:
                out.extend(ids)
            elif self._unk_id is not None:
                out.append(self._unk_id)
        return out

    def _match(self, word: str) -> list[int]:
        ids: list[int] = []
        n = len(word)
        i = 0
        while i < n:
            for j in range(min(n, i + self._max_len), i, -1):
                tid = self._token_to_id.get(word[i:j])
                if tid is not None:
                    ids.append(tid)
                    i = j
                    break
            else:
                return []   # one unmatched position discards the whole word
        return ids
