"""Token ids -> text, one token at a time, never emitting half of a UTF-8 character."""

from __future__ import annotations

from kinetic.text.tokenizer import Tokenizer


class IncrementalDecoder:
    """Accumulates token bytes and returns the text that is complete so far.

    A character split across tokens (byte-fallback or byte-level BPE pieces) is held back
    until its last byte arrives; `flush` returns what is left, invalid bytes replaced. With
    `special`, control tokens come out as their text (as a grammar saw them) instead of nothing.
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self.tokenizer = tokenizer
        self.special = special
        self.pending = b""

    def add(self, token_id: int) -> str:
        """The text this token completes (possibly "")."""
        self.pending += self.tokenizer.token_bytes(token_id, self.special)
        cut = _complete_prefix(self.pending)
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text.decode("utf-8", errors="replace")

    def flush(self) -> str:
        text, self.pending = self.pending, b""
        return text.decode("utf-8", errors="replace")


def _complete_prefix(data: bytes) -> int:
    """Length of the longest prefix that does not end inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n - back if need > back else n
    return n  # only continuation bytes: invalid UTF-8, emitted (replaced) as is
