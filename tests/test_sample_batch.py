"""Sampling inputs on the host (kinetic/engine/sample_batch.py): exact, and without JAX.

Serving (engine/turn.py) and receipt verification (receipts/verify.py) both build their
sampler calls here; tests/test_receipts.py and tests/test_invariance.py check the tokens that
come out, this file checks what goes in.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from kinetic.engine.sample_batch import (BIAS_WIDTH, GPU_SAMPLE_CHUNK, HISTORY_WIDTH,
                                         SAMPLE_CHUNK, SampleShape, full_mask, initial_mu,
                                         row_fields, sample_batches, sample_buckets,
                                         sample_row)
from kinetic.engine.request import GenerationRequest
from kinetic.engine.sampling_params import SamplingParams

V = 100


class FakeJob:
    """What sample_row reads of a Job."""

    def __init__(self, params: SamplingParams, seed: int = 7, mu=None, logprobs=None,
                 post_sampling: bool = False, bias=None, dry=None):
        self.request = GenerationRequest([1, 2], params=params, logprobs=logprobs,
                                         post_sampling=post_sampling)
        self.seed, self.mu = seed, mu
        self._bias, self._dry, self.dry_calls = bias, dry, []

    def bias_pairs(self, vocab_size):
        return self._bias

    def dry_pairs(self, history, vocab_size, n_ctx):
        self.dry_calls.append((list(history), vocab_size, n_ctx))
        return self._dry


def shape(**kw) -> SampleShape:
    return dataclasses.replace(SampleShape.of(V, 64, [1, 2, 4, 8, 16], eog_ids=[0]), **kw)


def test_the_module_imports_no_jax():
    """The host side of sampling, the turn and its grammar and decode-step pieces run
    without JAX: only the runner calls the device."""
    code = ("import sys; import kinetic.engine.sample_batch, kinetic.engine.turn, "
            "kinetic.engine.grammar_step, kinetic.engine.decode_steps; "
            "assert 'jax' not in sys.modules and 'jaxlib' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_shape_is_fixed_per_engine():
    s = shape()
    assert s.buckets == (1, 4, 16) and s.chain_bucket == 4
    assert [s.bucket(n) for n in (1, 2, 4, 5, 16)] == [1, 4, 4, 16, 16]
    assert s.bias_width == BIAS_WIDTH and s.history_width == 64 and s.mask_words == 4
    assert sample_buckets([8]) == [8] and sample_buckets([1, 2, 4, 8]) == [1, 4, 8]
    # a tokenizer with more eog ids than the width holds widens it
    wide = SampleShape.of(5000, 8192, [1], eog_ids=range(100))
    assert wide.bias_width == BIAS_WIDTH - 64 + 100 and wide.history_width == HISTORY_WIDTH


def test_greedy_rows_are_one_call_and_others_chunks_of_four():
    s = shape()
    greedy = [sample_row(FakeJob(SamplingParams(temperature=0)), i, 5, [], None, s)
              for i in range(7)]
    (one,) = sample_batches(greedy, s)
    assert one.greedy and (one.n, one.T) == (7, 16) and one.params is None
    assert one.rows.tolist() == list(range(7)) + [0] * 9
    assert one.bias is None and one.mask is None and one.history is None and one.dry is None
    mixed = greedy[:3] + [sample_row(FakeJob(SamplingParams(temperature=0.7)), 9, 5, [], None,
                                     s)] + greedy[3:]
    calls = sample_batches(mixed, s)
    assert [(b.n, b.T, b.greedy) for b in calls] == [(4, 4, False), (4, 4, True)]
    assert SAMPLE_CHUNK == 4 and calls[0].rows.tolist() == [0, 1, 2, 9]


def test_a_whole_batch_chain_takes_more_rows_a_call_at_the_bucket_that_holds_them():
    """On a GPU (whole_batch) the chain draws GPU_SAMPLE_CHUNK rows a call, each call at the
    smallest bucket holding its rows and SAMPLE_CHUNK (it pays for every row of its bucket),
    and is compiled at each bucket from SAMPLE_CHUNK's up to its largest; an engine whose
    largest bucket is smaller takes that many a call. Without whole_batch: SAMPLE_CHUNK rows
    at one compiled size."""
    gpu = SampleShape.of(V, 64, [1, 2, 4, 8, 16, 32, 64, 128, 256], eog_ids=[0],
                         whole_batch=True)
    assert GPU_SAMPLE_CHUNK == 64 and gpu.chain_rows == 64 and gpu.chain_size == 64
    assert gpu.buckets == (1, 4, 16, 64, 256) and gpu.chain_buckets == (4, 16, 64)
    rows = [sample_row(FakeJob(SamplingParams(temperature=0.7)), i, 5, [], None, gpu)
            for i in range(150)]
    calls = sample_batches(rows, gpu)
    assert [(b.n, b.T) for b in calls] == [(64, 64), (64, 64), (22, 64)]
    assert calls[2].rows[:22].tolist() == list(range(128, 150))
    assert [(b.n, b.T) for b in sample_batches(rows[:1], gpu)] == [(1, 4)]
    assert [(b.n, b.T) for b in sample_batches(rows[:5], gpu)] == [(5, 16)]
    small = SampleShape.of(V, 64, [1, 2, 4, 8], eog_ids=[0], whole_batch=True)
    assert small.chain_size == 8 and small.chain_buckets == (4, 8)
    assert [(b.n, b.T) for b in sample_batches(rows[:11], small)] == [(8, 8), (3, 4)]
    cpu = SampleShape.of(V, 64, [1, 2, 4, 8], eog_ids=[0])
    assert not cpu.whole_batch and cpu.chain_buckets == (4,)
    assert [(b.n, b.T) for b in sample_batches(rows[:5], cpu)] == [(4, 4), (1, 4)]
    for whole in (False, True):   # one row a step: one a call
        one = SampleShape.of(V, 64, [1], eog_ids=[0], whole_batch=whole)
        assert one.chain_size == 1 and one.chain_buckets == (1,)
        assert [(b.n, b.T) for b in sample_batches(rows[:2], one)] == [(1, 1), (1, 1)]


def test_row_parameters_are_the_requests_padded_with_greedy_rows():
    s = shape()
    p = SamplingParams(temperature=0.8, top_k=5, repeat_last_n=-1, mirostat=2, mirostat_tau=3)
    rows = [sample_row(FakeJob(p, seed=2**32 + 3, mu=None), 0, 11, [], None, s),
            sample_row(FakeJob(p, seed=5, mu=1.5), 1, 12, [], None, s)]
    (b,) = sample_batches(rows, s)
    f = b.params
    assert b.T == 4 and f["temperature"].tolist() == pytest.approx([0.8, 0.8, 0, 0])
    assert f["seed"].dtype == np.uint32 and f["seed"].tolist() == [3, 5, 0, 0]
    assert f["position"].tolist() == [11, 12, 0, 0]
    assert f["repeat_last_n"].tolist()[:2] == [64, 64]   # -1: the shape's context
    assert f["mu"].tolist() == [initial_mu(p), 1.5, 0.0, 0.0] == [6.0, 1.5, 0.0, 0.0]
    assert b.mus == (None, 1.5) and b.initial_mus == (6.0, 6.0)
    assert sorted(f) == sorted(row_fields([p], [0], [0]))


def test_bias_mask_history_and_dry_rows():
    s = shape(dry_width=2)
    pen = SamplingParams(temperature=0.5, repeat_penalty=1.3)
    dry = SamplingParams(temperature=0.5, dry_multiplier=0.8)
    bias = (np.array([3, 4], np.int32), np.array([1.0, -2.0], np.float32))
    mask = np.zeros(s.mask_words, np.int32)
    mask[0] = 0b1000
    many = (np.arange(5, dtype=np.int32), np.ones(5, np.float32))
    jobs = [FakeJob(pen, bias=bias), FakeJob(dry, dry=many), FakeJob(dry, dry=(bias[0], bias[1])),
            FakeJob(SamplingParams(temperature=0.5))]
    rows = [sample_row(j, i, 4, [9, 8, 7, 6], mask if i == 3 else None, s)
            for i, j in enumerate(jobs)]
    assert rows[3].history == () and rows[0].history == [9, 8, 7, 6]   # read when needed
    assert jobs[1].dry_calls == [([9, 8, 7, 6], V, 64)] and jobs[0].dry_calls == []
    (b,) = sample_batches(rows, s)
    assert b.bias[0] is bias and b.bias[1:] == (None, None, None)
    assert (b.mask[:3] == full_mask(3, V)).all() and b.mask[3].tolist() == mask.tolist()
    assert b.history.shape == (4, 64) and b.history[0, -4:].tolist() == [9, 8, 7, 6]
    ids, values, spill = b.dry
    # row 1 has 5 penalised tokens, past the width of 2: whole in the dense spill
    assert ids[1].tolist() == [-1, -1] and spill[1, :5].tolist() == [1.0] * 5
    assert ids[2].tolist() == [3, 4] and spill[2].sum() == 0 and ids[0].tolist() == [-1, -1]


def test_logprob_rows_and_their_bucket():
    s = shape()
    p = SamplingParams(temperature=0.5)
    rows = [sample_row(FakeJob(p, logprobs=2 if i in (1, 3, 4) else None,
                               post_sampling=i == 3), i, 1, [], None, s) for i in range(5)]
    a, b = sample_batches(rows, s)
    assert a.logprob_rows == (1,) and a.logprob_bucket == 1 and a.post_rows == (3,)
    assert b.logprob_rows == (0,) and b.logprob_bucket == 1 and b.T == 4   # the chain: 4 rows
