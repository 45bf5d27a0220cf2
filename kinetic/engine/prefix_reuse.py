"""Prefix reuse: the Scheduler's side of the prefix cache (pure Python).

A waiting sequence admitted into a slot (`_admit`) starts from its cached prefix instead of
computing it again: the leading full pages kv_cache.PageManager holds on the device (keyed
by the hash chain of their tokens), then those evicted to host memory (`host`, the engine's
tier: host_cache.py), copied into new pages before the step (`StepPlan.restores`), then the
partly filled last page of a finished sequence that started the same, kept in host memory
(`_keep_partial_page`, kv_cache.partial_key). A step's newly full pages are registered as
it completes (`_register_full_pages`). A waiting sequence whose next page a running one is
computing waits for it (`_waits_for_prefix`), to find it cached rather than compute it twice.

Recurrent models (Qwen3.5: `snapshots` set). A sequence's recurrent state is not in its
pages, so it resumes from a cached prefix only where a state snapshot was kept
(recurrent_state.StateSnapshots, keyed by the page key the snapshot's position ends): a
prompt chunk is cut at the prompt's last page boundary so that a snapshot is taken there,
a decoding sequence's latest full page gets one too, the plan carries the snapshot to
restore (`state_loads`) and `complete` asks for the new ones (`take_state_saves`).
Partial pages are not reused for them.

Sliding-window layers whose passed rows were handed back (sliding_window.py): a sequence
resumes after the longest cached prefix whose last pages still hold those rows.
"""

from __future__ import annotations

from kinetic.engine.kv_cache import extend_keys, partial_key
from kinetic.engine.sequence import Chunk, Sequence, Status

MAX_PARTIAL_KEYS = 1 << 14   # leading runs of kept partial pages the scheduler remembers


class PrefixReuse:
    """The Scheduler's prefix reuse: a base of Scheduler, whose __init__ makes the state these
    methods use (`pages`, `host`, `keep_partial`, `snapshots` and what a step carries)."""

    def cached_tokens(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the prefix cache holds: whole pages, on the
        device or in host memory (a recurrent model: up to the last one with a state
        snapshot, where a sequence can resume)."""
        ps = self.config.page_size
        keys = extend_keys([], tokens, ps, len(tokens) // ps)
        j = len(self.pages.lookup(keys))
        while j < len(keys) and self.host is not None and keys[j] in self.host:
            j += 1
        j = self._window_whole(keys[:j])
        if self.snapshots is not None:
            j = self.snapshots.best(keys[:j])
        return j * ps

    def forget(self, tokens: list[int]) -> int:
        """Drop the prefix cache's pages of `tokens` that no running sequence uses, on the
        device and in host memory: the whole pages, and the partly filled page kept for the
        tokens past them (_keep_partial_page). Returns how many tokens' pages were dropped."""
        ps = self.config.page_size
        full = len(tokens) // ps
        keys = extend_keys([], tokens, ps, full)
        dropped = self.pages.forget(keys) * ps
        if self.host is not None:
            dropped = max(dropped, sum(self.host.drop(k) for k in keys) * ps)
            tail, parent = tokens[full * ps:], keys[-1] if keys else None
            runs = [self._partials.pop(partial_key(parent, tail[:i]), None)
                    for i in range(1, len(tail) + 1)]
            if [self.host.drop(kept) for kept in set(runs) - {None}].count(True):
                dropped += len(tail)
        return dropped

    def _future_keys(self, seq: Sequence) -> list[bytes]:
        """Keys of the full pages of seq's known tokens that it has not computed yet."""
        ps = self.config.page_size
        full = len(seq.tokens) // ps
        return extend_keys(seq.page_keys, seq.key_tokens, ps, full)[seq.num_computed // ps:full]

    def _waits_for_prefix(self, seq: Sequence, computing: set[bytes]) -> bool:
        """Whether waiting `seq`'s first page not cached (on the device or in host memory)
        is one a running sequence is computing."""
        if not computing or not seq.use_prefix_cache:
            return False
        ps = self.config.page_size
        cacheable = (len(seq.tokens) - 1) // ps
        keys = extend_keys(seq.page_keys, seq.key_tokens, ps, cacheable)[:cacheable]
        j = len(self.pages.lookup(keys))
        while j < len(keys) and self.host is not None and keys[j] in self.host:
            j += 1
        return j < len(keys) and keys[j] in computing

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Start waiting `seq` in a free slot with its cached prefix, if pages for at least
        one row can be had without preempting. Returns the rows it gets (0: not admitted)."""
        ps = self.config.page_size
        # the last token is always computed: its logits are what the step is for (a prefill
        # wants no logits, and its tokens are whole pages)
        last = 0 if seq.prefill else 1
        cacheable = (len(seq.tokens) - last) // ps if seq.use_prefix_cache else 0
        keys = extend_keys(seq.page_keys, seq.key_tokens, ps, cacheable)[:cacheable]
        hits = self.pages.lookup(keys)
        revived = sum(self.pages.refcount(p) == 0 for p in hits)  # leave the evictable list
        # pages of the prefix that were evicted to host memory come back by copy
        from_host = []
        if self.host is not None:
            for key in keys[len(hits):]:
                if key not in self.host:
                    break
                from_host.append(key)
            from_host = from_host[:max(0, self.pages.available - revived - 1)]
        if self.window_gone:   # the first query's window must find its sliding layers' rows
            k = self._window_whole(keys[:len(hits) + len(from_host)])
            hits, from_host = hits[:k], from_host[:max(0, k - len(hits))]
            revived = sum(self.pages.refcount(p) == 0 for p in hits)
        snapshot = None
        if self.snapshots is not None:   # a recurrent state: resume where one was kept
            k = self.snapshots.best(keys[:len(hits) + len(from_host)])
            snapshot = self.snapshots.get(keys[k - 1]) if k else None
            hits, from_host = hits[:k], from_host[:max(0, k - len(hits))]
            revived = sum(self.pages.refcount(p) == 0 for p in hits)
        computed = (len(hits) + len(from_host)) * ps
        partial = self._partial_hit(seq, keys[:len(hits) + len(from_host)], last,
                                    self.pages.available - revived - len(from_host))
        if partial is not None:
            computed += partial[1]
        need = next((hi - computed for lo, hi in seq.blocks if lo <= computed < hi), 0)
        n = min(len(seq.tokens) - computed, self.config.chunk_tokens,   # (a both-ways image
                max(budget, min(need, self._budget)))                  # whole, if it can)
        n = min(n, (len(hits) + self.pages.available - revived) * ps - computed)
        if n < 1:
            return 0
        self.pages.acquire(hits)
        if from_host:
            restored = self.pages.allocate(len(from_host))
            for page, key in zip(restored, from_host):
                self.pages.register(page, key)
                self.restores.append((page, key))
            hits = hits + restored
        seq.pages, seq.num_computed, seq.num_registered = hits, computed, len(hits)
        seq.window_done = len(hits)   # a cached prefix is not its own to hand back
        if partial is not None:   # a private copy: this sequence writes on into the page
            page = self.pages.allocate(1)[0]
            self.restores.append((page, partial[0]))
            seq.pages = hits + [page]
        if seq.status is Status.WAITING:
            seq.num_cached = computed
        self._grow(seq, n)
        seq.slot = self._slots.index(None)
        self._slots[seq.slot] = seq
        seq.status = Status.RUNNING
        if snapshot is not None:
            self.state_loads.append((seq.slot, snapshot))
        if seq.prefill:
            self.filling.append(seq)
            return n
        later = [i for i, s in enumerate(self.running) if s.arrival > seq.arrival]
        self.running.insert(later[0] if later else len(self.running), seq)
        return n

    def _partial_hit(self, seq: Sequence, keys: list[bytes], last: int,
                     pages_left: int) -> tuple[bytes, int] | None:
        """(key, rows) of the longest partly filled page in host memory that continues the
        cached whole pages `keys` with seq's next tokens (leaving `last` tokens to compute),
        if a page is left to copy it into; else None."""
        if (self.host is None or not self.keep_partial or not seq.use_prefix_cache
                or seq.prefill or pages_left < 1 or self.snapshots is not None):
            return None
        ps, start = self.config.page_size, len(keys) * self.config.page_size
        parent = keys[-1] if keys else None
        pending = {key for _, key in self.pages.evicted}   # saved before this plan's restores
        keyed = seq.key_tokens   # (a copy, where the sequence has images: made once)
        for k in range(min(ps - 1, len(seq.tokens) - last - start), 0, -1):
            kept = self._partials.get(partial_key(parent, keyed[start:start + k]))
            if kept is not None and (kept in self.host or kept in pending):
                return kept, k
        return None

    def _keep_partial_page(self, seq: Sequence) -> None:
        """Send the partly filled last page of a finishing sequence to host memory (as an
        evicted page is sent: the engine copies it before the next step writes anywhere), so
        that a later prompt that starts the same reuses those rows too, not only whole pages."""
        if (self.host is None or not self.keep_partial or not seq.use_prefix_cache or seq.prefill
                or self.snapshots is not None):   # (no recurrent state to resume it with)
            return
        ps = self.config.page_size
        full, k = divmod(seq.num_computed, ps)
        if k == 0 or full >= len(seq.pages):
            return
        keyed = seq.key_tokens
        extend_keys(seq.page_keys, keyed, ps, full)
        parent = seq.page_keys[full - 1] if full else None
        tail = keyed[full * ps:full * ps + k]
        kept = partial_key(parent, tail)
        if kept not in self.host:
            self.pages.evicted.append((seq.pages[full], kept))
        for i in range(1, k + 1):
            run = partial_key(parent, tail[:i])
            self._partials.pop(run, None)
            self._partials[run] = kept
        while len(self._partials) > MAX_PARTIAL_KEYS:
            self._partials.popitem(last=False)

    def _register_full_pages(self, seq: Sequence) -> None:
        full = seq.num_computed // self.config.page_size
        extend_keys(seq.page_keys, seq.key_tokens, self.config.page_size, full)
        for i in range(seq.num_registered, full):
            new = self.pages.key(seq.pages[i]) is None
            if self.pages.register(seq.pages[i], seq.page_keys[i]) and new:
                self._registered(seq.page_keys[i])
        seq.num_registered = max(seq.num_registered, full)

    def _snapshot_at(self, seq: Sequence) -> int:
        """Where a recurrent model keeps a state snapshot of seq's prompt: its last page
        boundary before the token whose logits are sampled (a prefill: its end)."""
        ps = self.config.page_size
        return len(seq.tokens) if seq.prefill else (len(seq.tokens) - 1) // ps * ps

    def _want_snapshot(self, seq: Sequence, chunk: Chunk) -> None:
        """After a step: ask for a snapshot of seq's state if the step ended its prompt's
        snapshot position, or (decoding) a page (the sequence's latest, tagged with its id)."""
        ps, at = self.config.page_size, seq.num_computed
        if self.snapshots is None or not seq.use_prefix_cache or at == 0 or at % ps:
            return
        if at == self._snapshot_at(seq) and not chunk.sampled:
            self.state_saves.append((seq.slot, seq.page_keys[at // ps - 1], at, None))
        elif chunk.sampled:
            self.state_saves.append((seq.slot, seq.page_keys[at // ps - 1], at, seq.seq_id))

    def take_state_saves(self) -> list[tuple[int, bytes, int, object]]:
        """The snapshots `complete` asked for: (slot, page key, position, tag)."""
        out, self.state_saves = self.state_saves, []
        return out
