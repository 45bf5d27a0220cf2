"""The jitted sampler chain against the numpy reference (tests/sampler_reference.py), its
determinism contract, and the host-side rows (SamplingParams, bias, history, DRY)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import tests.sampler_reference as ref
from kinetic.engine.sampler import (Sparse, _uniforms, distribution, distribution_batch,
                                    distribution_rows, full_mask, greedy, logprobs,
                                    make_row_params, pack_pairs, sample, sample_batch,
                                    sample_rows)
from kinetic.engine.sampling_params import (MAX_LOGIT_BIAS, DryBreakers, SamplingParams, bias_pairs,
                                            bias_row, dry_pairs, dry_row, from_gguf_defaults,
                                            history_rows)

V, B, H = 32, 8, 16
RNG = np.random.default_rng(1234)
LOGITS = (RNG.standard_normal((B, V)) * 2.5).astype(np.float32)
HISTORIES = [list(RNG.integers(0, V, size=n)) for n in (0, 1, 5, 9, 16, 3, 12, 7)]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]
POSITIONS = [3, 14, 15, 92, 65, 35, 89, 79]
PLAIN = dict(top_k=0, top_p=1.0, min_p=0.0)   # no filter: the draw sees the whole softmax


def run(params, logits=LOGITS, histories=HISTORIES, bias=None, dry=None, mask=None, k=256,
        seeds=SEEDS, positions=POSITIONS, mus=None):
    """(tokens, new_mu, distribution) for the rows of `params`, padded to the batch size."""
    n, vocab = len(params), logits.shape[1]
    batch = max(B, n)
    rows = make_row_params(params, seeds[:n], positions[:n], mus, pad_to=batch)
    pad = lambda a, fill=0: np.concatenate([a, np.full((batch - n,) + a.shape[1:], fill, a.dtype)])
    lg = pad(np.asarray(logits[:n], np.float32))
    hist = history_rows(list(histories[:n]) + [[]] * (batch - n), H)
    bias = pad(np.zeros((n, vocab), np.float32) if bias is None else np.asarray(bias, np.float32))
    dry = pad(np.zeros((n, vocab), np.float32) if dry is None else np.asarray(dry, np.float32))
    mask = full_mask(batch, vocab) if mask is None else pad(mask, -1)
    tok, mu = sample(lg, rows, hist, bias, mask, dry, max_candidates=k)
    dist = distribution(lg, rows, hist, bias, mask, dry, max_candidates=k)
    # the engine's chain (one row at a time, the rows counted) draws the same, bit for bit
    count = np.int32(n)
    tok_r, mu_r = sample_rows(lg, rows, hist, bias, mask, dry, count, max_candidates=k)
    dist_r = distribution_rows(lg, rows, hist, bias, mask, dry, count, max_candidates=k)
    np.testing.assert_array_equal(np.asarray(tok_r)[:n], np.asarray(tok)[:n])
    np.testing.assert_array_equal(np.asarray(mu_r)[:n].view(np.uint32),
                                  np.asarray(mu)[:n].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(dist_r)[:n].view(np.uint32),
                                  np.asarray(dist)[:n].view(np.uint32))
    # and the chain's form on a GPU (all rows at once, sample_rows' arguments): the same
    # bits for every row, those past the count too (-1, mu kept, zeros)
    tok_b, mu_b = sample_batch(lg, rows, hist, bias, mask, dry, count, max_candidates=k)
    dist_b = distribution_batch(lg, rows, hist, bias, mask, dry, count, max_candidates=k)
    np.testing.assert_array_equal(np.asarray(tok_b), np.asarray(tok_r))
    np.testing.assert_array_equal(np.asarray(mu_b).view(np.uint32),
                                  np.asarray(mu_r).view(np.uint32))
    np.testing.assert_array_equal(np.asarray(dist_b).view(np.uint32),
                                  np.asarray(dist_r).view(np.uint32))
    return np.asarray(tok)[:n], np.asarray(mu)[:n], np.asarray(dist)[:n]


def coins(n=B):
    return np.asarray(_uniforms(np.asarray(SEEDS[:n], np.uint32), np.asarray(POSITIONS[:n], np.int32))[1])


CONFIGS = {
    "defaults": {},
    "top_k_-1": dict(PLAIN, top_k=-1),
    "top_k_0": dict(PLAIN),
    "top_k_1": dict(PLAIN, top_k=1),
    "top_k_3": dict(PLAIN, top_k=3),
    "top_k_7": dict(top_k=7, top_p=1.0, min_p=0.0),
    "top_k_over_V": dict(PLAIN, top_k=100),
    "top_p_1": dict(PLAIN, top_p=1.0),
    "top_p_half": dict(PLAIN, top_p=0.5),
    "top_p_tiny": dict(PLAIN, top_p=1e-6),
    "top_p_tiny_min_keep": dict(PLAIN, top_p=1e-6, min_keep=3),
    "min_p_0": dict(PLAIN, min_p=0.0),
    "min_p_0.3": dict(PLAIN, min_p=0.3),
    "min_p_0.9_min_keep": dict(PLAIN, min_p=0.9, min_keep=4),
    "typical_1": dict(PLAIN, typical_p=1.0),
    "typical_0.5": dict(PLAIN, typical_p=0.5),
    "typical_0.9_top_k": dict(top_k=12, typical_p=0.9, top_p=1.0, min_p=0.0),
    "typical_0.2_min_keep": dict(PLAIN, typical_p=0.2, min_keep=5),
    "top_n_sigma_-1": dict(PLAIN, top_n_sigma=-1.0),
    "top_n_sigma_1": dict(PLAIN, top_n_sigma=1.0),
    "top_n_sigma_0.3": dict(PLAIN, top_n_sigma=0.3),
    "xtc_p0": dict(PLAIN, xtc_probability=0.0, xtc_threshold=0.05),
    "xtc_p1": dict(PLAIN, xtc_probability=1.0, xtc_threshold=0.05),
    "xtc_p1_top_k": dict(top_k=6, xtc_probability=1.0, xtc_threshold=0.1, min_p=0.0),
    "xtc_over_half": dict(PLAIN, xtc_probability=1.0, xtc_threshold=0.6),
    "xtc_min_keep": dict(PLAIN, xtc_probability=1.0, xtc_threshold=0.02, min_keep=31),
    "xtc_coin": dict(PLAIN, xtc_probability=0.5, xtc_threshold=0.04),
    "temp_0.3": dict(temperature=0.3),
    "temp_2": dict(PLAIN, temperature=2.0),
    "everything": dict(top_k=20, typical_p=0.95, top_p=0.9, min_p=0.02, xtc_probability=1.0,
                       xtc_threshold=0.08, temperature=0.7, top_n_sigma=2.0, repeat_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=0.1, repeat_last_n=8),
}


@pytest.mark.parametrize("k", [256, 4], ids=["candidates", "whole_vocab"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chain_matches_reference(name, k):
    params = [SamplingParams(**CONFIGS[name])] * B
    tok, mu, dist = run(params, k=k)
    for r in range(B):
        want, _ = ref.chain(LOGITS[r], params[r], HISTORIES[r], xtc_coin=coins()[r])
        np.testing.assert_array_equal(dist[r] > 0, want > 0, err_msg=f"row {r}: kept set")
        np.testing.assert_allclose(dist[r], want, atol=2e-6, err_msg=f"row {r}")
        assert want[tok[r]] > 0   # the drawn token is one the chain keeps
    np.testing.assert_array_equal(mu, np.float32(10.0))   # untouched without Mirostat


def test_filters_do_what_their_names_say():
    assert [(run([SamplingParams(**CONFIGS[n])] * B)[2] > 0).sum(1).max()
            for n in ("top_k_1", "top_k_3", "top_p_tiny", "top_p_tiny_min_keep")] == [1, 3, 1, 3]
    for name in ("top_k_0", "top_k_-1", "top_k_over_V", "top_p_1", "min_p_0", "typical_1",
                 "top_n_sigma_-1", "xtc_p0", "xtc_over_half"):
        assert (run([SamplingParams(**CONFIGS[name])] * B)[2] > 0).all(), name
    # XTC drops the best token when another one is also above the threshold, never the last
    soft = np.exp(LOGITS - LOGITS.max(1, keepdims=True))
    several = ((soft / soft.sum(1, keepdims=True)) >= 0.05).sum(1) >= 2
    kept_best = run([SamplingParams(**CONFIGS["xtc_p1"])] * B)[2][np.arange(B), LOGITS.argmax(1)] > 0
    assert several.any() and (~several).any() and (kept_best == ~several).all()


@pytest.mark.parametrize("k", [256, 4])
def test_penalties(k):
    base = dict(PLAIN, repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3)
    for kw in (dict(repeat_last_n=4), dict(repeat_last_n=-1), dict(repeat_last_n=0),
               dict(repeat_last_n=64, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)):
        params = [SamplingParams(**base | kw)] * B
        dist = run(params, k=k)[2]
        for r in range(B):
            np.testing.assert_allclose(dist[r], ref.chain(LOGITS[r], params[r], HISTORIES[r])[0], atol=2e-6)
    neutral = run([SamplingParams(**PLAIN)] * B)[2]
    np.testing.assert_array_equal(run([SamplingParams(**base | dict(repeat_last_n=0))] * B)[2], neutral)
    np.testing.assert_array_equal(run([SamplingParams(**base)] * B, histories=[[]] * B)[2], neutral)


def test_history_layout_does_not_matter():
    """A left-aligned history (tokens, then -1) penalizes the same tokens as history_rows'."""
    p = make_row_params([SamplingParams(**PLAIN, repeat_penalty=2.0, repeat_last_n=3)] * B, SEEDS, POSITIONS)
    right = history_rows(HISTORIES, H)
    left = np.full((B, H), -1, np.int32)
    for r, h in enumerate(HISTORIES):
        left[r, :len(h)] = h
    z, m = np.zeros((B, V), np.float32), full_mask(B, V)
    np.testing.assert_array_equal(distribution(LOGITS, p, right, z, m), distribution(LOGITS, p, left, z, m))


def test_logit_bias_and_greedy():
    params = SamplingParams(temperature=0.0, logit_bias={1: 3.0, 2: -100, 3: -math.inf})
    logits = np.zeros((B, V), np.float32)
    logits[:, 2] = logits[:, 3] = 50.0   # the raw favourites, both banned
    logits[:, 5] = 2.0
    bias = np.stack([bias_row(params, V)] * B)
    assert bias[0, 2] == bias[0, 3] == -np.inf and bias[0, 1] == 3.0
    tok, _, _ = run([params] * B, logits=logits, bias=bias, histories=[[]] * B)
    assert (tok == 1).all()
    sampled = SamplingParams(**PLAIN, logit_bias={2: -100, 3: -math.inf})
    dist = run([sampled] * B, logits=logits, bias=np.stack([bias_row(sampled, V)] * B))[2]
    assert (dist[:, [2, 3]] == 0).all() and np.allclose(dist.sum(1), 1)


def test_greedy_is_argmax_after_bias_penalties_and_dry():
    for temp in (0.0, -1.0):
        params = SamplingParams(temperature=temp, repeat_penalty=1.5, presence_penalty=0.5,
                                xtc_probability=1.0, xtc_threshold=0.01, typical_p=0.1)
        dry = (RNG.random((B, V)) * 2).astype(np.float32)
        tok, _, dist = run([params] * B, dry=dry)
        want = [int(np.argmax(ref.penalize(LOGITS[r], HISTORIES[r], params, 1 << 30) - dry[r]))
                for r in range(B)]
        assert list(tok) == want and (dist[np.arange(B), tok] == 1).all()


def test_mask_bits_including_the_sign_bit():
    vocab = 40
    logits = (RNG.standard_normal((B, vocab)) * 2).astype(np.float32)
    mask = np.zeros((B, 2), np.int32)
    mask[:, 0] = np.int32(-2 ** 31)    # token 31 only, from the first word
    mask[:, 1] = 1 << 3                # token 35
    for params in (SamplingParams(**PLAIN), SamplingParams(temperature=0), SamplingParams(mirostat=2)):
        tok, _, dist = run([params] * B, logits=logits, mask=mask, histories=[[]] * B, k=4)
        assert set(tok) <= {31, 35} and (dist[:, [31, 35]].sum(1) > 0.999).all()


def test_all_banned_rows_give_minus_one_without_nan():
    params = [SamplingParams(), SamplingParams(temperature=0), SamplingParams(**PLAIN),
              SamplingParams(mirostat=1), SamplingParams(mirostat=2),
              SamplingParams(mirostat=2, temperature=0), SamplingParams(xtc_probability=1.0),
              SamplingParams(**PLAIN | dict(typical_p=0.5, top_p=0.5, min_keep=3))]
    for k in (256, 4):
        tok, mu, dist = run(params, mask=np.zeros((B, 1), np.int32), mus=[7.0] * B, k=k)
        assert (tok == -1).all() and (mu == 7.0).all() and (dist == 0).all()
        bias = np.full((B, V), -np.inf, np.float32)
        tok, mu, dist = run(params, bias=bias, mus=[7.0] * B, k=k)
        assert (tok == -1).all() and (mu == 7.0).all() and (dist == 0).all()


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_matches_reference_and_updates_mu(version):
    params = [SamplingParams(mirostat=version, temperature=t, mirostat_tau=tau, mirostat_eta=0.2)
              for t, tau in [(1.0, 5.0), (0.7, 3.0), (1.0, 1.0), (1.5, 4.0)] * 2]
    mus = [10.0, 6.0, 2.0, 8.0, 3.5, 1.2, 7.7, 0.5]
    tok, mu, dist = run(params, mus=mus, k=4)
    for r in range(B):
        want, update = ref.chain(LOGITS[r], params[r], mu=mus[r])
        np.testing.assert_array_equal(dist[r] > 0, want > 0, err_msg=f"row {r}")
        np.testing.assert_allclose(dist[r], want, atol=2e-6)
        assert mu[r] == pytest.approx(update(tok[r]), rel=1e-5)
    # greedy Mirostat: the argmax after bias, and one candidate with surprise 0
    greedy = [SamplingParams(mirostat=version, temperature=0, repeat_penalty=3.0)] * B
    tok, mu, _ = run(greedy, mus=[4.0] * B)
    assert list(tok) == list(LOGITS.argmax(1)) and np.allclose(mu, 4.0 + 0.1 * 5.0)


def test_dry_penalty_applies_after_the_repeat_penalty():
    params = SamplingParams(**PLAIN, repeat_penalty=1.5, dry_multiplier=0.8, dry_allowed_length=1)
    rows = np.stack([dry_row(h, params, DryBreakers({}), V, 1 << 30) for h in HISTORIES])
    assert rows.any()
    dist = run([params] * B, dry=rows)[2]
    for r in range(B):
        want, _ = ref.chain(LOGITS[r], params, HISTORIES[r], dry=rows[r])
        np.testing.assert_allclose(dist[r], want, atol=2e-6)


# --- determinism ---------------------------------------------------------------------------

MIXED = [SamplingParams(), SamplingParams(**PLAIN), SamplingParams(mirostat=1),
         SamplingParams(top_k=3, xtc_probability=0.7, xtc_threshold=0.1),
         SamplingParams(temperature=0), SamplingParams(mirostat=2, temperature=0.8),
         SamplingParams(**PLAIN, typical_p=0.7, top_n_sigma=1.0),
         SamplingParams(top_k=0, top_p=0.6, repeat_penalty=1.3)]


@pytest.mark.parametrize("k", [256, 4])
def test_row_is_bitwise_the_same_alone_or_in_any_batch(k):
    tok_all, mu_all, dist_all = run(MIXED, k=k)
    for r in range(B):
        for slot in (0, B - 1):
            params = [SamplingParams(temperature=0)] * B
            params[slot] = MIXED[r]
            perm = lambda a: [a[r] if i == slot else a[i] for i in range(B)]
            tok, mu, dist = run(params, logits=np.stack(perm(LOGITS)), histories=perm(HISTORIES),
                                seeds=perm(SEEDS), positions=perm(POSITIONS), k=k)
            assert tok[slot] == tok_all[r] and mu[slot].tobytes() == mu_all[r].tobytes(), (r, slot)
            assert dist[slot].tobytes() == dist_all[r].tobytes(), (r, slot)


def test_same_seed_and_position_same_token_other_positions_vary():
    params = [SamplingParams(**PLAIN, temperature=1.5)] * B
    first = run(params)[0]
    assert (run(params)[0] == first).all()
    toks = {int(run(params, positions=[p] * B)[0][0]) for p in range(40)}
    assert len(toks) > 5


def _frequencies(params, logits_row, k, n=4096, vocab=None):
    vocab = vocab or len(logits_row)
    rows = make_row_params([params] * n, list(range(1000, 1000 + n)),
                           list(np.random.default_rng(7).integers(0, 10_000, n)))
    lg = np.broadcast_to(logits_row, (n, vocab)).astype(np.float32)
    z = np.zeros((n, vocab), np.float32)
    tok, _ = sample(lg, rows, np.full((n, 4), -1, np.int32), z, full_mask(n, vocab), z, max_candidates=k)
    return np.bincount(np.asarray(tok), minlength=vocab) / n


@pytest.mark.parametrize("name,k", [("everything", 256), ("top_k_0", 4), ("typical_0.5", 4)])
def test_draws_follow_the_filtered_distribution(name, k):
    params = SamplingParams(**CONFIGS[name] | dict(repeat_penalty=1.0, xtc_probability=0.0))
    want, _ = ref.chain(LOGITS[2], params)
    freq = _frequencies(params, LOGITS[2], k)
    assert np.abs(freq - want).max() < 0.03 and (freq[want == 0] == 0).all()


def test_draws_over_many_blocks_of_a_larger_vocabulary():
    vocab = 1000   # four inverse-CDF blocks
    row = np.full(vocab, -4.0, np.float32)
    row[[5, 255, 256, 511, 700, 999]] = [1.0, 0.5, 0.8, 1.2, 0.2, 0.9]
    params = SamplingParams(**PLAIN)
    want, _ = ref.chain(row, params)
    freq = _frequencies(params, row, 64, vocab=vocab)
    assert np.abs(freq - want).max() < 0.03


def test_logprobs_are_the_raw_log_softmax():
    logits = LOGITS.copy()
    logits[0, [4, 9]] = 10.0   # a tie: lower id first
    tokens = np.array([4, 0, 1, 2, 3, 5, 6, -1], np.int32)
    chosen, ids, lps = logprobs(logits, tokens, 3)
    want = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    np.testing.assert_allclose(chosen[:7], want[np.arange(7), tokens[:7]], atol=1e-5)
    assert chosen[7] == -np.inf and list(ids[0][:2]) == [4, 9]
    np.testing.assert_array_equal(ids[1:], np.argsort(-logits[1:], 1, kind="stable")[:, :3])
    np.testing.assert_allclose(lps, np.take_along_axis(want, np.asarray(ids), 1), atol=1e-5)
    assert logprobs(logits, tokens, 0)[1].shape == (B, 0)


# --- SamplingParams and the host-side rows ----------------------------------------------------

def test_defaults_are_llama_servers():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.typical_p, p.top_n_sigma) == (1.0, -1.0)
    assert (p.xtc_probability, p.xtc_threshold, p.repeat_penalty, p.repeat_last_n) == (0.0, 0.1, 1.0, 64)
    assert (p.presence_penalty, p.frequency_penalty, p.min_keep, p.seed) == (0.0, 0.0, 0, None)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, -1)
    assert p.dry_sequence_breakers == ("\n", ":", "\"", "*")
    assert (p.mirostat, p.mirostat_tau, p.mirostat_eta, p.logit_bias) == (0, 5.0, 0.1, ())


@pytest.mark.parametrize("kw,field", [
    (dict(top_p=1.5), "top_p"), (dict(min_p=-0.1), "min_p"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=101), "temperature"), (dict(top_k=1.5), "top_k"), (dict(top_k=True), "top_k"),
    (dict(repeat_penalty=0), "repeat_penalty"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(mirostat=3), "mirostat"),
    (dict(repeat_last_n=-2), "repeat_last_n"), (dict(dry_penalty_last_n=-5), "dry_penalty_last_n"),
    (dict(top_logprobs=21), "top_logprobs"), (dict(seed=-2), "seed"), (dict(seed="7"), "seed"),
    (dict(logit_bias={"a": 1}), "logit_bias"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(logit_bias={1: math.nan}), "logit_bias"), (dict(dry_sequence_breakers=[]), "dry_sequence_breakers"),
    (dict(dry_sequence_breakers="abc"), "dry_sequence_breakers"), (dict(typical_p=2), "typical_p"),
    (dict(xtc_threshold=-1), "xtc_threshold"), (dict(min_keep=-1), "min_keep"),
    (dict(logit_bias={i: 1 for i in range(MAX_LOGIT_BIAS + 1)}), "logit_bias")])
def test_invalid_values_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_normalisation():
    p = SamplingParams(dry_base=0.5, logit_bias={"5": -100, 3: 1}, dry_sequence_breakers=["x"])
    assert p.dry_base == 1.75 and p.logit_bias == ((3, 1.0), (5, -100.0))
    assert p.dry_sequence_breakers == ("x",)


def test_gguf_recommended_sampling():
    md = {"general.sampling.top_k": 20, "general.sampling.top_p": np.float32(0.8),
          "general.sampling.min_p": 0.0, "general.sampling.temp": 0.7,
          "general.sampling.penalty_last_n": 128, "general.sampling.penalty_repeat": 1.05,
          "general.sampling.mirostat": 2, "general.sampling.mirostat_tau": 4.0,
          "general.sampling.mirostat_eta": 0.2, "general.sampling.xtc_probability": 0.5,
          "general.sampling.xtc_threshold": 0.2, "general.sampling.sequence": "edskypmxt",
          "general.name": "x"}
    p = from_gguf_defaults(md)
    assert (p.top_k, p.top_p, p.min_p) == (20, pytest.approx(0.8), 0.0)
    assert (p.temperature, p.repeat_last_n) == (0.7, 128)
    assert (p.repeat_penalty, p.mirostat, p.mirostat_tau, p.mirostat_eta) == (1.05, 2, 4.0, 0.2)
    assert (p.xtc_probability, p.xtc_threshold) == (0.5, 0.2)
    assert SamplingParams.from_gguf_defaults(md, top_k=5, mirostat=0).top_k == 5
    assert from_gguf_defaults({}) == SamplingParams()
    with pytest.raises(ValueError, match="general.sampling.top_p"):
        from_gguf_defaults({"general.sampling.top_p": "high"})
    with pytest.raises(ValueError, match="recommended sampling is invalid: top_p"):
        from_gguf_defaults({"general.sampling.top_p": 7.0})


def test_host_rows():
    assert history_rows([[1, 2, 3], [], list(range(20))], 4).tolist() == [
        [-1, 1, 2, 3], [-1, -1, -1, -1], [16, 17, 18, 19]]
    row = bias_row(SamplingParams(logit_bias={1: 1.5, 2: -100, 50: 3}, ignore_eos=True), 8, eog_ids=[7, 99])
    assert row.tolist() == [0, 1.5, -np.inf, 0, 0, 0, 0, -np.inf]
    rp = make_row_params([SamplingParams(repeat_last_n=-1, mirostat_tau=3.0)], [2 ** 32 + 5], [9],
                         n_ctx=4096, pad_to=3)
    assert rp.repeat_last_n.tolist() == [4096, 64, 64] and rp.seed.tolist() == [5, 0, 0]
    assert rp.mu.tolist() == [6.0, 0.0, 0.0] and rp.temperature.tolist()[1:] == [0.0, 0.0]
    assert rp.seed.dtype == np.uint32 and rp.top_k.dtype == np.int32 and rp.mu.dtype == np.float32


def _toy_tokenize(pieces):
    def tokenize(text):   # greedy longest match over the pieces
        out = []
        while text:
            best = max((i for i, p in enumerate(pieces) if p and text.startswith(p)),
                       key=lambda i: len(pieces[i]))
            out.append(best)
            text = text[len(pieces[best]):]
        return out
    return tokenize


def test_dry_breakers_from_pieces():
    pieces = ["a", "b", ":", "x:", "\n", "y\nz", "*", "ab", "c:d", "q"]
    br = DryBreakers.build(["\n", ":", "ab:", ""], pieces, _toy_tokenize(pieces))
    # "a" and "ab" end with the start of "ab:": heads whose tails are the rest, tokenized
    assert br.heads == {4: ((),), 5: ((),), 2: ((),), 3: ((),), 8: ((),), 0: ((1, 2),), 7: ((2,),)}
    assert br.single_token(2) and not br.single_token(0) and not br.single_token(9)


def test_dry_hand_example():
    # a b c c b c y a b c: continuing with c would repeat "a b c" (3), y "b c" (2), b "c" (1)
    p = SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2)
    seq = [1, 2, 3, 3, 2, 3, 4, 1, 2, 3]
    assert dry_row(seq, p, DryBreakers({}), 6, 1 << 30).tolist() == [0, 0, 0, 2.0, 1.0, 0]
    # y is a breaker: never penalised, and repeats stop at it (limit 3 keeps c's length 3)
    assert dry_row(seq, p, DryBreakers({4: ((),)}), 6, 1 << 30).tolist() == [0, 0, 0, 2.0, 0, 0]
    # b breaks one token from the end: no repeat of 2 can reach back past it
    assert not dry_row(seq, p, DryBreakers({2: ((),)}), 6, 1 << 30).any()
    assert not dry_row(seq, SamplingParams(dry_multiplier=0.0), DryBreakers({}), 6, 1 << 30).any()
    short = SamplingParams(dry_multiplier=1.0, dry_penalty_last_n=2)   # window <= allowed_length
    assert not dry_row(seq, short, DryBreakers({}), 6, 1 << 30).any()


def test_dry_matches_its_definition_on_random_sequences():
    rng = np.random.default_rng(5)
    breakers = DryBreakers({5: ((),), 3: ((4,),)})
    penalised = 0
    for trial in range(300):
        seq = list(rng.integers(0, 6, size=int(rng.integers(0, 40))))
        p = SamplingParams(dry_multiplier=float(rng.uniform(0.1, 2)), dry_base=float(rng.uniform(1, 3)),
                           dry_allowed_length=int(rng.integers(0, 4)),
                           dry_penalty_last_n=int(rng.choice([-1, 0, 5, 17])))
        got = dry_row(seq, p, breakers, 6, 32)
        want = ref.dry_naive(seq, p, {5}, [(5,), (3, 4)], 6, 32)
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=f"trial {trial}: {seq}")
        penalised += bool(got.any())
    assert penalised > 50


def test_the_greedy_path_draws_what_sample_draws():
    """Runner.sample takes the greedy draw for calls whose rows are all plain_greedy: the
    same tokens as `sample`, with a mask, a bias, NaN logits and rows that allow nothing."""
    from kinetic.engine.sampler import greedy, plain_greedy
    logits = LOGITS.copy()
    logits[1, 4] = np.nan
    logits[2, :] = np.float32(7.0)                 # ties: the lowest id wins
    mask = full_mask(B, V)
    mask[3] = 0                                     # allows nothing: -1
    mask[4, 0] = 0b1010                             # tokens 1 and 3 only
    bias = np.zeros((B, V), np.float32)
    bias[5, int(np.argmax(LOGITS[5]))] = -np.inf    # the favourite banned
    bias[6, 9] = 100.0
    params = [SamplingParams(temperature=0.0)] * (B - 1) + [SamplingParams(temperature=-1.0)]
    assert all(plain_greedy(p) for p in params)
    want, _, _ = run(params, logits=logits, bias=bias, mask=mask, histories=[[]] * B)
    got = np.asarray(greedy(logits, bias, mask))
    assert list(got) == list(want) and got[3] == -1 and got[4] in (1, 3) and got[6] == 9
    for p in (SamplingParams(temperature=0.5), SamplingParams(temperature=0, mirostat=2),
              SamplingParams(temperature=0, repeat_penalty=1.1),
              SamplingParams(temperature=0, presence_penalty=0.5),
              SamplingParams(temperature=0, dry_multiplier=0.8)):
        assert not plain_greedy(p)
    assert plain_greedy(SamplingParams(temperature=0, repeat_penalty=1.5, repeat_last_n=0))


# --- sparse bias and DRY: bitwise the dense rows' results ----------------------------------------

def _dense_of(pairs, vocab):
    row = np.zeros(vocab, np.float32)
    row[pairs[0]] = pairs[1]
    return row


def _random_bias(rng, vocab):
    """Random logit_bias entries: repeated ids (they add up), -100 and -inf bans, +-100, ids
    past the vocabulary (ignored), and ignore_eos."""
    entries = [(int(rng.integers(0, vocab + 8)),
                float(rng.choice([rng.uniform(-5, 5), -100.0, -math.inf, 100.0, 0.0, -99.5])))
               for _ in range(int(rng.integers(0, 12)))]
    entries += [(t, float(rng.uniform(-3, 3))) for t, _ in entries[:int(rng.integers(0, 4))]]
    return dict(logit_bias=entries, ignore_eos=bool(rng.integers(0, 2)))


def test_bias_pairs_are_bias_row():
    rng = np.random.default_rng(21)
    for trial in range(300):
        p = SamplingParams(**_random_bias(rng, V))
        ids, values = bias_pairs(p, V, eog_ids=[3, 7, 99])
        assert ids.dtype == np.int32 and values.dtype == np.float32
        assert list(ids) == sorted(set(ids.tolist())) and ((ids >= 0) & (ids < V)).all()
        want = bias_row(p, V, eog_ids=[3, 7, 99])
        assert _dense_of((ids, values), V).tobytes() == want.tobytes(), trial
    # repeated ids add up in float32, in order; a ban wins over what came before it
    p = SamplingParams(logit_bias=[(2, 0.1), (2, 0.2), (4, 1.0), (4, -100), (5, -100), (5, 3.0)])
    ids, values = bias_pairs(p, V)
    assert ids.tolist() == [2, 4, 5] and values[0] == np.float32(np.float32(0.1) + 0.2)
    assert values[1] == values[2] == -np.inf
    # the most a request can ask fits the engine's fixed width
    from kinetic.engine.sample_batch import BIAS_WIDTH
    eog = list(range(2000, 2064))
    p = SamplingParams(logit_bias=[(t, 1.0) for t in range(MAX_LOGIT_BIAS)] * 2, ignore_eos=True)
    assert len(bias_pairs(p, 4096, eog)[0]) == MAX_LOGIT_BIAS + 64 == BIAS_WIDTH
    pack_pairs([bias_pairs(p, 4096, eog)], 2, BIAS_WIDTH)
    with pytest.raises(ValueError, match="pairs"):
        pack_pairs([bias_pairs(p, 4096, eog)], 2, BIAS_WIDTH - 1)


def test_dry_pairs_are_the_penalised_tokens():
    rng = np.random.default_rng(8)
    breakers = DryBreakers({5: ((),), 3: ((4,),)})
    for trial in range(200):
        seq = list(rng.integers(0, 12, size=int(rng.integers(0, 50))))
        p = SamplingParams(dry_multiplier=float(rng.uniform(0.1, 2)), dry_allowed_length=int(rng.integers(0, 3)))
        ids, values = dry_pairs(seq, p, breakers, V, 1 << 30)
        assert list(ids) == sorted(set(ids.tolist())) and (values > 0).all()
        assert set(ids.tolist()) <= set(seq) - {5}   # tokens of the window, never a breaker
        assert _dense_of((ids, values), V).tobytes() == dry_row(seq, p, breakers, V, 1 << 30).tobytes()


@pytest.mark.parametrize("k", [256, 4], ids=["candidates", "whole_vocab"])
def test_sparse_bias_and_dry_give_bitwise_the_dense_results(k):
    """sample, distribution and greedy over Sparse pairs (what the engine sends) give the very
    bits of the dense [B, V] rows they stand for: random logits (with -0.0 and +0.0 in them),
    random biases with repeats, bans and ignore_eos, DRY rows, some of them too long for the
    pair width (spilled whole into the dense part), and steps where no row has DRY."""
    rng = np.random.default_rng(99)
    vocab, batch, eog = 96, 16, [3, 50, 95]
    chains = [dict(), dict(PLAIN), dict(temperature=0.0), dict(mirostat=2), dict(mirostat=1),
              dict(PLAIN, top_p=0.7, repeat_penalty=1.3, presence_penalty=0.2),
              dict(top_k=5, xtc_probability=1.0, xtc_threshold=0.05),
              dict(PLAIN, top_n_sigma=1.0, typical_p=0.8), dict(temperature=0.0, repeat_penalty=1.2)]
    breakers = DryBreakers({5: ((),)})
    for trial in range(6):
        logits = (rng.standard_normal((batch, vocab)) * 3).astype(np.float32)
        logits[rng.random((batch, vocab)) < 0.02] = -0.0
        logits[rng.random((batch, vocab)) < 0.02] = 0.0
        dry_on = trial != 2   # trial 2: no row has DRY (the pairs all unused)
        params = [SamplingParams(**chains[int(rng.integers(0, len(chains)))], **_random_bias(rng, vocab),
                                 dry_multiplier=float(rng.choice([0.0, 0.8])) if dry_on else 0.0,
                                 dry_allowed_length=int(rng.integers(0, 3)), seed=r)
                  for r in range(batch)]
        hists = [list(rng.integers(0, 14, size=int(rng.integers(0, 60)))) for _ in range(batch)]
        rows = make_row_params(params, list(range(batch)), list(rng.integers(0, 1000, batch)))
        hist = history_rows(hists, 64)
        mask = full_mask(batch, vocab)
        mask[rng.random(mask.shape) < 0.05] = 0
        biases = [bias_pairs(p, vocab, eog) for p in params]
        drys = [dry_pairs(h, p, breakers, vocab, 1 << 30) if p.dry_multiplier > 0 else None
                for p, h in zip(params, hists)]
        dense_bias = np.stack([bias_row(p, vocab, eog) for p in params])
        dense_dry = np.stack([dry_row(h, p, breakers, vocab, 1 << 30) for p, h in zip(params, hists)])
        bias = Sparse(*pack_pairs(biases, batch, 64))
        width = 6
        over = [i for i, d in enumerate(drys) if d is not None and len(d[0]) > width]
        spill = np.zeros((batch, vocab), np.float32)
        for i in over:
            spill[i] = _dense_of(drys[i], vocab)
        dry = Sparse(*pack_pairs([None if i in over else d for i, d in enumerate(drys)], batch, width),
                     spill, np.bool_(bool(over)))
        assert (trial == 2) or (over and len(over) < sum(d is not None for d in drys)), trial
        # and without a spill part (every row fits a width as wide as the vocabulary)
        dry_wide = Sparse(*pack_pairs(drys, batch, vocab))
        want_tok, want_mu = sample(logits, rows, hist, dense_bias, mask, dense_dry, max_candidates=k)
        want_dist = distribution(logits, rows, hist, dense_bias, mask, dense_dry, max_candidates=k)
        for d in (dry, dry_wide) if k == 256 else (dry,):   # (each variant compiles for seconds)
            tok, mu = sample(logits, rows, hist, bias, mask, d, max_candidates=k)
            assert np.asarray(tok).tobytes() == np.asarray(want_tok).tobytes(), trial
            assert np.asarray(mu).tobytes() == np.asarray(want_mu).tobytes(), trial
        dist = distribution(logits, rows, hist, bias, mask, dry, max_candidates=k)
        assert np.asarray(dist).tobytes() == np.asarray(want_dist).tobytes(), trial
        assert np.asarray(greedy(logits, bias, mask)).tolist() == \
            np.asarray(greedy(logits, dense_bias, mask)).tolist()
