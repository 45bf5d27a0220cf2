"""Unicode character properties exactly as llama.cpp's tokenizers see them.

llama.cpp does not use a regex engine's own notion of "letter" or "whitespace": it classifies every
code point once from UnicodeData.txt (general category, simple lowercase, first code point of the
NFD decomposition) plus a fixed White_Space list, and its pre-tokenizer regexes run on a "collapsed"
copy of the text where each non-ASCII code point is replaced by one byte standing for its class.
This module reproduces those classifications with Python's `unicodedata`, so that the splitting in
`pretokenize` and the BERT normalizer in `wordpiece` agree with llama.cpp character for character.
"""

from __future__ import annotations

import unicodedata

# The White_Space property (PropList.txt). Python's str.isspace() differs (it includes U+001C..U+001F),
# so the set is spelled out.
WHITESPACE: frozenset[int] = frozenset(
    [*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B),
     0x2028, 0x2029, 0x202F, 0x205F, 0x3000])

# The whitespace that C's isspace() and std::regex's \s know about in the "C" locale; the collapsed
# text maps every other whitespace code point onto \x0b so that \s still matches it.
ASCII_SPACE = "\t\n\x0b\x0c\r "

# Placeholder bytes of the collapsed text, one per class (the values llama.cpp uses; any unused
# non-ASCII values would do, but keeping them makes debugging against llama.cpp easier).
COLLAPSED_NUMBER = "\xd1"
COLLAPSED_LETTER = "\xd2"
COLLAPSED_PUNCTUATION = "\xd3"
COLLAPSED_MARK = "\xd4"
COLLAPSED_SYMBOL = "\xd5"
COLLAPSED_OTHER = "\xd0"

_COLLAPSED_BY_MAJOR = {
    "N": COLLAPSED_NUMBER, "L": COLLAPSED_LETTER, "P": COLLAPSED_PUNCTUATION,
    "M": COLLAPSED_MARK, "S": COLLAPSED_SYMBOL,
}


def major_category(cp: int) -> str:
    """Returns the first letter of the code point's general category ("L", "N", "P", "S", "M",
    "Z", "C"), or "" for an unassigned code point (category Cn, llama.cpp's UNDEFINED)."""
    cat = unicodedata.category(chr(cp))
    return "" if cat == "Cn" else cat[0]


def is_whitespace(cp: int) -> bool:
    return cp in WHITESPACE


class _CollapseTable(dict):
    """A str.translate() table filled on demand: ASCII stays, other whitespace becomes \\x0b, every
    other code point becomes the placeholder of its class."""

    def __missing__(self, cp: int) -> str:
        if cp < 128:
            out = chr(cp)
        elif cp in WHITESPACE:
            out = "\x0b"
        else:
            out = _COLLAPSED_BY_MAJOR.get(major_category(cp), COLLAPSED_OTHER)
        self[cp] = out
        return out


class _WideTable(dict):
    """Translate table for regexes without \\p{..} classes: only non-ASCII whitespace changes (to
    \\x0b), because std::wregex's \\s only knows the ASCII whitespace."""

    def __missing__(self, cp: int) -> str:
        out = "\x0b" if cp >= 128 and cp in WHITESPACE else chr(cp)
        self[cp] = out
        return out


_COLLAPSE = _CollapseTable()
_WIDE = _WideTable()


def collapse(text: str) -> str:
    """Returns the text with one character per code point standing for its class (see module doc)."""
    return text.translate(_COLLAPSE)


def widen(text: str) -> str:
    """Returns the text with non-ASCII whitespace replaced by \\x0b, lengths unchanged."""
    return text.translate(_WIDE)


def simple_lower(cp: int) -> int:
    """Returns the simple (one code point) lowercase mapping of cp, cp itself when there is none."""
    low = chr(cp).lower()
    return ord(low[0]) if low else cp


def nfd_first(cp: int) -> int:
    """Returns the first code point of cp's NFD decomposition: llama.cpp's "NFD" keeps only that,
    which strips the accents of precomposed letters (é -> e) and reduces Hangul syllables to
    their first jamo."""
    return ord(unicodedata.normalize("NFD", chr(cp))[0])


def _byte_to_char_table() -> list[str]:
    # GPT-2's reversible byte <-> printable character mapping: printable Latin-1 bytes stand for
    # themselves, the others are moved to U+0100 onwards in byte order.
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = [""] * 256
    for b in keep:
        table[b] = chr(b)
    extra = 0
    for b in range(256):
        if not table[b]:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR: list[str] = _byte_to_char_table()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in enumerate(BYTE_TO_CHAR)}


def bytes_to_gpt2_chars(data: bytes) -> str:
    """Returns the byte-level BPE spelling of raw bytes (one character per byte)."""
    return "".join([BYTE_TO_CHAR[b] for b in data])
