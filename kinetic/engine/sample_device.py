"""Sampling on the device: the one caller of the jitted sampler, greedy draws and
log-probabilities (Runner.sample and Runner.token_logprobs are its entries).

A SampleBatch (engine/sample_batch.py: host arrays, built the same way for serving and for
receipt verification) becomes device arrays here and is drawn from:
- rows that are all plain greedy take the greedy draw, `greedy_tokens`: one C++ pass over
  each row where the C++ kernels run (kernel "ffi": native.row_argmax), sampler.greedy's XLA
  passes elsewhere. The decode-step loop (engine/runner.py) draws with the same function;
- other rows take the whole chain (sampler.sample_rows: one row at a time, at one compiled
  size; on a GPU sampler.sample_batch, all the rows at once at the bucket that holds them,
  up to 64 a call, the same bits), keyed per row by (seed, position);
- rows that ask get log-probabilities of the raw logits (sampler.logprobs), or of the
  distribution drawn from (post-sampling: sampler.distribution_rows over the chain's
  arguments).
Inputs the same for every row of a bucket (no bias, every token allowed, no penalties, no
DRY) are made once per bucket and kept on the device; a stream's bias pairs are sent once
while the same requests keep coming back (`_bias`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from kinetic import compile_cache
from kinetic.engine import sampler
from kinetic.engine.request import MAX_LOGPROBS
from kinetic.engine.sample_batch import (SampleBatch, SampleShape, full_mask, pack_pairs,
                                         row_fields)
from kinetic.engine.sampling_params import SamplingParams, history_rows
from kinetic.kernels import ffi as native
from kinetic.kernels import target
from kinetic.memory import release_memory


@dataclass(frozen=True)
class Drawn:
    """What one sampler call gives its n rows, on the host."""

    tokens: list[int]              # -1 where a row allowed no token
    mus: list[float]               # each row's Mirostat state after its draw
    logprobs: dict                 # row -> (chosen logprob, top ids, top logprobs)


def greedy_tokens(logits: jax.Array, bias: sampler.Sparse, mask: jax.Array | None,
                  exact: bool) -> jax.Array:
    """sampler.greedy's tokens: the first index of each row's maximum after the mask (None:
    every token allowed) and the bias pairs, NaN read as -inf, -1 where the row allows no
    token. exact (the C++ kernels run): from one C++ pass over each row
    (kinetic/kernels/csrc/argmax.h); traced for a GPU without a mask (the decode loop's):
    from a Pallas kernel over blocks of each row (kinetic/kernels/pallas_greedy.py: three
    kernels where XLA's passes are about eight); else from sampler.greedy's XLA passes.
    The same tokens every way."""
    if exact:
        return native.row_argmax(logits, bias.ids, bias.values, mask)
    if mask is None and bias.spill is None and target.backend() == "gpu":
        from kinetic.kernels import pallas_greedy
        return pallas_greedy.greedy(logits, bias.ids, bias.values)
    if mask is None:
        mask = jnp.full((logits.shape[0], -(-logits.shape[1] // 32)), -1, jnp.int32)
    return sampler.greedy(logits, bias, mask)


_greedy = compile_cache.jit(greedy_tokens, name="greedy_tokens", static_argnames=("exact",))


def _ready(fn, *args, **kwargs) -> None:
    """fn's executable for these arguments ready: loaded or compiled without running
    (compile_cache.jit.prepare), or, with the cache off, compiled by one call."""
    if not fn.prepare(*args, **kwargs):
        jax.block_until_ready(fn(*args, **kwargs))


def _zeros(shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.device_put(np.zeros(shape, dtype))

# XLA's options for the chain's executables on CPU: its older fusion emitters. With the newer
# (MLIR) ones compiling the chain took 290 MiB at its peak, which was a served SmolLM2's
# whole peak memory (start-up, 602 MiB; 500 with these); with these 68 MiB, the executable
# 29 MiB smaller, the same tokens and Mirostat states, a 1-row draw 3% slower (0.92 against
# 0.89 ms at top_k 40 over Qwen2.5's 151,936 tokens) and a full-vocabulary one (top_k 0)
# 12% (docs/performance.md, issue 40).
CHAIN_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


# the chain's form on a GPU (SampleShape.whole_batch): all rows at once, where sample_rows'
# loop over the rows reads a flag back to the host at each row and each branch it may skip
# (sampler.sample_batch)
ON_GPU = {sampler.sample_rows: sampler.sample_batch,
          sampler.distribution_rows: sampler.distribution_batch}


def _chain_executable(fn, args: tuple, max_candidates: int):
    """fn (a compile_cache.jit chain) compiled for args, with CHAIN_OPTIONS on CPU; without
    them elsewhere, or where this XLA does not know them (they change the memory compiling
    takes, not the draws). Called with args."""
    if jax.default_backend() == "cpu":
        try:
            return fn.with_options(CHAIN_OPTIONS).executable(*args, max_candidates=max_candidates)
        except jax.errors.JaxRuntimeError:
            pass
    return fn.executable(*args, max_candidates=max_candidates)


class DeviceSampler:
    """A runner's sampling: device copies of the shared inputs, kept per bucket and width."""

    def __init__(self, vocab_size: int, exact: bool):
        self.vocab_size, self.exact = vocab_size, exact
        self._kept: dict[tuple, object] = {}   # (what, T, width) -> device input
        self._last_bias: tuple | None = None   # (T, the rows' bias pairs, their device Sparse)
        self._post_lock = threading.Lock()
        self._post_ready: set[SampleShape] = set()
        self._chains: dict[tuple, object] = {}   # (function, shape) -> its executable
        self._chains_lock = threading.Lock()

    def sample(self, logits: jax.Array, batch: SampleBatch) -> Drawn:
        """Draw batch's rows from `logits` (batch.rows: each row's row there)."""
        T, n, shape = batch.T, batch.n, batch.shape
        if isinstance(logits, np.ndarray):
            logits = jax.device_put(logits)
        # the sampled rows of the logits: often all of them, in order (no copy then)
        same = logits.shape[0] == T and (batch.rows == np.arange(T)).all()
        picked = logits if same else sampler.pick_rows(logits, jax.device_put(batch.rows))
        bias = self._bias(batch.bias, T, shape.bias_width)
        mask = (self._full_mask(T) if batch.mask is None else jax.device_put(batch.mask))
        chain = None   # sample's arguments, for post-sampling probabilities
        if batch.greedy:   # no row parameters, history or DRY
            tokens = _greedy(picked, bias, mask, exact=self.exact)
            new_mu = [i if m is None else m for i, m in zip(batch.initial_mus, batch.mus)]
        else:
            hist = (self._no_history(T, shape.history_width) if batch.history is None
                    else jax.device_put(batch.history))
            chain = (picked, sampler.RowParams(**batch.params), hist, bias, mask,
                     self._dry(batch.dry, T, shape.dry_width), self._count(n))
            tokens, mus = self._chain(sampler.sample_rows, shape, T)(*chain)
            new_mu = [float(m) for m in np.asarray(mus)[:n]]
        entries = self._logprobs(logits, picked, batch, tokens)
        if batch.post_rows:
            entries.update(self._post_sampling(batch, tokens, chain))
        return Drawn([int(t) for t in np.asarray(tokens)[:n]], new_mu, entries)

    def token_logprobs(self, logits: np.ndarray, tokens: list[int]) -> list[float]:
        """The log-probability of tokens[i] under the raw logits row i (one call per row, at
        the 1-row bucket the engine compiled): receipts describe tokens with it."""
        out = []
        for row, token in zip(logits, tokens):
            chosen = sampler.logprobs(jax.device_put(row[None, :].astype(np.float32)),
                                      jax.device_put(np.asarray([token], np.int32)), 1)[0]
            out.append(float(np.asarray(chosen)[0]))
        return out

    def greedy_bias(self, rows: tuple, T: int, shape: SampleShape) -> sampler.Sparse:
        """The bias pairs of a greedy call over `rows` (their Job.bias_pairs, None for none)
        at T rows: the decode-step loop's."""
        return self._bias(None if all(r is None for r in rows) else rows, T, shape.bias_width)

    # --- compiling ------------------------------------------------------------------------

    def compile(self, shape: SampleShape, logit_rows: list[int]) -> None:
        """Compile the draws and log-probabilities at every sampler bucket of `shape`, as
        `sample` calls them (the chain at shape.chain_buckets), and the row
        picks from each size of logits a step returns (logit_rows) into the buckets its rows
        can take (each compiled executable holds about 2 MB)."""
        for B in shape.buckets:
            # (host zeros put on the device: jnp.zeros would compile a program per shape)
            logits = _zeros((B, self.vocab_size), np.float32)
            tokens = _zeros((B,), np.int32)
            if B in shape.chain_buckets:
                self._chain(sampler.sample_rows, shape, B)   # compiled (or loaded) at once
            # logprobs run at the bucket of the rows that ask, picked from the step's logits
            _ready(sampler.logprobs, logits, tokens, MAX_LOGPROBS)
            _ready(_greedy, logits, self._bias(None, B, shape.bias_width), self._full_mask(B),
                   exact=self.exact)
            # the logits a step can return ([R, V]); a step of R rows samples at most R, so
            # it picks into the sampler buckets up to bucket(R) only
            for rows in sorted({1, *logit_rows}):
                if B > shape.bucket(rows):
                    continue
                _ready(sampler.pick_rows, _zeros((rows, self.vocab_size), np.float32),
                       _zeros((B,), np.int32))
            del logits, tokens
            release_memory()

    def prepare_post_sampling(self, shape: SampleShape) -> None:
        """Compile sampler.distribution_rows (post-sampling probabilities) at the chain's
        buckets, once (Engine.prepare_post_sampling)."""
        with self._post_lock:
            if shape in self._post_ready:
                return
            for B in shape.chain_buckets:
                jnp.log(self._chain(sampler.distribution_rows, shape, B)(
                    *self._warm_chain(shape, B))).block_until_ready()
            release_memory()
            self._post_ready.add(shape)

    def _chain(self, fn, shape: SampleShape, B: int):
        """fn (sampler.sample_rows or distribution_rows) compiled once for `shape`'s chain
        at B rows (one of shape.chain_buckets), on CPU with CHAIN_OPTIONS. With
        shape.whole_batch (a GPU's) its whole-batch form (`ON_GPU`), the same bits a row."""
        if shape.whole_batch:
            fn = ON_GPU.get(fn, fn)
        key = (fn, shape, B)
        with self._chains_lock:
            exe = self._chains.get(key)
            if exe is None:
                exe = self._chains[key] = _chain_executable(
                    fn, self._warm_chain(shape, B), shape.max_candidates)
            return exe

    def _warm_chain(self, shape: SampleShape, B: int) -> tuple:
        """sample_rows' arguments at B rows exactly as `sample` passes them (bias and DRY
        pairs at their fixed widths, the DRY spill at [B, V], all B rows counted): its one
        compiled variant."""
        params = row_fields([SamplingParams(temperature=0.8)] * B, [0] * B, [1] * B,
                            [None] * B, n_ctx=shape.n_ctx)
        return (_zeros((B, self.vocab_size), np.float32), sampler.RowParams(**params),
                self._no_history(B, shape.history_width), self._bias(None, B, shape.bias_width),
                self._full_mask(B), self._dry(None, B, shape.dry_width), self._count(B))

    # --- the inputs -----------------------------------------------------------------------

    def _logprobs(self, logits, picked, batch: SampleBatch, tokens) -> dict:
        """The log-probabilities of the rows that ask, computed for those rows alone: over
        `picked` (the sampler's rows, the tokens still on the device) when every row asks
        and `picked` is at their bucket, else over their rows picked from `logits` at
        batch.logprob_bucket (a chain call's 4 rows holding 1: at 1)."""
        rows = batch.logprob_rows
        if not rows:
            return {}
        if len(rows) == batch.n and batch.T == batch.logprob_bucket:   # `picked` already
            lp_logits, lp_tokens = picked, tokens
        else:
            L = batch.logprob_bucket
            at = np.zeros(L, np.int32)
            at[:len(rows)] = batch.rows[list(rows)]
            chosen_tokens = np.full(L, -1, np.int32)
            chosen_tokens[:len(rows)] = np.asarray(tokens)[list(rows)]
            lp_logits = sampler.pick_rows(logits, jax.device_put(at))
            lp_tokens = jax.device_put(chosen_tokens)
        chosen, top_ids, top_lp = (np.asarray(a) for a in
                                   sampler.logprobs(lp_logits, lp_tokens, MAX_LOGPROBS))
        return {r: (float(chosen[j]), top_ids[j], top_lp[j]) for j, r in enumerate(rows)}

    def _post_sampling(self, batch: SampleBatch, tokens, chain) -> dict:
        """Entries for the rows that ask for post-sampling probabilities: the log of the
        distribution each token was drawn from, after the whole chain (-inf for tokens the
        chain dropped). With no chain (every row plain greedy) the draw took the argmax: p 1.
        `distribution` is compiled by prepare_post_sampling, before such a request starts."""
        if chain is None:
            drawn = np.asarray(tokens)
            return {i: (0.0 if drawn[i] >= 0 else float("-inf"), drawn[i:i + 1], np.zeros(1))
                    for i in batch.post_rows}
        logp = jnp.log(self._chain(sampler.distribution_rows, batch.shape, batch.T)(*chain))
        chosen, top_ids, top_lp = (np.asarray(a) for a in
                                   sampler.logprobs(logp, tokens, MAX_LOGPROBS))
        return {i: (float(chosen[i]), top_ids[i], top_lp[i]) for i in batch.post_rows}

    def _bias(self, rows: tuple | None, T: int, width: int) -> sampler.Sparse:
        """The rows' bias pairs at `width` a row (None: none, kept per bucket); the same rows
        as the call before (a stream decoding) reuse its device copy."""
        if rows is None:
            return self._keep(("bias", T, width), lambda: sampler.Sparse(
                *map(jax.device_put, pack_pairs([], T, width))))
        last = self._last_bias
        if last and last[0] == (T, width) and len(last[1]) == len(rows) and all(
                a is b for a, b in zip(last[1], rows)):
            return last[2]
        bias = sampler.Sparse(*map(jax.device_put, pack_pairs(rows, T, width)))
        self._last_bias = ((T, width), rows, bias)
        return bias

    def _dry(self, dry, T: int, width: int) -> sampler.Sparse:
        """DRY pairs and dense spill (sample_batch._dry) on the device; None: none at all."""
        zero = self._keep(("dry", T, width), lambda: sampler.Sparse(
            *map(jax.device_put, pack_pairs([], T, width)),
            _zeros((T, self.vocab_size), np.float32), jax.device_put(np.False_)))
        if dry is None:
            return zero
        ids, values, spill = dry
        if spill is None:
            return sampler.Sparse(jax.device_put(ids), jax.device_put(values), zero.spill,
                                  zero.spilled)
        return sampler.Sparse(jax.device_put(ids), jax.device_put(values),
                              jax.device_put(spill), jax.device_put(np.True_))

    def _no_history(self, T: int, width: int) -> jax.Array:
        """[T, width] of -1: the history of rows without penalties."""
        return self._keep(("history", T, width),
                          lambda: jax.device_put(history_rows([[]] * T, width)))

    def _full_mask(self, T: int) -> jax.Array:
        """The token mask of rows without a grammar: every token allowed."""
        return self._keep(("mask", T, 0),
                          lambda: jax.device_put(full_mask(T, self.vocab_size)))

    def _count(self, n: int) -> jax.Array:
        """n (the rows a chain call has) as an int32 on the device, kept per n."""
        return self._keep(("count", n), lambda: jax.device_put(np.int32(n)))

    def _keep(self, key: tuple, make):
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]
