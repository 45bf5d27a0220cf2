"""The sampler chain as one jitted function over a batch of rows, each with its own parameters.

    sample(logits [B, V], RowParams, history [B, H], bias Sparse [B, W], mask [B, ceil(V/32)],
           dry Sparse [B, W'] (+ spill [B, V]))  -> (tokens [B] int32, new_mu [B] float32)

The engine draws through `sample_rows`, the same chain one row at a time in a loop over the
rows a call has, compiled at one size (kinetic/engine/sample_device.py); `sample` and
`distribution` are the chain over the whole batch at once, with the same per-row results,
and `sample_batch` / `distribution_batch` those with sample_rows' arguments, the chain's form
on a GPU (where a skipped branch or a loop's turn costs a round trip to the host).

Order and meaning follow llama.cpp's default chain: grammar mask, logit bias, repeat penalty
(divide positive logits / multiply negative ones for tokens in the window), presence and
frequency penalties, DRY (precomputed on the host: sampling_params.dry_pairs), top-n-sigma, top-k,
typical-p, top-p, min-p, XTC, temperature, draw. Mirostat 1/2 rows use mask, bias, temperature,
Mirostat. Temperature <= 0 takes the argmax after mask, bias, penalties and DRY.

The logit bias and the DRY penalty are sparse: per row a fixed number W of (token id, value)
pairs (`Sparse`, built on the host by `pack_pairs`), ids unique within a row and -1 where
unused. The device scatters them into a zero [B, V] row and adds (subtracts) that, so the
result is bitwise what a dense [B, V] input with the same entries gives (a dense array is
still accepted, for tests). DRY rows with more penalised tokens than W travel whole in the
Sparse's `spill` [B, V] instead, in the same compiled shape.

Every row's result depends only on that row's inputs: draws are keyed by
fold_in(key(seed), position) (docs/architecture.md, the determinism contract), all reductions
run along a row, and a branch skipped for the whole batch (lax.cond) only skips work that no
row in it needs.

Speed on CPU: a full sort of [16, 152k] logits costs about a second, so nothing sorts the
vocabulary. Rows with 0 < top_k <= K (K = max_candidates, 256, fixed per engine) run the chain
on their top-K candidates (lax.top_k) all at once; rows with top_k <= 0 or > K, and Mirostat
rows, run it over the whole vocabulary one row at a time, so a batch pays only for the rows that
need it. Top-p, typical-p, min_keep (and top-k beyond K) find their cut-off by bisection on the
float bits of the threshold (32 masked sums), and the draw inverts the CDF block by block. Both
paths keep llama.cpp's sets, except that all tokens tied with the one at a cut-off are kept
(llama.cpp's order among ties is unspecified); only top-k within K keeps exactly k, lower ids first.
`distribution` returns the probabilities the draw uses, for tests and post-sampling probabilities.

A row with no allowed token (every logit -inf after mask, bias and penalties) gets token -1,
never NaN; the engine must end that sequence rather than feed -1 to the model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# the host side (numpy, no JAX): the engine's sampling inputs are built there
from kinetic import compile_cache
from kinetic.engine.sample_batch import (MAX_CANDIDATES, full_mask, initial_mu,  # noqa: F401
                                         pack_pairs, penalties_on, plain_greedy, row_fields)
from kinetic.engine.sampling_params import SamplingParams

MIROSTAT_M = 100          # llama.cpp's common sampler builds Mirostat 1 with m = 100
_BLOCK = 256              # inverse-CDF block size over the vocabulary
_NEG = -jnp.inf


@functools.partial(jax.tree_util.register_dataclass, meta_fields=[], data_fields=[
    "temperature", "top_k", "top_p", "min_p", "typical_p", "top_n_sigma", "xtc_probability",
    "xtc_threshold", "repeat_penalty", "presence_penalty", "frequency_penalty", "repeat_last_n",
    "min_keep", "mirostat", "mirostat_tau", "mirostat_eta", "mu", "seed", "position"])
@dataclass(frozen=True)
class RowParams:
    """Per-row sampling parameters, each a [B] array (float32 unless noted).

    top_k, repeat_last_n (already resolved: -1 became the context size), min_keep, mirostat
    and position are int32; seed is uint32. mu is the row's Mirostat state, which the engine
    keeps per sequence and replaces with `sample`'s new_mu after each accepted token.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    typical_p: jax.Array
    top_n_sigma: jax.Array
    xtc_probability: jax.Array
    xtc_threshold: jax.Array
    repeat_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    repeat_last_n: jax.Array
    min_keep: jax.Array
    mirostat: jax.Array
    mirostat_tau: jax.Array
    mirostat_eta: jax.Array
    mu: jax.Array
    seed: jax.Array
    position: jax.Array


def make_row_params(params: Sequence[SamplingParams], seeds: Sequence[int],
                    positions: Sequence[int], mus: Sequence[float | None] | None = None, *,
                    n_ctx: int = 1 << 30, pad_to: int | None = None) -> RowParams:
    """RowParams of numpy [B] arrays from per-row SamplingParams (sample_batch.row_fields,
    which the engine's sampling inputs are built with)."""
    return RowParams(**row_fields(params, seeds, positions, mus, n_ctx=n_ctx, pad_to=pad_to))


class Sparse(NamedTuple):
    """A [B, V] float32 input that is zero but for a few entries per row, as per-row pairs:
    row b holds values[b, j] at token ids[b, j] (int32 [B, W]; ids unique within a row, -1
    where a pair is unused, its value 0) and 0 elsewhere. `spill` [B, V] (with `spilled`, a
    [] bool: whether any row of it is non-zero) holds whole rows that need more than W pairs,
    their pairs all unused, and zeros for the other rows; None where every row fits (the
    logit bias: at most MAX_LOGIT_BIAS + the eog ids, by construction)."""

    ids: jax.Array
    values: jax.Array
    spill: jax.Array | None = None
    spilled: jax.Array | None = None


# --- the jitted chain ------------------------------------------------------------------

@functools.partial(compile_cache.jit, name="pick_rows")
def pick_rows(logits: jax.Array, rows: jax.Array) -> jax.Array:
    """logits[rows] for rows [B] of in-range row indices, as one compiled call (eager
    indexing would dispatch and compile a handful of small programs per shape)."""
    return jnp.take(logits, rows, axis=0, mode="clip")


@functools.partial(compile_cache.jit, name="greedy")
def greedy(logits: jax.Array, bias: Sparse | jax.Array, mask: jax.Array) -> jax.Array:
    """The tokens `sample` draws for rows that are all plain_greedy, at a fraction of its
    cost: the first index of the row maximum after the mask and the bias (-1 if the row
    allows nothing). These are `sample`'s own operations for such rows (_front: x_pen is
    x_bias without penalties or DRY), so the token is the same."""
    x = jnp.where(jnp.isnan(logits), _NEG, logits.astype(jnp.float32))
    x = jnp.where(_unpack_mask(mask, logits.shape[1]), x, _NEG)
    return _argmax(_plus_bias(x, bias))


def _sample(logits: jax.Array, params: RowParams, history: jax.Array, bias: Sparse | jax.Array,
            mask: jax.Array, dry: Sparse | jax.Array | None = None, *,
            max_candidates: int = MAX_CANDIDATES) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row. history holds each row's last H tokens in order, -1 where
    empty (sampling_params.history_rows); bias is logit_bias (bias_pairs as a Sparse, or a
    dense bias_row array); dry is the DRY penalty to subtract (dry_pairs as a Sparse, with a
    spill for rows past its width, or a dense dry_row array; None for none). Returns (tokens,
    new_mu): token -1 marks a row where no token was allowed; new_mu is mu updated for
    Mirostat rows and unchanged for the others."""
    f = _front(logits, params, history, bias, mask, dry, max_candidates)
    p = params
    idx = _draw(f.cand_xt, f.cand_keep, f.u_draw)
    tok = jnp.where(idx >= 0, jnp.take_along_axis(f.cand_ids, jnp.maximum(idx, 0)[:, None], 1)[:, 0], -1)
    tok_full = _per_row(f.full, lambda fr, pr: (_draw(*_full_set(fr, pr), fr.u_draw),),
                        (jnp.int32(-1),), f, p)[0]
    miro = (p.mirostat > 0) & ~f.greedy
    tok_m, mu_m = _per_row(miro, lambda fr, pr: _mirostat_draw(*_mirostat_set(fr, pr), pr, fr.u_draw),
                           (jnp.int32(-1), jnp.float32(0)), f, p)
    tok = jnp.where(f.greedy, f.greedy_tok, jnp.where(miro, tok_m, jnp.where(f.full, tok_full, tok)))
    # greedy Mirostat rows: one candidate left with p = 1, surprise 0, as in llama.cpp's chain
    mu = jnp.where(miro, mu_m, jnp.where((p.mirostat > 0) & f.greedy,
                                         p.mu + p.mirostat_eta * p.mirostat_tau, p.mu))
    return tok, jnp.where(tok >= 0, mu, p.mu)


def _distribution(logits: jax.Array, params: RowParams, history: jax.Array,
                  bias: Sparse | jax.Array, mask: jax.Array,
                  dry: Sparse | jax.Array | None = None, *,
                  max_candidates: int = MAX_CANDIDATES) -> jax.Array:
    """[B, V] float32: the probabilities `sample` draws each row's token from, after the
    whole chain (llama-server's post-sampling probabilities): one-hot for greedy rows, all
    zeros for a row with no allowed token."""
    f = _front(logits, params, history, bias, mask, dry, max_candidates)
    p, (B, V) = params, logits.shape
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], f.cand_ids.shape)
    out = jnp.zeros((B, V), jnp.float32).at[rows, f.cand_ids].set(_probs(f.cand_xt, f.cand_keep))
    zero = (jnp.zeros((V,), jnp.float32),)
    full = _per_row(f.full, lambda fr, pr: (_probs(*_full_set(fr, pr)),), zero, f, p)[0]
    miro = (p.mirostat > 0) & ~f.greedy
    m = _per_row(miro, lambda fr, pr: (_probs(*_mirostat_set(fr, pr)),), zero, f, p)[0]
    onehot = (jnp.arange(V)[None, :] == f.greedy_tok[:, None]).astype(jnp.float32)
    out = jnp.where(f.full[:, None], full, out)
    return jnp.where(f.greedy[:, None], onehot, jnp.where(miro[:, None], m, out))


sample = jax.jit(_sample, static_argnames=("max_candidates",))
distribution = jax.jit(_distribution, static_argnames=("max_candidates",))


def _row_of(i: jax.Array, tree):
    """Row i ([1, ...]) of every [B, ...] array of `tree`; a Sparse's `spilled` (one flag for
    the whole batch) as it is: a row whose spill is zeros subtracts zeros, bit for bit."""
    def row(a):
        return lax.dynamic_index_in_dim(a, i, keepdims=True)
    if isinstance(tree, Sparse):
        return Sparse(row(tree.ids), row(tree.values),
                      None if tree.spill is None else row(tree.spill), tree.spilled)
    return jax.tree.map(row, tree)


@functools.partial(compile_cache.jit, name="sample_rows", static_argnames=("max_candidates",))
def sample_rows(logits: jax.Array, params: RowParams, history: jax.Array,
                bias: Sparse | jax.Array, mask: jax.Array, dry: Sparse | jax.Array | None,
                n: jax.Array, *, max_candidates: int = MAX_CANDIDATES
                ) -> tuple[jax.Array, jax.Array]:
    """`sample` for rows 0..n-1 (n an int32 on the device, at most B), one row at a time in a
    loop: the serving path's chain. One compiled size then serves every count of rows up
    to B and pays for the rows it has, not for its padding; each compiled size of the chain
    holds about 60 MB of code (docs/performance.md), so an engine compiles one. Rows from n
    on get token -1 and keep their mu. A row's draw depends on its own inputs alone."""
    B = logits.shape[0]

    def one(i, carry):
        tokens, mus = carry
        rows = [_row_of(i, a) for a in (logits, params, history, bias, mask, dry)]
        tok, mu = _sample(*rows, max_candidates=max_candidates)
        return tokens.at[i].set(tok[0]), mus.at[i].set(mu[0])

    return lax.fori_loop(0, n, one, (jnp.full((B,), -1, jnp.int32), params.mu))


@functools.partial(compile_cache.jit, name="distribution_rows", static_argnames=("max_candidates",))
def distribution_rows(logits: jax.Array, params: RowParams, history: jax.Array,
                      bias: Sparse | jax.Array, mask: jax.Array, dry: Sparse | jax.Array | None,
                      n: jax.Array, *, max_candidates: int = MAX_CANDIDATES) -> jax.Array:
    """`distribution` for rows 0..n-1 as sample_rows draws them (zeros from row n on)."""
    B, V = logits.shape

    def one(i, out):
        rows = [_row_of(i, a) for a in (logits, params, history, bias, mask, dry)]
        return out.at[i].set(_distribution(*rows, max_candidates=max_candidates)[0])

    return lax.fori_loop(0, n, one, jnp.zeros((B, V), jnp.float32))


@functools.partial(compile_cache.jit, name="sample_batch", static_argnames=("max_candidates",))
def sample_batch(logits: jax.Array, params: RowParams, history: jax.Array,
                 bias: Sparse | jax.Array, mask: jax.Array, dry: Sparse | jax.Array | None,
                 n: jax.Array, *, max_candidates: int = MAX_CANDIDATES
                 ) -> tuple[jax.Array, jax.Array]:
    """sample_rows' result (rows from n on: token -1, mu kept) from `sample` over all B
    rows at once: the same bits for each row (a row's draw depends on its own inputs;
    tests/test_sampler.py compares the two). The chain's form on a GPU
    (sample_device.DeviceSampler): there each branch the chain may skip (lax.cond) and each
    turn of a loop of a traced length reads a flag back to the host before going on, once a
    call here, once a row in sample_rows' loop; rows past n are computed and dropped."""
    tok, mu = _sample(logits, params, history, bias, mask, dry, max_candidates=max_candidates)
    real = jnp.arange(logits.shape[0]) < n
    return jnp.where(real, tok, -1), jnp.where(real, mu, params.mu)


@functools.partial(compile_cache.jit, name="distribution_batch",
                   static_argnames=("max_candidates",))
def distribution_batch(logits: jax.Array, params: RowParams, history: jax.Array,
                       bias: Sparse | jax.Array, mask: jax.Array,
                       dry: Sparse | jax.Array | None, n: jax.Array, *,
                       max_candidates: int = MAX_CANDIDATES) -> jax.Array:
    """distribution_rows' result (zeros from row n on) from `distribution` over all B rows
    at once, as sample_batch draws them."""
    out = _distribution(logits, params, history, bias, mask, dry,
                        max_candidates=max_candidates)
    return jnp.where((jnp.arange(logits.shape[0]) < n)[:, None], out, 0.0)


def _per_row(need: jax.Array, fn, default: tuple, *operands):
    """fn over the rows that need it, one row at a time ([1, ...] slices): these paths scan
    the whole vocabulary dozens of times, so a batch pays only for its rows that use them.
    Returns fn's outputs stacked over all B rows (`default` where not needed)."""
    B = need.shape[0]

    def one(i):
        row = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=True), operands)
        return lax.cond(need[i], lambda: tuple(o[0] for o in fn(*row)), lambda: default)

    return lax.cond(jnp.any(need), lambda: lax.map(one, jnp.arange(B)),
                    lambda: tuple(jnp.broadcast_to(d, (B,) + d.shape) for d in default))


class _Front(NamedTuple):
    x_bias: jax.Array      # [B, V] after mask and logit bias (what Mirostat rows see)
    x_pen: jax.Array       # [B, V] after penalties and DRY
    sig_cut: jax.Array     # [B] top-n-sigma drops logits below this (-inf: off)
    greedy: jax.Array      # [B] temperature <= 0
    greedy_tok: jax.Array  # [B] argmax after penalties and DRY (bias only for Mirostat), or -1
    temp: jax.Array        # [B] temperature, 1 for greedy rows
    u_draw: jax.Array
    u_xtc: jax.Array
    full: jax.Array        # [B] rows whose chain runs over the whole vocabulary
    cand_ids: jax.Array    # [B, K] the other rows' top-K candidates, their temperature-scaled
    cand_xt: jax.Array     #        logits and which of them survive the chain
    cand_keep: jax.Array


def _front(logits, p: RowParams, history, bias, mask, dry, max_candidates: int) -> _Front:
    """Everything before the filters, and the candidate path. Each stage runs only when some
    row needs it (lax.cond); rows that do not need it pass through unchanged, bit for bit."""
    B, V = logits.shape
    K = min(V, max(1, max_candidates))
    x = jnp.where(jnp.isnan(logits), _NEG, logits.astype(jnp.float32))
    x = jnp.where(_unpack_mask(mask, V), x, _NEG)
    x_bias = _plus_bias(x, bias)
    pen_on = (p.repeat_last_n > 0) & ((p.repeat_penalty != 1) | (p.frequency_penalty != 0)
                                      | (p.presence_penalty != 0))
    x_pen = lax.cond(jnp.any(pen_on), lambda: jnp.where(pen_on[:, None], _penalize(x_bias, history, p),
                                                        x_bias), lambda: x_bias)
    x_pen = _minus_dry(x_pen, dry)
    mirostat = p.mirostat > 0
    greedy = p.temperature <= 0
    greedy_tok = _argmax(x_pen)
    miro_greedy = mirostat & greedy   # Mirostat's chain has no penalties
    greedy_tok = jnp.where(miro_greedy, lax.cond(jnp.any(miro_greedy), lambda: _argmax(x_bias),
                                                 lambda: greedy_tok), greedy_tok)
    u_draw, u_xtc = _uniforms(p.seed, p.position)
    temp = jnp.where(greedy, 1.0, p.temperature)
    sig_on = p.top_n_sigma > 0
    cut = lax.cond(jnp.any(sig_on), lambda: _top_n_sigma_cut(x_pen, p.top_n_sigma, sig_on),
                   lambda: jnp.full((B,), _NEG))
    full = ~mirostat & ~greedy & ((p.top_k <= 0) | (p.top_k > K)) & (K < V)
    cand = ~mirostat & ~greedy & ~full

    def candidates():   # rows whose top-k fits in K candidates run the chain on those, exactly
        # value descending, lower id first among ties (barrier: see _mirostat_set)
        cv, ci = lax.optimization_barrier(lax.top_k(_sigma_cut(x_pen, cut), K))
        k_row = jnp.where((p.top_k > 0) & (p.top_k <= K), p.top_k, K)
        keep = (jnp.arange(K)[None, :] < k_row[:, None]) & jnp.isfinite(cv)
        return ci, cv / temp[:, None], _filters(cv, keep, p, u_xtc, cand)

    ci, cxt, ckeep = lax.cond(jnp.any(cand), candidates, lambda: (
        jnp.zeros((B, K), jnp.int32), jnp.zeros((B, K), jnp.float32), jnp.zeros((B, K), bool)))
    return _Front(x_bias, x_pen, cut, greedy, greedy_tok, temp, u_draw, u_xtc, full, ci, cxt, ckeep)


@functools.partial(compile_cache.jit, name="logprobs", static_argnames=("n",))
def logprobs(logits: jax.Array, tokens: jax.Array, n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-softmax of the raw logits (before any sampler, as llama-server reports them):
    (chosen_logprob [B], top_ids [B, n], top_logprobs [B, n]), the top n by descending
    log-probability, lower id first among ties. A token of -1 gets -inf."""
    lp = jax.nn.log_softmax(jnp.where(jnp.isnan(logits), _NEG, logits.astype(jnp.float32)), -1)
    chosen = jnp.take_along_axis(lp, jnp.maximum(tokens, 0)[:, None], 1)[:, 0]
    chosen = jnp.where(tokens >= 0, chosen, _NEG)
    top_lp, top_ids = lax.top_k(lp, n)
    return chosen, top_ids.astype(jnp.int32), top_lp


def _dense(rows: Sparse | jax.Array, V: int) -> jax.Array:
    """[B, V] float32 from a Sparse's pairs (scattered into zeros: ids are unique within a
    row, so each entry is set once, exactly) or a dense array as it is. Ignores `spill`."""
    if not isinstance(rows, Sparse):
        return rows
    B, W = rows.ids.shape
    at = jnp.broadcast_to(jnp.arange(B)[:, None], (B, W))
    ids = jnp.where(rows.ids >= 0, rows.ids, V)   # unused pairs fall outside and are dropped
    return jnp.zeros((B, V), jnp.float32).at[at, ids].set(rows.values.astype(jnp.float32),
                                                          mode="drop")


def _plus_bias(x: jax.Array, bias: Sparse | jax.Array) -> jax.Array:
    """x plus the logit bias, a NaN sum (a ban, -inf, on a +inf logit) read as -inf, as NaN
    logits are: XLA's maximum over a row holding NaN depends on where the NaN falls."""
    y = x + _dense(bias, x.shape[1])
    return jnp.where(jnp.isnan(y), _NEG, y)


def _minus_dry(x: jax.Array, dry: Sparse | jax.Array | None) -> jax.Array:
    """x minus the DRY penalty. x - 0 is x bit for bit, so the parts no row uses (no pair
    set, nothing spilled) are skipped, and a spilled row (all its pairs unused) and a paired
    one (zero spill) each subtract exactly their own dense row, as a dense input would."""
    if dry is None:
        return x
    if not isinstance(dry, Sparse):
        return x - dry
    V = x.shape[1]
    x = lax.cond(jnp.any(dry.ids >= 0), lambda: x - _dense(dry, V), lambda: x)
    if dry.spill is not None:
        x = lax.cond(dry.spilled, lambda: x - dry.spill, lambda: x)
    return x


def _argmax(x: jax.Array) -> jax.Array:
    """First index of the row maximum, -1 if the row is all -inf. (jnp.argmax's variadic
    reduction is 3x slower on CPU than these two plain ones.)"""
    top = jnp.max(x, -1, keepdims=True)
    idx = jnp.min(jnp.where(x == top, jnp.arange(x.shape[1]), x.shape[1]), -1).astype(jnp.int32)
    return jnp.where(jnp.isfinite(top[:, 0]), idx, -1)


def _unpack_mask(mask: jax.Array, V: int) -> jax.Array:
    """[B, V] bool from the bitmask: bit j of word w allows token 32 * w + j. A broadcast
    and shift rather than a gather: XLA may recompute it inside each consumer."""
    B, W = mask.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1   # & 1 undoes the sign fill
    return bits.reshape(B, W * 32)[:, :V].astype(bool)


def _uniforms(seed: jax.Array, position: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two U[0, 1) numbers per row (the draw, XTC's coin), keyed by (seed, position) only."""
    def one(s, pos):
        key = jax.random.fold_in(jax.random.key(s), pos)
        return (jax.random.uniform(jax.random.fold_in(key, 0)),
                jax.random.uniform(jax.random.fold_in(key, 1)))
    return jax.vmap(one)(seed, position)


def _penalize(x: jax.Array, history: jax.Array, p: RowParams) -> jax.Array:
    """Repeat, frequency and presence penalties over the last repeat_last_n tokens of history."""
    B, H = history.shape
    valid = history >= 0
    recency = jnp.cumsum(valid[:, ::-1].astype(jnp.int32), 1)[:, ::-1]   # 1 = most recent
    in_window = (valid & (recency <= p.repeat_last_n[:, None])).astype(jnp.int32)
    rows = jnp.broadcast_to(jnp.arange(B)[:, None], (B, H))
    counts = jnp.zeros(x.shape, jnp.int32).at[rows, jnp.where(valid, history, 0)].add(
        in_window, mode="drop")   # integer adds: exact in any order
    seen = counts > 0
    r = p.repeat_penalty[:, None]
    pen = jnp.where(x <= 0, x * r, x / r)
    pen = pen - (counts.astype(jnp.float32) * p.frequency_penalty[:, None]
                 + seen.astype(jnp.float32) * p.presence_penalty[:, None])
    return jnp.where(seen & jnp.isfinite(x), pen, x)


def _sigma_cut(x: jax.Array, cut: jax.Array) -> jax.Array:
    # applied inside each consumer: a [B, V] array that only some paths need is not written
    return jnp.where(x < cut[:, None], _NEG, x)


def _top_n_sigma_cut(x: jax.Array, n: jax.Array, on: jax.Array) -> jax.Array:
    """[B] logit below which top-n-sigma drops tokens: max - n * std of the finite logits
    (-inf where off, or with a single token)."""
    finite = jnp.isfinite(x)
    cnt = jnp.maximum(jnp.sum(finite, -1), 1)
    mean = jnp.sum(jnp.where(finite, x, 0.0), -1) / cnt
    std = jnp.sqrt(jnp.sum(jnp.where(finite, (x - mean[:, None]) ** 2, 0.0), -1) / cnt)
    cut = jnp.max(x, -1) - n * std
    return jnp.where(on & (x.shape[1] > 1), cut, _NEG)


def _full_set(f: _Front, p: RowParams) -> tuple[jax.Array, jax.Array]:
    """The chain after top-n-sigma over the whole vocabulary, for rows with top_k <= 0 or
    > K: (temperature-scaled logits [B, V], kept [B, V])."""
    x = _sigma_cut(f.x_pen, f.sig_cut)
    keep = jnp.isfinite(x)
    k_on = f.full & (p.top_k > 0) & (p.top_k < x.shape[1])
    t = _kth_largest_key(x, keep, p.top_k, k_on)
    keep = jnp.where(k_on[:, None], keep & (_okey(x) >= t[:, None]), keep)
    keep = _filters(x, keep, p, f.u_xtc, f.full)
    return x / f.temp[:, None], keep


def _filters(x: jax.Array, keep: jax.Array, p: RowParams, u_xtc: jax.Array,
             rows: jax.Array | None = None) -> jax.Array:
    """typical-p, top-p, min-p and XTC over [B, N] logits; `keep` marks the current
    candidates. `rows` limits which rows' settings may trigger the costlier searches."""
    rows = jnp.ones(x.shape[:1], bool) if rows is None else rows
    keep = _typical(x, keep, p.typical_p, p.min_keep, rows & (p.typical_p < 1))
    keep = _top_p(x, keep, p.top_p, p.min_keep, rows & (p.top_p < 1))
    keep = _min_p(x, keep, p.min_p, p.min_keep, rows & (p.min_p > 0))
    return _xtc(x, keep, p, u_xtc)


def _probs(x: jax.Array, keep: jax.Array) -> jax.Array:
    """Softmax over the kept entries; zeros elsewhere, and no NaN when nothing is kept."""
    m = jnp.max(jnp.where(keep, x, _NEG), -1, keepdims=True)
    e = jnp.where(keep, jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    s = jnp.sum(e, -1, keepdims=True)
    return e / jnp.where(s > 0, s, 1.0)


def _typical(x, keep, typ, min_keep, on):
    """Locally typical: the tokens whose surprise is closest to the entropy, fewest first,
    until their mass exceeds typical_p (and at least min_keep of them)."""
    pr = _probs(x, keep)
    pos = keep & (pr > 0)
    logp = jnp.log(jnp.where(pos, pr, 1.0))
    entropy = -jnp.sum(jnp.where(pos, pr * logp, 0.0), -1, keepdims=True)
    score = _okey(jnp.where(pos, jnp.abs(-logp - entropy), jnp.inf))
    need = jnp.maximum(min_keep, 1)[:, None]

    def not_enough(t):   # t is 1 + the key of the largest score taken; 0 takes nothing
        sel = pos & (score < t[:, None])
        return ~((jnp.sum(jnp.where(sel, pr, 0.0), -1) > typ) & (jnp.sum(sel, -1) >= need[:, 0]))
    t = _maybe(on, lambda: _bisect(not_enough, x.shape[0]), x.shape[0])
    return jnp.where(on[:, None], pos & (score <= t[:, None]), keep)


def _top_p(x, keep, top_p, min_keep, on):
    """Nucleus: the likeliest tokens whose mass reaches top_p (and at least min_keep)."""
    pr = _probs(x, keep)
    key = _okey(pr)

    def enough(t):
        sel = keep & (key >= t[:, None])
        return (jnp.sum(jnp.where(sel, pr, 0.0), -1) >= top_p) & (jnp.sum(sel, -1) >= min_keep)
    t = _maybe(on, lambda: _bisect(enough, x.shape[0]), x.shape[0])
    return jnp.where(on[:, None], keep & (key >= t[:, None]), keep)


def _min_p(x, keep, min_p, min_keep, on):
    """Keeps logits >= max + log(min_p) (p >= min_p * p_max); the top min_keep if fewer."""
    top = jnp.max(jnp.where(keep, x, _NEG), -1, keepdims=True)
    sel = keep & (x >= top + jnp.log(jnp.where(min_p > 0, min_p, 1.0))[:, None])
    short = on & (jnp.sum(sel, -1) < min_keep)
    t = _kth_largest_key(x, keep, min_keep, short)
    sel = jnp.where(short[:, None], keep & (_okey(x) >= t[:, None]), sel)
    return jnp.where(on[:, None], sel, keep)


def _xtc(x, keep, p, u):
    """Exclude Top Choices: with probability xtc_probability, drops every token at least
    xtc_threshold likely except the least likely of them (the last in llama.cpp's order)."""
    n = jnp.sum(keep, -1)
    pr = _probs(x, keep)
    above = keep & (pr >= p.xtc_threshold[:, None])
    pos_last = jnp.maximum(jnp.sum(above, -1) - 1, 0)
    on = ((p.xtc_probability > 0) & (p.xtc_threshold <= 0.5) & (n >= 2) & (u <= p.xtc_probability)
          & (pos_last > 0) & (n - pos_last >= p.min_keep))
    low = jnp.min(jnp.where(above, pr, jnp.inf), -1, keepdims=True)
    idx = jnp.arange(x.shape[1])
    # among equal lowest ones the later entry (higher id) is last in (p desc, id asc) order
    last = jnp.max(jnp.where(above & (pr == low), idx, -1), -1, keepdims=True)
    return jnp.where(on[:, None], keep & ~(above & (idx != last)), keep)


def _draw(xt: jax.Array, keep: jax.Array, u: jax.Array) -> jax.Array:
    """Index drawn with probability softmax(xt) over the kept entries; -1 if none is kept."""
    m = jnp.max(jnp.where(keep, xt, _NEG), -1, keepdims=True)
    w = jnp.where(keep, jnp.exp(xt - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    return _inverse_cdf(w, u)


def _inverse_cdf(w: jax.Array, u: jax.Array) -> jax.Array:
    """First index whose running sum of w exceeds u * sum(w), found block by block: a cumsum
    over the whole vocabulary costs tens of milliseconds on CPU, two short ones do not."""
    B, N = w.shape
    blk = min(N, _BLOCK)
    nb = -(-N // blk)
    w3 = jnp.pad(w, ((0, 0), (0, nb * blk - N))).reshape(B, nb, blk)
    cum = jnp.cumsum(jnp.sum(w3, -1), -1)                      # [B, nb]
    total = cum[:, -1]
    target = u * total
    b = jnp.minimum(jnp.sum(cum <= target[:, None], -1), nb - 1)
    before = jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[:, None], 1)[:, 0], 0.0)
    within = jnp.take_along_axis(w3, b[:, None, None], 1)[:, 0]  # [B, blk]
    j = jnp.sum(jnp.cumsum(within, -1) <= (target - before)[:, None], -1)
    # rounding can leave the target past the block's last weight: take the last positive one
    last = jnp.max(jnp.where(w > 0, jnp.arange(N), -1), -1)
    idx = jnp.where(j < blk, b * blk + j, last)
    return jnp.where(total > 0, idx, -1).astype(jnp.int32)


def _mirostat_set(f: _Front, p: RowParams) -> tuple[jax.Array, jax.Array]:
    """Mirostat's candidates after temperature: (scaled logits [B, V], kept [B, V]).

    Mirostat 1 (m = 100) estimates the Zipf exponent s from the top m probabilities and keeps
    the top k = (e * 2^mu / (1 - V^-e))^(1/s), e = s - 1. Mirostat 2 keeps the tokens whose
    surprise -log2 p is at most mu, at least the likeliest one."""
    V = f.x_bias.shape[1]
    xt = f.x_bias / f.temp[:, None]
    finite = jnp.isfinite(xt)
    pr = _probs(xt, finite)
    m = min(MIROSTAT_M, V)
    # the barrier keeps XLA's fast TopK: slicing its output directly makes XLA sort the row
    pc = lax.optimization_barrier(lax.top_k(pr, m)[0])   # the m likeliest, descending
    i = jnp.arange(m - 1, dtype=jnp.float32)
    t_i = jnp.log((i + 2) / (i + 1))
    ok = pc[:, 1:] > 0   # llama.cpp would divide by a zero probability here
    b_i = jnp.log(pc[:, :-1] / jnp.where(ok, pc[:, 1:], 1.0))
    s_hat = jnp.sum(jnp.where(ok, t_i * b_i, 0.0), -1) / jnp.sum(jnp.where(ok, t_i * t_i, 0.0), -1)
    eps = s_hat - 1
    k = jnp.power(eps * jnp.exp2(p.mu) / (1 - jnp.power(jnp.float32(V), -eps)), 1 / s_hat)
    # int(NaN) is undefined in C++; on x86 it gives INT_MIN, which llama.cpp then raises to 1
    k = jnp.where(jnp.isnan(k), 1, jnp.clip(jnp.floor(k), 1, V)).astype(jnp.int32)
    t = _kth_largest_key(xt, finite, k, (p.mirostat == 1) & ~f.greedy)
    keep1 = finite & (_okey(xt) >= t[:, None])
    keep2 = finite & (-jnp.log2(pr) <= p.mu[:, None])
    top = jnp.arange(V) == _argmax(xt)[:, None]
    keep2 = jnp.where(jnp.any(keep2, -1, keepdims=True), keep2, top & finite)
    return xt, jnp.where((p.mirostat == 1)[:, None], keep1, keep2)


def _mirostat_draw(xt, keep, p, u):
    idx = _draw(xt, keep, u)
    chosen = jnp.take_along_axis(_probs(xt, keep), jnp.maximum(idx, 0)[:, None], 1)[:, 0]
    mu = p.mu - p.mirostat_eta * (-jnp.log2(chosen) - p.mirostat_tau)
    return idx, jnp.where(idx >= 0, mu, p.mu)


# --- thresholds by bisection on float bits ------------------------------------------------

def _okey(x: jax.Array) -> jax.Array:
    """uint32 keys in the order of the float32 values (-inf lowest, +inf highest)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _bisect(pred, batch: int) -> jax.Array:
    """Per row, the largest uint32 t with pred(t) true, for pred true up to some t and false
    after (pred(0) is taken as true, pred(2**32 - 1) as false). 32 steps, each one masked
    reduction per row."""
    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
    lo = jnp.zeros((batch,), jnp.uint32)
    hi = jnp.full((batch,), 0xFFFFFFFF, jnp.uint32)
    return lax.fori_loop(0, 32, step, (lo, hi))[0]


def _maybe(on: jax.Array, fn, batch: int) -> jax.Array:
    """fn() when some row needs it; skipping it changes no row's result, only the work done."""
    return lax.cond(jnp.any(on), fn, lambda: jnp.zeros((batch,), jnp.uint32))


def _kth_largest_key(x, keep, k, on):
    """Key of the k-th largest kept value per row (0, keeping all, when fewer than k)."""
    key = _okey(x)
    return _maybe(on, lambda: _bisect(
        lambda t: jnp.sum(keep & (key >= t[:, None]), -1) >= k, x.shape[0]), x.shape[0])
