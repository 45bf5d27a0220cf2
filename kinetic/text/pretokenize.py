"""Pre-tokenizers of byte-level BPE vocabularies: how `tokenizer.ggml.pre` splits text into words.

Each pre-tokenizer is a list of regexes applied in turn, each one splitting every piece that the
previous ones produced; text between matches becomes a piece of its own. The regexes are written
in the syntax of the models' tokenizer.json (`\\p{L}`, `\\s`, ...) and run the way llama.cpp runs
them: with ECMAScript semantics on a copy of the text where each non-ASCII code point is collapsed
to one placeholder character for its Unicode class (see `unicode_data`), `\\s` meaning ASCII
whitespace (other whitespace is collapsed onto \\x0b) and `$` meaning the end of the piece. That
keeps the splits identical to llama.cpp's, including its approximations (a `[^a-z]` tests only
ASCII, `\\p{S}` misses '~', ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kinetic.text import unicode_data as ud

# --- the regexes, as the tokenizer.json files spell them (adapted the way llama.cpp adapts them:
# case-insensitive groups spelled out, since ECMAScript has no inline flags) ---

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Letter runs split at lower->upper case changes, approximated with ASCII-only case tests.
_UPPER_RUN = r"((?=[\p{L}])([^a-z]))"
_LOWER_RUN = r"((?=[\p{L}])([^A-Z]))"
GPT4O = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "*" + _LOWER_RUN + "+" + _CONTRACTIONS + "?"
         r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "+" + _LOWER_RUN + "*" + _CONTRACTIONS + "?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TEKKEN = (r"[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "*" + _LOWER_RUN + "+"
          r"|[^\r\n\p{L}\p{N}]?" + _UPPER_RUN + "+" + _LOWER_RUN + "*"
          r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek LLM's letter class (from its tokenizer.json): Latin, Greek, Cyrillic, Armenian, ... ranges.
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943")
DEEPSEEK_LLM = ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+",
                "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
                r"\s+$", CJK, r"\p{N}+")
DEEPSEEK_CODER = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK, r"\p{N}")
FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]")
STARCODER = (r"\p{N}", GPT2)
BLOOM = (" ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+",)
DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]")
NEWLINES = ("[^\n]+|[\n]+",)


@dataclass(frozen=True)
class PreTokenizer:
    """How one `tokenizer.ggml.pre` value tokenizes: its regexes and the vocabulary flags that
    llama.cpp ties to it (decode-time space cleaning, whole-word lookup before merging, the
    add_bos default, GPT-2 byte encoding, and ▁ for spaces)."""

    name: str
    regexes: tuple[str, ...]
    clean_spaces: bool = True
    ignore_merges: bool = False
    add_bos: bool = False
    byte_encode: bool = True
    escape_whitespaces: bool = False


def _family(names: str, regexes: str | tuple[str, ...], **flags) -> dict[str, PreTokenizer]:
    if isinstance(regexes, str):
        regexes = (regexes,)
    return {n: PreTokenizer(n, regexes, **flags) for n in names.split()}


PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **_family("default", DEFAULT),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
              LLAMA3, ignore_merges=True, add_bos=True),
    **_family("dbrx smaug-bpe", LLAMA3),
    **_family("glm4 chatglm-bpe", LLAMA3),
    **_family("deepseek-llm", DEEPSEEK_LLM, clean_spaces=False),
    **_family("deepseek-coder", DEEPSEEK_CODER, clean_spaces=False),
    **_family("falcon", FALCON),
    **_family("mpt olmo jais gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 "
              "mellum modern-bert jina-v1-en jina-v2-code roberta-bpe exaone4", GPT2),
    **_family("trillion granite-docling", GPT2, clean_spaces=False),
    **_family("starcoder refact codeshell exaone minerva-7b mellum2", STARCODER),
    **_family("command-r smollm", STARCODER, clean_spaces=False),
    **_family("stablelm2 megrez", QWEN2),
    **_family("qwen2 deepseek-r1-qwen kormo f2llmv2 hunyuan solar-open", QWEN2, clean_spaces=False),
    **_family("qwen35", QWEN35, clean_spaces=False),
    **_family("bloom gpt3-finnish", BLOOM),
    **_family("poro-chat", BLOOM, clean_spaces=False),
    **_family("tekken", TEKKEN, clean_spaces=False, ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 kanana2 talkie", GPT4O, clean_spaces=False),
    # Gemma 4: SentencePiece-style BPE on raw UTF-8 with ▁ for spaces, merged across whole lines.
    **_family("gemma4", NEWLINES, byte_encode=False, escape_whitespaces=True),
}

# --- translation of the tokenizer.json syntax into Python `re` on the collapsed text ---

_ASCII_IN_CLASS = {
    "L": "A-Za-z", "N": "0-9", "M": "",
    "P": r"!-#%-*,-/:-;?-@\[-\]_\{\}",
    "S": r"\$\+<->\^`\|",   # no '~': llama.cpp's table of ASCII symbols leaves it out
}
_PLACEHOLDER = {"L": ud.COLLAPSED_LETTER, "N": ud.COLLAPSED_NUMBER, "M": ud.COLLAPSED_MARK,
                "P": ud.COLLAPSED_PUNCTUATION, "S": ud.COLLAPSED_SYMBOL}
_SPACE_IN_CLASS = r"\t\n\x0b\x0c\r "
_PROPERTY = re.compile(r"\\p\{(L[ultmo]?|N|P|S|M)\}")


def uses_categories(pattern: str) -> bool:
    """True when the regex needs the collapsed text (it names a Unicode category)."""
    return _PROPERTY.search(pattern) is not None


def translate(pattern: str) -> str:
    """Returns `pattern` rewritten for Python's `re`, to run on `collapse(text)` when it uses
    categories and on `widen(text)` otherwise."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            m = _PROPERTY.match(pattern, i)
            if m:
                cat = m.group(1)[0]
                body = re.escape(_PLACEHOLDER[cat]) + _ASCII_IN_CLASS[cat]
                out.append(body if inside else "[" + body + "]")
                i = m.end()
                continue
            nxt = pattern[i + 1]
            if nxt == "s":
                out.append(_SPACE_IN_CLASS if inside else "[" + _SPACE_IN_CLASS + "]")
            elif nxt == "S":
                if inside:
                    raise ValueError(f"\\S inside a character class is not supported: {pattern!r}")
                out.append("[^" + _SPACE_IN_CLASS + "]")
            elif nxt == "d":
                out.append("0-9" if inside else "[0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        elif c == "$" and not inside:
            c = r"\Z"   # ECMAScript's $ is the end of the input only, never before a final newline
        out.append(c)
        i += 1
    return "".join(out)


class Splitter:
    """Splits text into pre-tokenizer words for one PreTokenizer."""

    def __init__(self, regexes: tuple[str, ...]):
        self._steps = [(re.compile(translate(p)), uses_categories(p)) for p in regexes]
        self._needs_collapsed = any(c for _, c in self._steps)
        self._needs_wide = any(not c for _, c in self._steps)

    def split(self, text: str) -> list[str]:
        """Returns the words of `text` in order; their concatenation is `text`."""
        if not text:
            return []
        collapsed = ud.collapse(text) if self._needs_collapsed else ""
        wide = ud.widen(text) if self._needs_wide else ""
        lengths = [len(text)]
        for pattern, on_collapsed in self._steps:
            source = collapsed if on_collapsed else wide
            pieces: list[int] = []
            start = 0
            for length in lengths:
                segment = source[start:start + length]
                prev = 0
                for m in pattern.finditer(segment):
                    s, e = m.span()
                    if s > prev:
                        pieces.append(s - prev)
                    if e > s:
                        pieces.append(e - s)
                    prev = e
                if prev < length:
                    pieces.append(length - prev)
                start += length
            lengths = pieces
        words = []
        start = 0
        for length in lengths:
            words.append(text[start:start + length])
            start += length
        return words
