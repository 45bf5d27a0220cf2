"""The grammar's time budget: work past it raises MaskBudgetExceeded and leaves the grammar's
tables valid; in the engine, a request whose grammar overruns fails alone (a 503-class error)
while the others in its steps run on unchanged; `prepare_grammar` refuses with a ValueError.

Budgets here are negative (a deadline already past), so that whether work overruns never
depends on the machine's speed: every uncached piece of grammar work raises at its first check.
"""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.engine import grammar_step
from kinetic.engine.request import GenerationRequest
from kinetic.grammar import (GrammarTooCostly, MaskBudgetExceeded, Matcher, TokenVocab,
                             compile_gbnf, mask_budget)
from kinetic.grammar.matcher import accepts
from tests import mock_model as mm
from tests.mock_model import Collector, Paused, greedy, ids, run

# 300 literals sharing prefixes (a trie of rules: see test_literal_alternation_is_a_trie)
MANY = "root ::= " + " | ".join(f'"k{i}x"' for i in range(300))


def byte_vocab() -> TokenVocab:
    pieces = [bytes([b]) for b in range(256)] + [b"k1", b"k12", b"x", b"k299x"]
    return TokenVocab(pieces, eog_ids=[len(pieces)])


def mask_of(matcher) -> np.ndarray:
    row = np.zeros(matcher.vocab.n_words, np.int32)
    matcher.fill_mask(row)
    return row


def test_overrun_raises_and_leaves_the_tables_valid():
    vocab = byte_vocab()
    g = compile_gbnf(MANY)
    m = Matcher(g, vocab)
    with pytest.raises(MaskBudgetExceeded), mask_budget(-1):
        m.fill_mask(np.zeros(vocab.n_words, np.int32))
    with pytest.raises(MaskBudgetExceeded), mask_budget(-1):
        m.accept_bytes(b"k")
    assert m.state == m._history[0]    # nothing was accepted by the overrun
    # the same grammar, finished without a budget, answers as a fresh compile does
    fresh = Matcher(compile_gbnf(MANY), vocab)
    assert (mask_of(m) == mask_of(fresh)).all()
    assert m.accept_bytes(b"k12") and fresh.accept_bytes(b"k12")
    assert (mask_of(m) == mask_of(fresh)).all()
    assert accepts(g, b"k12x") and not accepts(g, b"k12")


def test_budget_nests_and_ends_with_its_block():
    vocab = byte_vocab()
    with mask_budget(60):
        with pytest.raises(MaskBudgetExceeded), mask_budget(-1):
            Matcher(compile_gbnf(MANY), vocab).fill_mask(np.zeros(vocab.n_words, np.int32))
        mask_of(Matcher(compile_gbnf(MANY), vocab))   # the outer budget rules again
    mask_of(Matcher(compile_gbnf(MANY), vocab))       # and outside, none


def test_cached_masks_cost_nothing_against_the_budget():
    """A state whose mask is cached is served as a copy: no check, so a grammar prepared in
    a worker thread never fails its first step on the engine thread."""
    vocab = byte_vocab()
    g = compile_gbnf(MANY)
    want = mask_of(Matcher(g, vocab))
    with mask_budget(-1):
        assert (mask_of(Matcher(g, vocab)) == want).all()


@pytest.fixture
def engine():
    e = mm.make_engine(parallel=2, n_ctx=64)
    yield e
    e.close()


def test_prepare_grammar_refuses_a_grammar_past_the_budget(engine, monkeypatch):
    g = compile_gbnf('root ::= [a-z]+')
    engine.prepare_grammar(g)   # within the real budget: fine, and its first mask is cached
    monkeypatch.setattr(grammar_step, "MASK_BUDGET_SECONDS", -1.0)
    with pytest.raises(GrammarTooCostly, match="first token mask"):
        engine.prepare_grammar(compile_gbnf(MANY))
    assert isinstance(GrammarTooCostly("x"), ValueError)   # the API's 400


def test_a_request_over_its_grammar_budget_fails_alone(engine, monkeypatch):
    """Two requests in the same steps: the one with a (fresh, unprepared) grammar overruns
    the budget and ends with a busy error; the other's answer is exactly its answer alone,
    and the engine serves the next request as usual."""
    hello = GenerationRequest(ids("hello"), max_tokens=6, speculative=False)
    alone = run(engine, hello)
    assert (alone.tokens, alone.finish_reason) == greedy(ids("hello"), 6)
    monkeypatch.setattr(grammar_step, "MASK_BUDGET_SECONDS", -1.0)
    constrained = GenerationRequest(ids("hi"), max_tokens=6, grammar=compile_gbnf(MANY))
    with Paused(engine):   # both reach the engine together, so they share their steps
        a, b = Collector(), Collector()
        engine.start(constrained, a)
        engine.start(hello, b)
    failed, other = a.wait(), b.wait()
    assert failed.finish_reason == "error" and failed.deltas[-1].busy
    assert "grammar" in failed.deltas[-1].error and not failed.tokens
    assert (other.tokens, other.finish_reason) == (alone.tokens, alone.finish_reason)
    assert not engine.scheduler.sequences   # the failed request's slot and pages are free
    monkeypatch.setattr(grammar_step, "MASK_BUDGET_SECONDS", 1.0)
    again = run(engine, GenerationRequest(ids("hi"), max_tokens=3,
                                          grammar=compile_gbnf('root ::= "k" [a-z]+')))
    assert again.finish_reason == "length" and again.text.startswith("k")


def test_literal_alternation_is_a_trie():
    """GBNF's alternation of many string literals is left-factored (ir.literal_trie), so its
    parser states hold one stack per distinct next byte, not one per literal: 20,000 literals
    would otherwise make every mask walk 20,000 stacks (and overrun the budget)."""
    words = [f"v{i}" for i in range(20_000)]
    g = compile_gbnf("root ::= " + " | ".join(f'"{w}"' for w in words) + ' | "x" [0-9]')
    m = Matcher(g, byte_vocab())
    assert len(m._s.sets[m.state]) <= 2       # "v..." and "x"
    assert m.accept_bytes(b"v1")
    assert len(m._s.sets[m.state]) <= 11      # end, or one of ten next digits
    for w in (b"v0", b"v19999", b"v123", b"x7"):
        assert accepts(g, w), w
    for w in (b"v", b"v20000", b"v01", b"x", b"v1x"):
        assert not accepts(g, w), w
