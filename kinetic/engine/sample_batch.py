"""Sampling inputs on the host: what each call of the sampler takes, in numpy, no JAX.

Serving and receipt verification build their sampling inputs here, through the same two
functions, so that a verified token is drawn from the inputs serving drew it from by
construction, not by two copies kept in step:

    sample_row(job, logit_row, position, history, mask, shape) -> SampleRow
        one row to draw: its request's parameters, seed and Mirostat state (the Job), its
        bias and DRY pairs, its grammar's token bitmask, its penalty history;
    sample_batches(rows, shape) -> [SampleBatch]
        the rows as sampler calls: all in one call when every row is plain greedy, else
        shape.chain_size a call (SAMPLE_CHUNK, on a GPU GPU_SAMPLE_CHUNK), a greedy call
        at the smallest sampler bucket that holds it, a chain call at the chain's one
        compiled size (on a GPU the smallest bucket too: SampleShape.chain_buckets).

The engine's turn (engine/turn.py) makes a row for every sampled row of a step; receipt
verification (receipts/verify.py) makes one row per output position of the receipt's answer.
`Runner.sample` (engine/sample_device.py) turns a SampleBatch into device arrays and draws.
A row's draw depends on that row's inputs alone (tests/test_invariance.py), so how rows are
grouped into calls changes no bit. The module imports no JAX (tests/test_sample_batch.py
checks it in a subprocess, as test_scheduler.py does for the scheduler).

The widths are fixed per engine (SampleShape), so the sampler compiles once per bucket,
whatever a request asks: bias pairs (MAX_LOGIT_BIAS + the eog ids), DRY pairs (DRY_WIDTH,
the rest of a row in a dense spill), the penalties' history (HISTORY_WIDTH).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kinetic.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams, history_rows

MAX_CANDIDATES = 256   # the top candidates the sampler's chain runs on (sampler.sample)
HISTORY_WIDTH = 4096   # the penalties' window holds at most the last this many tokens
# (token id, bias) pairs per sampled row: a request's logit_bias names at most MAX_LOGIT_BIAS
# distinct tokens (SamplingParams refuses more) and ignore_eos adds the eog ids; a tokenizer
# with more than 64 eog ids widens it to hold them all (SampleShape.of)
BIAS_WIDTH = MAX_LOGIT_BIAS + 64
# DRY (token id, penalty) pairs per sampled row. A row's penalised tokens are the distinct ones
# that followed an earlier occurrence of its last dry_allowed_length tokens (sampling_params.
# dry_pairs): a handful in ordinary text, but up to every distinct token of the DRY window
# (allowed_length 0, a crafted prompt), so no width short of min(V, window) always holds them.
# A row with more than this travels whole in the dense spill, in the same compiled shape; the
# bits are the same either way.
DRY_WIDTH = 256
# most rows one call of the sampler's chain takes; more sample in chunks of it (a row's draw
# does not depend on the rows beside it). The chain is compiled at one size, the bucket of
# this many rows, and loops over the rows it has (sampler.sample_rows): each compiled size
# of it holds 35-70 MB of code (docs/performance.md)
SAMPLE_CHUNK = 4
# the same on a GPU (SampleShape.whole_batch: Runner.sample_shape), where the chain draws
# all of a call's rows at once (sampler.sample_batch) and each call reads about ten flags
# back to the host (one a branch it may skip): 256 sampled streams are 4 calls a step at 64
# rows, not 64 at 4. Its [64, V] float32 intermediates are 39 MB each at 151,936 tokens
# (185 MiB of temporaries in all, XLA's memory analysis of the compile for an H200).
GPU_SAMPLE_CHUNK = 64

Pairs = tuple[np.ndarray, np.ndarray]   # (token ids int32, values float32), one row's


@dataclass(frozen=True)
class SampleShape:
    """What is fixed about an engine's sampler calls: one compiled shape per bucket."""

    vocab_size: int
    n_ctx: int                    # a row's context (repeat_last_n -1, DRY's window)
    buckets: tuple[int, ...]      # the batch sizes the sampler runs at (sample_buckets)
    bias_width: int = BIAS_WIDTH
    history_width: int = HISTORY_WIDTH
    dry_width: int = DRY_WIDTH
    max_candidates: int = MAX_CANDIDATES
    chain_rows: int = SAMPLE_CHUNK   # most rows one call of the chain takes
    # the chain draws a call's rows all at once (sampler.sample_batch: on a GPU), paying
    # for every row of its bucket, so it runs at each bucket up to chain_bucket; else it
    # loops over the rows it has (sampler.sample_rows) at chain_bucket alone
    whole_batch: bool = False

    @classmethod
    def of(cls, vocab_size: int, n_ctx: int, row_buckets: Sequence[int],
           eog_ids: Sequence[int], whole_batch: bool = False) -> "SampleShape":
        """An engine's: its step's row buckets, its tokenizer's eog ids (bias pairs hold
        MAX_LOGIT_BIAS + all of them: every request fits), whether the chain draws a call's
        rows at once (a GPU's: GPU_SAMPLE_CHUNK rows a call, else SAMPLE_CHUNK)."""
        eog = sum(1 for t in eog_ids if 0 <= t < vocab_size)
        return cls(vocab_size, n_ctx, tuple(sample_buckets(row_buckets)),
                   bias_width=max(BIAS_WIDTH, MAX_LOGIT_BIAS + eog),
                   history_width=min(HISTORY_WIDTH, n_ctx),
                   chain_rows=GPU_SAMPLE_CHUNK if whole_batch else SAMPLE_CHUNK,
                   whole_batch=whole_batch)

    def bucket(self, n: int) -> int:
        """Rows of the compiled sampler that holds n rows."""
        return next(b for b in self.buckets if b >= n)

    @property
    def chain_size(self) -> int:
        """Most rows one call of the chain takes: chain_rows, or the largest bucket where
        that is smaller (an engine of one row a step samples one a call)."""
        return min(self.chain_rows, self.buckets[-1])

    @property
    def chain_bucket(self) -> int:
        """The largest size the chain runs at, the bucket that holds chain_size rows (with
        XLA's kernel, whose steps run at T rows only, T): the only one for sampler.
        sample_rows, a loop over its rows, where fewer rows pay only for themselves; on a
        GPU sample_batch, which pays for its bucket's rows, runs at chain_buckets."""
        return self.bucket(self.chain_size)

    @property
    def chain_buckets(self) -> tuple[int, ...]:
        """The sizes the chain is compiled at: chain_bucket; with whole_batch every bucket
        from the one holding SAMPLE_CHUNK rows up to it (on a GPU fewer rows than that cost
        no less: the chain's passes are launches, not bytes; each size compiled is seconds
        of start-up)."""
        top = self.chain_bucket
        if not self.whole_batch:
            return (top,)
        return tuple(b for b in self.buckets if self.chain_bucket_for(1) <= b <= top)

    def chain_bucket_for(self, n: int) -> int:
        """The size a chain call of n rows (at most chain_size) runs at."""
        if not self.whole_batch:
            return self.chain_bucket
        return self.bucket(max(n, min(SAMPLE_CHUNK, self.chain_size)))

    @property
    def mask_words(self) -> int:
        return -(-self.vocab_size // 32)


def sample_buckets(row_buckets: Sequence[int]) -> list[int]:
    """Rows of the compiled greedy draw, log-probabilities and bitmasks: every other row
    bucket of the step (1, 4, 16, 64, ...) and the largest. Each compiled size holds MBs of
    code, and sampling a few padding rows costs less than that."""
    keep = [b for b in row_buckets if (b.bit_length() - 1) % 2 == 0]   # 1, 4, 16, ...
    return keep if keep[-1:] == list(row_buckets[-1:]) else keep + list(row_buckets[-1:])


def penalties_on(p: SamplingParams) -> bool:
    """Whether the repeat, frequency or presence penalty changes this request's logits (the
    history the sampler reads is then needed)."""
    return p.repeat_last_n != 0 and (p.repeat_penalty != 1 or p.frequency_penalty != 0
                                     or p.presence_penalty != 0)


def plain_greedy(p: SamplingParams) -> bool:
    """Whether the greedy draw (sampler.greedy, or one C++ pass: native.row_argmax) gives this
    request's token: greedy, no penalties, no DRY, no Mirostat (whose greedy rows still update
    mu)."""
    return p.temperature <= 0 and p.mirostat == 0 and p.dry_multiplier <= 0 and not penalties_on(p)


def initial_mu(params: SamplingParams) -> float:
    """Mirostat's starting state, 2 * tau, as llama.cpp sets it."""
    return 2.0 * params.mirostat_tau


def pack_pairs(rows: Sequence[Pairs | None], batch: int,
               width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [batch, width], values float32 [batch, width]) from per-row (ids, values)
    pairs (sampling_params.bias_pairs, dry_pairs; None for none), -1 / 0 padded; rows past
    len(rows) are empty. Raises ValueError for a row of more than `width` pairs."""
    ids = np.full((batch, width), -1, np.int32)
    values = np.zeros((batch, width), np.float32)
    for i, row in enumerate(rows):
        if row is None:
            continue
        n = len(row[0])
        if n > width:
            raise ValueError(f"row {i} has {n} (token, value) pairs; the sampler takes {width}")
        ids[i, :n], values[i, :n] = row
    return ids, values


def full_mask(batch: int, vocab_size: int) -> np.ndarray:
    """[B, ceil(V/32)] int32 bitmask allowing every token (bit t % 32 of word t // 32)."""
    return np.full((batch, -(-vocab_size // 32)), -1, np.int32)


_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability",
                 "xtc_threshold", "repeat_penalty", "presence_penalty", "frequency_penalty",
                 "mirostat_tau", "mirostat_eta")
_INT_FIELDS = ("top_k", "min_keep", "mirostat")


def row_fields(params: Sequence[SamplingParams], seeds: Sequence[int],
               positions: Sequence[int], mus: Sequence[float | None] | None = None, *,
               n_ctx: int = 1 << 30, pad_to: int | None = None) -> dict[str, np.ndarray]:
    """The sampler's per-row parameters (sampler.RowParams' fields) as numpy [B] arrays:
    seeds are the resolved seeds (taken mod 2**32); positions the sequence positions the
    drawn tokens will occupy; a mu of None starts Mirostat at 2 * tau; repeat_last_n -1
    becomes n_ctx. pad_to appends greedy filler rows up to a fixed batch size."""
    if not len(params) == len(seeds) == len(positions):
        raise ValueError("params, seeds and positions must have one entry per row")
    mus = [None] * len(params) if mus is None else list(mus)
    if len(mus) != len(params):
        raise ValueError("mus must have one entry per row")
    pad = 0 if pad_to is None else pad_to - len(params)
    if pad < 0:
        raise ValueError(f"pad_to={pad_to} is smaller than the {len(params)} rows")
    rows = list(params) + [SamplingParams(temperature=0.0)] * pad
    out = {name: np.asarray([getattr(p, name) for p in rows], np.float32)
           for name in _FLOAT_FIELDS}
    out.update({name: np.asarray([getattr(p, name) for p in rows], np.int32)
                for name in _INT_FIELDS})
    out["repeat_last_n"] = np.asarray([n_ctx if p.repeat_last_n == -1 else p.repeat_last_n
                                       for p in rows[:len(params)]]
                                      + [p.repeat_last_n for p in rows[len(params):]], np.int32)
    out["mu"] = np.asarray([initial_mu(p) if mu is None else mu
                            for p, mu in zip(params, mus)] + [0.0] * pad, np.float32)
    out["seed"] = np.asarray([int(s) & 0xFFFFFFFF for s in seeds] + [0] * pad, np.uint32)
    out["position"] = np.asarray([int(x) for x in positions] + [0] * pad, np.int32)
    return out


@dataclass(frozen=True)
class SampleRow:
    """One row to draw a token for, as sample_row makes it from its request's Job."""

    logit_row: int                 # its row of the logits the caller passes to Runner.sample
    params: SamplingParams
    seed: int
    position: int                  # the index the drawn token will take
    mu: float | None               # Mirostat's state (None: not started)
    history: Sequence[int]         # the tokens before `position` (empty unless penalties)
    bias: Pairs | None             # logit_bias and ignore_eos bans (Job.bias_pairs)
    dry: Pairs | None              # DRY penalties (None: no DRY)
    mask: np.ndarray | None        # the grammar's bitmask words (None: every token allowed)
    logprobs: bool                 # wants log-probabilities of the raw logits
    post_sampling: bool            # wants them of the distribution drawn from instead


def sample_row(job, logit_row: int, position: int, history: Iterable[int],
               mask: np.ndarray | None, shape: SampleShape) -> SampleRow:
    """The row of `job` (engine.job.Job: its request, seed, Mirostat state, pairs) drawing
    the token at `position`, after `history` (its sequence's tokens before it, drafts
    included; read only for penalties and DRY), within `mask` (None: no grammar)."""
    request = job.request
    p = request.params
    needs_history = penalties_on(p) or p.dry_multiplier > 0
    history = list(history) if needs_history else ()
    return SampleRow(
        logit_row, p, job.seed, position, job.mu, history, job.bias_pairs(shape.vocab_size),
        job.dry_pairs(history, shape.vocab_size, shape.n_ctx) if p.dry_multiplier > 0 else None,
        mask, request.logprobs is not None and not request.post_sampling,
        request.post_sampling)


@dataclass(frozen=True)
class SampleBatch:
    """One call of the sampler, on the host: rows 0..n of a bucket of T (the rest padding).

    None stands for an input that is the same for every row of the bucket (no bias, every
    token allowed, no penalties, no DRY): the runner keeps those on the device."""

    shape: SampleShape
    n: int
    T: int
    rows: np.ndarray               # [T] int32: each row's row of the caller's logits
    greedy: bool                   # every row plain greedy: the greedy draw, not the chain
    params: dict[str, np.ndarray] | None     # row_fields at T (None when greedy)
    bias: tuple | None              # each row's bias pairs (Job.bias_pairs: one object per
                                    # request, so the runner reuses a stream's device copy)
    mask: np.ndarray | None                             # [T, ceil(V/32)] words
    history: np.ndarray | None                          # [T, history_width]
    dry: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None   # pairs, dense spill
    logprob_rows: tuple[int, ...]   # rows wanting log-probabilities of the raw logits
    logprob_bucket: int             # the sampler bucket those rows run at
    post_rows: tuple[int, ...]      # rows wanting post-sampling probabilities
    mus: tuple                      # each row's Mirostat state going in (None: not started)
    initial_mus: tuple[float, ...]  # each row's initial_mu (a greedy draw leaves mu there)


def sample_batches(rows: Sequence[SampleRow], shape: SampleShape) -> list[SampleBatch]:
    """The rows as sampler calls, in order: one call when every row is plain greedy, else
    shape.chain_size rows a call."""
    size = len(rows) if all(plain_greedy(r.params) for r in rows) else shape.chain_size
    return [_batch(rows[lo:lo + size], shape) for lo in range(0, len(rows), size)]


def _batch(rows: Sequence[SampleRow], shape: SampleShape) -> SampleBatch:
    greedy = all(plain_greedy(r.params) for r in rows)
    n = len(rows)
    T = shape.bucket(n) if greedy else shape.chain_bucket_for(n)
    idx = np.zeros(T, np.int32)
    idx[:n] = [r.logit_row for r in rows]
    bias = tuple(r.bias for r in rows)
    mask = None
    if any(r.mask is not None for r in rows):
        mask = full_mask(T, shape.vocab_size)
        for i, r in enumerate(rows):
            if r.mask is not None:
                mask[i] = r.mask
    params = history = dry = None
    if not greedy:
        params = row_fields([r.params for r in rows], [r.seed for r in rows],
                            [r.position for r in rows], [r.mu for r in rows],
                            n_ctx=shape.n_ctx, pad_to=T)
        if any(penalties_on(r.params) for r in rows):
            history = history_rows([r.history for r in rows] + [[]] * (T - n),
                                   shape.history_width)
        if any(r.dry is not None for r in rows):
            dry = _dry(rows, T, shape)
    lp = tuple(i for i, r in enumerate(rows) if r.logprobs)
    return SampleBatch(
        shape, n, T, idx, greedy, params, None if all(b is None for b in bias) else bias, mask,
        history, dry, lp,
        shape.bucket(max(len(lp), 1)),
        tuple(i for i, r in enumerate(rows) if r.post_sampling),
        tuple(r.mu for r in rows), tuple(initial_mu(r.params) for r in rows))


def _dry(rows: Sequence[SampleRow], T: int, shape: SampleShape):
    """The rows' DRY penalties: dry_width pairs a row, a row with more whole in the dense
    spill [T, V] (None when no row has more)."""
    over = [i for i, r in enumerate(rows) if r.dry is not None and len(r.dry[0]) > shape.dry_width]
    ids, values = pack_pairs([None if i in over else r.dry for i, r in enumerate(rows)], T,
                             shape.dry_width)
    spill = None
    if over:
        spill = np.zeros((T, shape.vocab_size), np.float32)
        for i in over:
            spill[i, rows[i].dry[0]] = rows[i].dry[1]
    return ids, values, spill

