"""Grammar work inside the engine's turn, each request's within a budget.

A request with a grammar has a matcher (Job.matcher). In a turn its drafts are cut where the
grammar rejects them (`draft_prefix`); each of its sampled rows gets its token bitmask
(`masks`: the matcher advanced through the row's draft tokens, then rolled back), computed
after the step is dispatched, so on the host while the device runs it; the tokens kept
advance the matcher (Job.take, under `work`). Every piece of that work runs under
MASK_BUDGET_SECONDS (kinetic.grammar.mask_budget): a request whose grammar overruns it fails
alone, with a 503-class error, and the step goes on for the others, so whatever grammar a
client sends, the engine thread's time per step stays bounded. `prepare` builds a grammar's
start state and first mask under the same budget on the caller's thread, before the request
reaches the engine (the server runs it in a worker thread, refusing with 400).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import numpy as np

from kinetic.grammar import (Grammar, GrammarTooCostly, MaskBudgetExceeded, Matcher, TokenVocab,
                             mask_budget)
from kinetic.memory import release_memory
from kinetic.text.tokenizer import Tokenizer

# The most one request's grammar work may take in one turn, its draft check, masks and accepted
# tokens together. Masks of real schemas take 0.2 ms typically and at most 0.2-0.4 s on a busy
# 2-core machine (docs/performance.md); a grammar past this is a hostile one.
MASK_BUDGET_SECONDS = 1.0


class GrammarWork:
    """An engine's grammar work: its token trie, and each turn's budgets (engine thread)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.over_budget: set[int] = set()   # this turn's requests whose grammar overran
        self._spent: dict[int, float] = {}   # this turn's grammar seconds per request
        self._vocab: TokenVocab | None = None
        self._vocab_lock = threading.Lock()

    def vocab(self) -> TokenVocab:
        """The tokenizer's trie for grammar masks (control tokens as their text), built once
        (about a second for a 150k vocabulary: the server builds it while it starts)."""
        with self._vocab_lock:
            if self._vocab is None:
                from kinetic import compile_cache   # (JAX's: this module imports none)
                self._vocab = TokenVocab.from_tokenizer(self.tokenizer, special=True,
                                                        cache=compile_cache.aside("vocab"))
                # building it makes and drops a dict of every token prefix per length; the C
                # library would keep that memory (Gemma 3's 262,144 tokens: about 100 MiB)
                release_memory()
            return self._vocab

    def prepare(self, grammar: Grammar) -> None:
        """Build `grammar`'s start state and first token mask on the calling thread, within
        MASK_BUDGET_SECONDS. Raises GrammarTooCostly (a ValueError) past it. The engine then
        finds both cached."""
        vocab = self.vocab()
        row = np.zeros(vocab.n_words, np.int32)
        try:
            with mask_budget(MASK_BUDGET_SECONDS):
                Matcher(grammar, vocab).fill_mask(row)
        except MaskBudgetExceeded:
            raise GrammarTooCostly(
                f"the grammar's first token mask takes more than {MASK_BUDGET_SECONDS:g} s "
                f"to compute (its start has too many alternatives to follow at once); "
                f"simplify it") from None

    def new_turn(self) -> None:
        """Each turn's budget starts afresh."""
        self._spent.clear()

    @contextmanager
    def work(self, job):
        """A piece of `job`'s grammar work in this turn, within what is left of its budget
        (MASK_BUDGET_SECONDS per request per turn, over its draft check, masks and accepted
        tokens together). An overrun is swallowed here and marks the request, which fails at
        the end of the turn; the caller checks `job.seq_id in self.over_budget`."""
        if job.matcher is None:
            yield
            return
        spent = self._spent.get(job.seq_id, 0.0)
        started = time.perf_counter()
        try:
            with mask_budget(MASK_BUDGET_SECONDS - spent):
                yield
        except MaskBudgetExceeded:
            self.over_budget.add(job.seq_id)
        finally:
            self._spent[job.seq_id] = spent + time.perf_counter() - started

    def draft_prefix(self, job, draft: list[int]) -> list[int]:
        """The longest start of `draft` the job's grammar accepts from its matcher's state
        (left as it was): a drafted token the grammar rejects could never equal a (masked)
        sample. Nothing once its grammar overran."""
        taken = 0
        with self.work(job):
            for t in draft:
                if not job.matcher.accept_token(t):
                    break
                taken += 1
        job.matcher.rollback(taken)
        return [] if job.seq_id in self.over_budget else draft[:taken]

    def masks(self, job, drafts: list[int]) -> np.ndarray | None:
        """The [1 + len(drafts), ceil(V/32)] token bitmasks of a job's sampled rows: its
        grammar's mask now, and after each drafted token (drafts were cut to what the grammar
        allows: draft_prefix), the matcher left as it was. None for a job without a grammar,
        or whose grammar overran (its rows are sampled unmasked, then dropped)."""
        matcher = job.matcher
        if matcher is None or job.seq_id in self.over_budget:
            return None
        words = matcher.vocab.n_words
        out = np.zeros((1 + len(drafts), -(-self.vocab_size // 32)), np.int32)
        taken = 0
        with self.work(job):
            matcher.fill_mask(out[0, :words])
            for t in drafts:
                if not matcher.accept_token(t):
                    break
                taken += 1
                matcher.fill_mask(out[taken, :words])
        matcher.rollback(taken)
        return None if job.seq_id in self.over_budget else out

    @staticmethod
    def overrun_message() -> str:
        return (f"the request's grammar took more than {MASK_BUDGET_SECONDS:g} s of one step "
                f"to compute its token masks; it was stopped so that other requests keep their "
                f"pace (simplify the grammar)")
