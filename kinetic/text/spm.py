"""SentencePiece-style tokenization (`tokenizer.ggml.model` = llama), the way llama.cpp does it.

The text (spaces already replaced by ▁) starts as its characters; repeatedly the adjacent pair
whose concatenation is a vocabulary token with the highest score is merged (the leftmost on ties),
until no adjacent pair forms a token. A final symbol that is not a token becomes its UTF-8 bytes as
<0xXX> byte tokens. There is no word splitting: merges may cross spaces when the vocabulary has
such tokens, so the whole text is merged at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kinetic.text.chunks import score_ranks, spm_merge


class SPM:
    """Score-driven bigram merging over a vocabulary with per-token scores."""

    def __init__(self, token_to_id: dict[str, int], scores: Sequence[float]):
        self._token_to_id = token_to_id
        self._ranks = score_ranks(scores)   # each token's place by score, the best 0

    def encode(self, text: str, check: Callable[[], None] | None = None) -> list[int]:
        """Returns the token ids of `text` (already ▁-escaped): the symbols chunks.spm_merge
        leaves, a symbol that is not a token as its bytes. check: called every few thousand
        merges (it may raise to give up: a long text, kinetic/text/chunks.py)."""
        out: list[int] = []
        for piece in spm_merge(text, self._token_to_id, self._ranks, check):
            tid = self._token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._bytes(piece))
        return out

    def _bytes(self, piece: str) -> list[int]:
        out = []
        for b in piece.encode("utf-8"):
            tid = self._token_to_id.get(f"<0x{b:02X}>")
            if tid is None:
                # Vocabularies without byte tokens may still have the plain one-byte character.
                tid = self._token_to_id.get(chr(b)) if b < 128 else None
            # llama.cpp aborts when neither exists; dropping the byte keeps a server alive.
            if tid is not None:
                out.append(tid)
        return out
