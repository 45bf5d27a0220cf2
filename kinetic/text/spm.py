"""SentencePiece-style tokenization (`tokenizer.ggml.model` = llama), the way llama.cpp does it.

The text (spaces already replaced by ▁) starts as its characters; repeatedly the adjacent pair
whose concatenation is a vocabulary token with the highest score is merged (the leftmost on ties),
until no adjacent pair forms a token. A final symbol that is not a token becomes its UTF-8 bytes as
<0xXX> byte tokens. There is no word splitting: merges may cross spaces when the vocabulary has
such tokens, so the whole text is merged at once.
"""

from __future__ import annotations

import heapq


class SPM:
    """Score-driven bigram merging over a vocabulary with per-token scores."""

    def __init__(self, token_to_id: dict[str, int], scores: list[float]):
        self._token_to_id = token_to_id
        self._scores = scores

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of `text` (already ▁-escaped)."""
        n = len(text)
        if n == 0:
            return []
        token_to_id = self._token_to_id
        scores = self._scores
        start = list(range(n))
        size = [1] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap: list[tuple[float, int, int, int]] = []

        def push(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            total = size[left] + size[right]
            tid = token_to_id.get(text[start[left]:start[left] + total])
            if tid is not None:
                # Highest score first, then the leftmost pair.
                heapq.heappush(heap, (-scores[tid], left, right, total))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, left, right, total = heapq.heappop(heap)
            # Stale if either side was merged away or grew since the pair was queued.
            if size[left] == 0 or size[right] == 0 or size[left] + size[right] != total:
                continue
            size[left] = total
            size[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left], left)
            push(left, nxt[left])

        out: list[int] = []
        i = 0
        while i != -1:
            piece = text[start[i]:start[i] + size[i]]
            tid = token_to_id.get(piece)
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._bytes(piece))
            i = nxt[i]
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
