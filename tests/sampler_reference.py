"""A plain numpy reference of llama.cpp's sampler chain, one row at a time.

Written from the definitions in llama.cpp's src/llama-sampling.cpp and common/sampling.cpp
(default chain: logit bias, penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC,
temperature, dist; Mirostat: logit bias, temperature, mirostat). It works like llama.cpp, on a
list of candidates that each sampler sorts and shortens, in float32 where llama.cpp uses float.

Two choices kinetic makes where llama.cpp leaves things unspecified, mirrored here:
- candidates at -inf (banned by bias or mask, or cut by top-n-sigma) leave the list at once
  (llama.cpp keeps them with p = 0, which only changes min_keep counts, and makes typical-p's
  entropy NaN);
- sorts are stable: equal logits keep ascending token ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from kinetic.engine.sampling_params import SamplingParams

F = np.float32


class Cands:
    """llama_token_data_array: ids and logits, shortened and reordered by each sampler."""

    def __init__(self, ids: np.ndarray, logits: np.ndarray):
        self.ids = np.asarray(ids, np.int64)
        self.logits = np.asarray(logits, F)

    def take(self, order) -> None:
        self.ids, self.logits = self.ids[order], self.logits[order]

    def drop_neg_inf(self) -> None:
        self.take(np.isfinite(self.logits))

    def sort_desc(self) -> None:
        self.take(np.lexsort((self.ids, -self.logits)))

    def probs(self) -> np.ndarray:
        e = np.exp(self.logits - self.logits.max()).astype(F)
        return (e / e.sum(dtype=F)).astype(F)


def penalize(logits: np.ndarray, history: Sequence[int], p: SamplingParams, n_ctx: int) -> np.ndarray:
    last_n = n_ctx if p.repeat_last_n == -1 else p.repeat_last_n
    out = logits.astype(F).copy()
    window = list(history)[-last_n:] if last_n > 0 else []
    for tok in set(window):
        count = window.count(tok)
        if not np.isfinite(out[tok]):
            continue
        out[tok] = out[tok] * F(p.repeat_penalty) if out[tok] <= 0 else out[tok] / F(p.repeat_penalty)
        out[tok] -= F(count * p.frequency_penalty + p.presence_penalty)
    return out


def top_n_sigma(c: Cands, n: float) -> None:
    if n <= 0 or len(c.ids) <= 1:
        return
    x = c.logits[np.isfinite(c.logits)]
    mean = x.mean(dtype=F)
    std = math.sqrt(float(((x - mean) ** 2).mean()))
    c.logits = np.where(c.logits < x.max() - n * std, -np.inf, c.logits).astype(F)
    c.drop_neg_inf()


def top_k(c: Cands, k: int) -> None:
    if k <= 0:
        return
    c.sort_desc()
    c.take(slice(0, min(k, len(c.ids))))


def typical(c: Cands, typ: float, min_keep: int) -> None:
    if typ >= 1:
        return
    c.sort_desc()
    pr = c.probs()
    entropy = -np.sum(pr * np.log(pr))
    scores = np.abs(-np.log(pr) - entropy)
    order = np.argsort(scores, kind="stable")
    cum, last = 0.0, len(order)
    for i, j in enumerate(order):
        cum += pr[j]
        if cum > typ and (min_keep == 0 or i >= min_keep - 1):
            last = i + 1
            break
    c.take(order[:last])


def top_p(c: Cands, p: float, min_keep: int) -> None:
    if p >= 1:
        return
    c.sort_desc()
    pr = c.probs()
    cum, last = 0.0, len(pr)
    for i in range(len(pr)):
        cum += pr[i]
        if cum >= p and i + 1 >= min_keep:
            last = i + 1
            break
    c.take(slice(0, last))


def min_p(c: Cands, p: float, min_keep: int) -> None:
    if p <= 0 or not len(c.ids):
        return
    c.sort_desc()
    min_logit = c.logits[0] + F(math.log(p))
    n = int(np.sum(c.logits >= min_logit))
    c.take(slice(0, max(n, min(min_keep, len(c.ids)))))


def xtc(c: Cands, probability: float, threshold: float, min_keep: int, coin: float) -> None:
    if probability <= 0 or threshold > 0.5 or len(c.ids) < 2 or coin > probability:
        return
    c.sort_desc()
    pr = c.probs()
    pos_last = 0
    for i in range(len(pr)):
        if pr[i] >= threshold:
            pos_last = i
        else:
            break
    if len(pr) - pos_last >= min_keep and pos_last > 0:
        c.take(slice(pos_last, None))


def chain(logits: np.ndarray, p: SamplingParams, history: Sequence[int] = (), bias=None, dry=None,
          allowed=None, mu: float | None = None, xtc_coin: float = 0.0, n_ctx: int = 1 << 30):
    """One row through the chain. Returns (probs [V] that the draw uses, or a one-hot for
    greedy; all zeros when nothing is allowed) and, for Mirostat, a function token -> new mu."""
    V = len(logits)
    x = np.asarray(logits, F).copy()
    if allowed is not None:
        x = np.where(allowed, x, -np.inf).astype(F)
    if bias is not None:
        x = (x + np.asarray(bias, F)).astype(F)
    if p.mirostat == 0:
        x = penalize(x, history, p, n_ctx)
        if dry is not None:
            x = (x - np.asarray(dry, F)).astype(F)
    out = np.zeros(V, F)
    if not np.isfinite(x).any():
        return out, None
    if p.temperature <= 0:
        out[int(np.argmax(x))] = 1
        return out, None
    c = Cands(np.arange(V), x)
    c.drop_neg_inf()
    if p.mirostat:
        c.logits = (c.logits / F(p.temperature)).astype(F)
        mu = 2 * p.mirostat_tau if mu is None else mu
        (mirostat1 if p.mirostat == 1 else mirostat2)(c, mu, V)
        pr = c.probs()
        out[c.ids] = pr
        return out, lambda tok: mu - p.mirostat_eta * (-math.log2(out[tok]) - p.mirostat_tau)
    top_n_sigma(c, p.top_n_sigma)
    top_k(c, p.top_k)
    typical(c, p.typical_p, p.min_keep)
    top_p(c, p.top_p, p.min_keep)
    min_p(c, p.min_p, p.min_keep)
    xtc(c, p.xtc_probability, p.xtc_threshold, p.min_keep, xtc_coin)
    c.logits = (c.logits / F(p.temperature)).astype(F)
    out[c.ids] = c.probs()
    return out, None


def mirostat1(c: Cands, mu: float, n_vocab: int, m: int = 100) -> None:
    c.sort_desc()
    pr = c.probs()
    num = den = 0.0
    for i in range(min(m - 1, len(pr) - 1)):
        t = math.log((i + 2) / (i + 1))
        b = math.log(pr[i] / pr[i + 1])
        num += t * b
        den += t * t
    s_hat = num / den
    eps = s_hat - 1
    k = ((eps * 2 ** mu) / (1 - n_vocab ** -eps)) ** (1 / s_hat)
    c.take(slice(0, min(max(int(k), 1), len(pr))))


def mirostat2(c: Cands, mu: float, n_vocab: int) -> None:
    c.sort_desc()
    pr = c.probs()
    n = 0
    while n < len(pr) and -math.log2(pr[n]) <= mu:
        n += 1
    c.take(slice(0, max(n, 1)))


def dry_naive(tokens: Sequence[int], p: SamplingParams, single: set[int],
              breaker_seqs: Sequence[Sequence[int]], vocab_size: int, n_ctx: int = 1 << 30) -> np.ndarray:
    """DRY by its definition, in O(n^2): for each earlier place where the sequence's last L
    tokens occur again (L capped by the distance back to the last breaker), the token that
    followed them would extend the repeat; the longest L per token sets its penalty."""
    out = np.zeros(vocab_size, F)
    last_n = n_ctx if p.dry_penalty_last_n == -1 else p.dry_penalty_last_n
    if p.dry_multiplier == 0 or last_n == 0:
        return out
    seq = list(tokens)[-min(last_n, n_ctx):]
    n = len(seq)
    if n <= p.dry_allowed_length:
        return out
    limit = n
    for start in range(n - 1, -1, -1):   # the breaker occurrence that starts last bounds repeats
        hit = [len(b) for b in breaker_seqs if list(seq[start:start + len(b)]) == list(b)
               and start + len(b) <= n]
        if hit:
            limit = n - start - max(hit)   # tokens after the end of that occurrence
            break
    if limit < p.dry_allowed_length:
        return out
    best: dict[int, int] = {}
    for j in range(n - 1):   # an earlier occurrence ends at j; seq[j + 1] followed it
        length = 0
        while length <= j and seq[j - length] == seq[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= p.dry_allowed_length:
            best[seq[j + 1]] = max(best.get(seq[j + 1], 0), length)
    for tok, length in best.items():
        if tok not in single:
            out[tok] = p.dry_multiplier * p.dry_base ** (length - p.dry_allowed_length)
    return out
