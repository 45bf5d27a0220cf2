"""Sliding-window layers keep only their window: the Scheduler's side (pure Python).

A sliding-window layer (Gemma 3's 5 of every 6) reads only the last `window` positions before
each query (llama.cpp masks key p0 for query p1 when p1 - p0 >= n_swa). Its cache pages stay
in the page table with the other layers' (one page id names a page in every layer), but once
a sequence's last page boundary is past a page by the window, no query of that sequence (nor
one resuming after its pages) reads the page's rows in those layers again: the scheduler
lists the page (PageManager.pass_window) and, WINDOW_BATCH pages at a time, the runner hands
their memory back to the system (`take_window_releases`, Runner.release_window_rows). So a
long sequence holds its sliding-window layers' rows for about `window` positions, as
llama.cpp's sliding-window cache does, and its global layers' rows for all of them.

Prefix reuse stays exact. A page whose sliding-window rows were handed back is recorded by
its key (`window_gone`). A sequence resuming from k cached pages reads the sliding-window
rows of the pages its first query's window reaches, the last ceil((window - 1) / page_size)
before position k * page_size, so it takes the longest cached prefix whose last pages that
many are whole (`_window_whole`); the rows after it it computes again. Pages are handed back
only where they are the sequence's own (not a cached prefix it found, which someone's later
request may resume at) and no other sequence holds them, and never those the sequence's
own prompt would resume at (its last page boundary before the sampled token, as a
regenerated answer or another choice of the same prompt starts from there) nor its tail (a
continued conversation resumes at its end).

`--swa-full` (EngineConfig.swa_full) keeps every row, as llama-server's flag does; so do the
kernels whose cache is not host memory (SchedulerConfig.window 0).
"""

from __future__ import annotations

from collections.abc import Sequence as Keys

from kinetic.engine.sequence import Sequence

PRUNE_EVERY = 4   # window_gone is pruned of keys no page holds past PRUNE_EVERY x num_pages
WINDOW_BATCH = 32   # pages listed before they are handed back together (take_window_releases)


class SlidingWindow:
    """The Scheduler's sliding-window releases: a base of Scheduler, whose __init__ makes the
    state these methods use (`window_gone`; the pages listed are the PageManager's)."""

    @property
    def _window_pages(self) -> int:
        """Pages before a resume point whose sliding-window rows its first query reads."""
        w, ps = self.config.window, self.config.page_size
        return -(-(w - 1) // ps) if w > 1 else 0

    def _window_whole(self, keys: Keys[bytes]) -> int:
        """The most leading pages of the cached key chain `keys` a sequence can resume after:
        none of the last _window_pages of them had their sliding-window rows handed back."""
        k, n = len(keys), self._window_pages
        if not self.window_gone or n == 0:
            return k
        while k:
            gone = [i for i in range(max(0, k - n), k) if keys[i] in self.window_gone]
            if not gone:
                return k
            k = gone[0]   # every k' above it still reaches that page
        return 0

    def _pass_window(self, seq: Sequence) -> None:
        """After seq's num_computed advanced: list its own pages its next query is past by
        the window (module docstring), once each."""
        if not self.config.window or not seq.pages:
            return
        ps = self.config.page_size
        # from the last page boundary it computed, where a continuation would resume
        upto = min(max(0, seq.num_computed // ps * ps - self.config.window + 1) // ps,
                   len(seq.pages))
        resume = (len(seq.tokens) if seq.prefill else (seq.n_prompt - 1)) // ps
        kept = range(resume - self._window_pages, resume)
        for j in range(seq.window_done, upto):
            page = seq.pages[j]
            if j in kept or self.pages.refcount(page) != 1:
                continue
            key = self.pages.key(page)
            if key is not None:
                self.window_gone.add(key)
            self.pages.pass_window(page)
        seq.window_done = max(seq.window_done, upto)

    def _registered(self, key: bytes) -> None:
        """A page newly registered under `key` holds every layer's rows."""
        self.window_gone.discard(key)

    def _prune_window_gone(self) -> None:
        """Forget the keys no page holds any more, on the device or in host memory."""
        if len(self.window_gone) <= PRUNE_EVERY * self.config.num_pages:
            return
        self.window_gone = {k for k in self.window_gone if self.pages.lookup([k]) or (
            self.host is not None and k in self.host)}

    def take_window_releases(self, batch: int | None = None) -> list[tuple[int, int]]:
        """Runs (first page, count) of pages whose sliding-window rows the runner should
        hand back now (PageManager.hand_back), once at least `batch` are listed (else
        none yet). A listed page allocated again first drops out: its next owner writes it.
        Batched because the runner waits for the dispatched steps before it hands rows back
        (Runner.release_window_rows), and a prompt's steps, which sample nothing, would
        otherwise each wait for the one before. batch None: WINDOW_BATCH."""
        batch = WINDOW_BATCH if batch is None else batch
        if not self.pages.to_hand_back or self.pages.to_hand_back < batch:
            return []
        return self.pages.hand_back()
