"""Long texts: where one can be cut so that tokenizing the pieces one by one gives exactly the
tokens of the whole (`Tokenizer.encode_chunks`), and how few tokens a text can have at the
least, from its UTF-8 length alone (`Tokenizer.min_tokens`). A server uses the first to give
up on a prompt part way through (the client went away, the count passed the context) and the
second to refuse one that cannot fit the context before tokenizing it at all.

Cuts. BPE (within a pre-tokenizer word) and SentencePiece (within a text between special
tokens) start from single characters and repeatedly merge the best pair of neighbouring
symbols, the leftmost on ties. The first symbol to cover both text[p-1] and text[p] is made
by a merge whose two halves meet exactly at p. So if no merge can ever join a symbol ending
in text[p-1] to one starting with text[p], no symbol ever spans p; then every pair that can
merge lies on one side of p, merging it changes only that side, and the best pair over both
sides is, on its own side, the pair that side alone would take next (the leftmost-on-ties
order within a side is the same). Each side goes through exactly the merges it goes through
alone, and its final symbols become ids one by one as before: the tokens of the whole are
those of the two sides. Which neighbours can meet at a merge (`junctions`):
  - SentencePiece merges two symbols when their text together is a vocabulary token, so the
    two characters meeting there are neighbours inside some token: every neighbouring pair
    of every token;
  - BPE merges the pair (left, right) of a merge rule: left[-1] and right[0].
BPE's whole-word rules (ignore_merges: a word that is a token is that token; Gemma 4's words
of newlines) look at the whole word, so a word is only cut when it is not a token itself, and
its pieces are merged without those rules. Between pre-tokenizer words nothing needs proving:
BPE tokenizes each word alone. WordPiece: a space ends the word before it and starts none
(wordpiece.split_words), so a text cut before a space splits into the same words.

Long pieces. Where no cut is safe (a run of one character that merges with itself: 16 MB
of spaces) a piece stays long: merging it takes a minute, and a heap loop over lists of millions of
ints and a heap of millions of tuples held the interpreter lock, and so every other thread,
for seconds at a time, while they were made and freed (the event loop stalled for 3.7 s:
bench/event_loop.py). `bpe_merge` (bpe.merge's heap loop, for every long word) and
`spm_merge` (SPM.encode's loop, for every text) run on arrays of C ints made
and freed a block at a time, each heap entry packed into one int (in the tuple's order: its
fields, most significant first, 32 bits each), and call `check` every CHECK_STEPS merges so
that a caller can give up part way.

The bound. Every token of a text stands for a run of its bytes, and every byte is in exactly
one token's run, except where the tokenizer drops bytes: WordPiece drops whitespace and
control characters, special tokens with LSTRIP/RSTRIP swallow the spaces next to them (no
bound then), and a byte with no token of its own (no <0xXX> token, or in byte-level BPE no
character for it in the vocabulary) can vanish. So a text of B bytes, S of them such
"silent" bytes, has at least ceil((B - S) / L) tokens besides BOS/EOS, L being the most bytes
one token can stand for: a normal token's length in bytes (in byte-level BPE its length in
characters, one character a byte; a ▁ counted as 3 bytes, the most it can stand for: a
space or a written ▁), and the text of the special tokens the text is searched for.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat

from kinetic.text import unicode_data as ud
from kinetic.text.vocab import CONTROL, LSTRIP, RSTRIP, UNKNOWN, Vocab

CHUNK_CHARS = 4096      # about this much text per piece of encode_chunks
CHECK_STEPS = 1 << 12   # merges between two calls of their `check`
_BLOCK = 1 << 16        # characters or ints per call of the bulk work on a long piece
_BITS = 32
_MASK = (1 << _BITS) - 1


def spm_junctions(tokens: Iterable[str]) -> frozenset[str]:
    """Every pair of characters that are neighbours inside a token (as 2-character strings)."""
    return frozenset(t[i:i + 2] for t in tokens for i in range(len(t) - 1))


def bpe_junctions(ranks: Iterable[tuple[str, str]]) -> frozenset[str]:
    """The characters that meet in each merge rule: left[-1] + right[0]."""
    return frozenset(left[-1] + right[0] for left, right in ranks if left and right)


def cut(text: str, size: int, junctions: frozenset[str]) -> Iterator[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter; a piece is
    longer where no cut is safe), cut only between two characters that are not in
    `junctions`."""
    start, n = 0, len(text)
    p = size
    while p < n:
        while p < n and text[p - 1:p + 1] in junctions:
            # a run of one character (spaces, "====") mostly joins with itself: jump it
            p = _run_end(text, p) if text[p - 1] == text[p] else p + 1
        if p >= n:
            break
        yield text[start:p]
        start, p = p, p + size
    yield text[start:]


def _run_end(text: str, p: int) -> int:
    """Where the run of text[p] that starts at p ends, a block at a time."""
    c = text[p]
    while p < len(text):
        block = text[p:p + _BLOCK]
        rest = len(block.lstrip(c))
        p += len(block) - rest
        if rest:
            break
    return p


def cut_before_spaces(text: str, size: int) -> Iterator[str]:
    """`text` in pieces of at least `size` characters, each cut before a space."""
    start = 0
    while (p := text.find(" ", start + size)) > 0:
        yield text[start:p]
        start = p
    yield text[start:]


def bpe_merge(symbols: Sequence[str], ranks: dict[tuple[str, str], int],
              check: Callable[[], None] | None = None) -> list[str]:
    """The BPE merges of `symbols` by `ranks` (bpe.merge's answer) in O(n log n), for the
    words bpe.merge does not rescan: a heap of (rank, left, right, total) candidates packed
    into ints; an entry is stale once either side has changed length (merging only ever
    grows a symbol or empties it), so it is checked on pop instead of removed. The arrays
    are made and freed a block at a time, and `check()` is called every CHECK_STEPS merges,
    so that a piece of millions of symbols (a run of spaces) neither holds the interpreter
    lock long nor runs on once its request has gone."""
    n = len(symbols)
    if n == 0:
        return []
    text: list[str] = []
    for i in range(0, n, _BLOCK):
        text.extend(symbols[i:i + _BLOCK])
    size = _ints(0, n, 0)
    for i in range(n):
        size[i] = len(text[i])
    prev, nxt = _ints(-1, n), _ints(1, n)
    nxt[n - 1] = -1
    heap: list[int] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        r = ranks.get((text[left], text[right]))
        if r is not None:   # (rank, left, right, total)
            heapq.heappush(heap, (((r << _BITS | left) << _BITS | right) << _BITS)
                           | (size[left] + size[right]))

    for i in range(n - 1):
        push(i, i + 1)
    steps = 0
    while heap:
        key = heapq.heappop(heap)
        total, right, left = key & _MASK, key >> _BITS & _MASK, key >> 2 * _BITS & _MASK
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
            continue
        text[left] += text[right]
        size[left] = total
        size[right] = 0
        text[right] = ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
        steps += 1
        if check is not None and steps % CHECK_STEPS == 0:
            check()
    out = [t for t, s in zip(text, size) if s]
    while text:   # freed a block at a time, as it was made
        del text[-_BLOCK:]
    return out


def score_ranks(scores: Sequence[float]) -> list[int]:
    """Each token's place by score, from the highest (0) down, equal scores sharing one, a
    NaN score last (a NaN compares false with everything: as a heap key it left the order
    undefined), for spm_merge."""
    order = sorted({s for s in scores if s == s}, reverse=True)
    place = {s: i for i, s in enumerate(order)}
    return [place[s] if s == s else len(order) for s in scores]


def spm_merge(text: str, token_to_id: dict[str, int], ranks: list[int],
              check: Callable[[], None] | None = None) -> list[str]:
    """The final symbols of SentencePiece's merging of `text` (spm.py's module docstring;
    SPM.encode turns them into ids): repeatedly the adjacent pair whose concatenation is the
    token of the best `ranks` place (score_ranks) merges, the leftmost on ties. A heap of
    (place, left, right, total) candidates packed into ints, stale entries skipped on pop,
    arrays made and freed a block at a time, `check()` called every CHECK_STEPS merges."""
    n = len(text)
    if n == 0:
        return []
    size = _ints(1, n, 0)
    prev, nxt = _ints(-1, n), _ints(1, n)
    nxt[n - 1] = -1
    heap: list[int] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        total = size[left] + size[right]
        tid = token_to_id.get(text[left:left + total])
        if tid is not None:   # (place, left, right, total): the highest score first
            heapq.heappush(heap, (((ranks[tid] << _BITS | left) << _BITS | right)
                                  << _BITS) | total)

    for i in range(n - 1):
        push(i, i + 1)
    steps = 0
    while heap:
        key = heapq.heappop(heap)
        total, right, left = key & _MASK, key >> _BITS & _MASK, key >> 2 * _BITS & _MASK
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
            continue
        size[left] = total
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
        steps += 1
        if check is not None and steps % CHECK_STEPS == 0:
            check()
    out = []
    i = 0
    while i != -1:
        out.append(text[i:i + size[i]])
        i = nxt[i]
    return out


def _ints(first: int, n: int, step: int = 1) -> list[int] | array:
    """first, first + step, ... (n of them). Past _BLOCK, an array('i') made a block at a
    time: C ints (millions of int objects would take seconds to make and free, the
    interpreter lock held), and no single call long enough to keep the event loop waiting;
    below, a list, which a merge indexes faster (most words bpe.merge gives bpe_merge)."""
    if not 0 < n < 1 << 31:
        raise ValueError(f"a piece of {n} characters")
    if n <= _BLOCK:
        return list(range(first, first + n * step, step)) if step else [first] * n
    out = array("i")
    for i in range(0, n, _BLOCK):
        m = min(_BLOCK, n - i)
        out.extend(range(first + i * step, first + (i + m) * step, step) if step
                   else repeat(first, m))
    return out


@dataclass(frozen=True)
class PieceBound:
    """The most bytes of text one token stands for, and the bytes that may become no token."""

    longest: int
    silent: bytes

    def min_tokens(self, text: str) -> int:
        """At least how many tokens `text` has (BOS/EOS not counted)."""
        data = text.encode("utf-8", "surrogatepass")
        n = len(data.translate(None, self.silent)) if self.silent else len(data)
        return -(-n // self.longest)


def piece_bound(vocab: Vocab, ranks: Iterable[tuple[str, str]],
                parse_special: bool) -> PieceBound | None:
    """The bound of `vocab` (module docstring) with special tokens parsed or not; None where
    there is none (WordPiece, LSTRIP/RSTRIP tokens, a merge whose result is not a token)."""
    if vocab.kind == "wpm":
        return None
    matched = [t for t in vocab.special_ids_longest_first
               if parse_special or not vocab.attrs[t] & (CONTROL | UNKNOWN)]
    if any(vocab.attrs[t] & (LSTRIP | RSTRIP) for t in matched):
        return None
    longest = max((len(vocab.tokens[t].encode("utf-8")) for t in matched), default=1)
    t2i = vocab.token_to_id
    if vocab.kind == "bpe" and vocab.pre.byte_encode:
        # a final symbol that is not a token loses its non-ASCII characters (bpe._fallback):
        # only a single character can be one when every merge makes a token
        if any(left and right and left + right not in t2i for left, right in ranks):
            return None
        longest = max(longest, max(len(t) for t in vocab.tokens))
        silent = bytes(b for b in range(256) if ud.BYTE_TO_CHAR[b] not in t2i)
    else:
        longest = max(longest, max(len(t.encode("utf-8")) for t in vocab.tokens))
        silent = bytes(b for b in range(256) if f"<0x{b:02X}>" not in t2i
                       and not (vocab.kind == "spm" and b < 128 and chr(b) in t2i))
    return PieceBound(longest, silent)
