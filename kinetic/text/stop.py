"""Stop strings over streamed text: a match may span token boundaries, the stop string is
never emitted, and text that could still become a stop string is held back."""

from __future__ import annotations


class StopMatcher:
    """Feed text pieces; get back what is safe to emit and whether a stop string ended it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped: str | None = None

    def feed(self, text: str) -> str:
        """The text that can be emitted now. After a stop string is found, `stopped` holds
        it, the text before it is returned and everything after is dropped."""
        if self.stopped is not None:
            return ""
        buf = self.held + text
        first = min(((buf.find(s), s) for s in self.stops if s in buf), default=None)
        if first is not None:
            self.stopped, self.held = first[1], ""
            return buf[:first[0]]
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """What is held back, at the end of generation (no stop string completed)."""
        out, self.held = ("" if self.stopped is not None else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of buf that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
