"""A request's sampling parameters, and what the host derives from them per step.

`SamplingParams` holds every sampling field kinetic accepts, under llama-server's names and
with llama-server's defaults; `from_gguf_defaults` lets a model file's recommended sampling
(`general.sampling.*`) replace those defaults before a request's own fields are applied.

The jitted sampler (kinetic/engine/sampler.py) takes per-row arrays. The rows built here on the
host, in numpy, are the ones that depend on strings or on a whole sequence:
- `bias_pairs`: logit_bias (and ignore_eos) as sorted, unique (token id, bias) pairs, what the
  engine sends (sampler.Sparse); `bias_row` is the same as a dense [V] row;
- `DryBreakers` + `dry_pairs`: the DRY penalty of each penalised token, computed from the
  sequence's own tokens (sequence breakers are strings matched against token pieces, which jit
  cannot do); `dry_row` is the same as a dense [V] row;
- `history_rows`: the last H tokens of each sequence, for the repeat/presence/frequency
  penalties that the jitted sampler applies itself.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_DRY_BREAKERS = ("\n", ":", "\"", "*")
# distinct tokens one request's logit_bias may name (the API refuses more entries than this):
# the sampler's fixed-width bias pairs hold this many plus the end-of-generation ids
MAX_LOGIT_BIAS = 1024

# GGUF key -> field, as llama.cpp's common_init reads them (gguf-py's Keys.General.SAMPLING_*).
# general.sampling.sequence (a custom sampler order) is not supported and is ignored.
GGUF_SAMPLING_KEYS = {
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.xtc_probability": "xtc_probability",
    "general.sampling.xtc_threshold": "xtc_threshold",
    "general.sampling.temp": "temperature",
    "general.sampling.penalty_last_n": "repeat_last_n",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.mirostat": "mirostat",
    "general.sampling.mirostat_tau": "mirostat_tau",
    "general.sampling.mirostat_eta": "mirostat_eta",
}

INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 1   # the sampler keys draws with the seed modulo 2**32

_INT_FIELDS = ("top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "mirostat",
               "min_keep", "top_logprobs")


@dataclass(frozen=True)
class SamplingParams:
    """Sampling fields of one request (docs/server.md's request fields; llama-server names and
    defaults).

    logit_bias maps token id -> bias added to the logit; a bias of -100 or below, or -inf,
    bans the token (OpenAI's meaning of -100); it names at most MAX_LOGIT_BIAS distinct
    tokens. seed None (or -1) asks the engine for a fresh seed. repeat_last_n and
    dry_penalty_last_n take -1 for "the whole context". A dry_base below 1 is replaced by the
    default, as llama-server does.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    top_n_sigma: float = -1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DEFAULT_DRY_BREAKERS
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    min_keep: int = 0
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not -INT32_MAX <= value <= INT32_MAX:   # the sampler's rows are int32
                raise ValueError(f"{name} must be between {-INT32_MAX} and {INT32_MAX}, "
                                 f"got {value}")
        _check_range("temperature", self.temperature, hi=100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("typical_p", self.typical_p, 0.0, 1.0)
        _check_range("top_n_sigma", self.top_n_sigma)
        _check_range("xtc_probability", self.xtc_probability, 0.0, 1.0)
        _check_range("xtc_threshold", self.xtc_threshold, 0.0, 1.0)
        _check_range("repeat_penalty", self.repeat_penalty)
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be greater than 0 (1 for none), "
                             f"got {self.repeat_penalty!r}")
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_range("dry_multiplier", self.dry_multiplier, 0.0)
        _check_range("dry_base", self.dry_base)
        _check_range("mirostat_tau", self.mirostat_tau, 0.0)
        _check_range("mirostat_eta", self.mirostat_eta, 0.0)
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be -1 (whole context) or more, got {self.repeat_last_n}")
        if self.dry_penalty_last_n < -1:
            raise ValueError(f"dry_penalty_last_n must be -1 (whole context) or more, "
                             f"got {self.dry_penalty_last_n}")
        if self.dry_allowed_length < 0:
            raise ValueError(f"dry_allowed_length must be 0 or more, got {self.dry_allowed_length}")
        if self.mirostat not in (0, 1, 2):
            raise ValueError(f"mirostat must be 0 (off), 1 or 2, got {self.mirostat}")
        if self.min_keep < 0:
            raise ValueError(f"min_keep must be 0 or more, got {self.min_keep}")
        if not 0 <= self.top_logprobs <= 20:
            raise ValueError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -1 <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer from 0 to {SEED_MAX} (or -1 for a "
                             f"fresh one), got {self.seed!r}")
        if self.dry_base < 1.0:   # llama-server replaces it rather than refusing the request
            object.__setattr__(self, "dry_base", 1.75)
        object.__setattr__(self, "dry_sequence_breakers", _breakers(self.dry_sequence_breakers))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    @classmethod
    def from_gguf_defaults(cls, metadata: Mapping[str, Any], **overrides: Any) -> "SamplingParams":
        """llama-server's defaults, replaced by the model file's `general.sampling.*` values
        where it has them, then by `overrides` (a request's own fields). A malformed metadata
        value raises ValueError naming the key."""
        values: dict[str, Any] = {}
        for key, name in GGUF_SAMPLING_KEYS.items():
            if key not in metadata:
                continue
            raw = metadata[key]
            if isinstance(raw, bool) or not isinstance(raw, (int, float, np.integer, np.floating)):
                raise ValueError(f"GGUF metadata {key} must be a number, got {raw!r}")
            values[name] = int(raw) if name in _INT_FIELDS else float(raw)
        try:
            base = cls(**values)
        except ValueError as e:
            raise ValueError(f"the model file's recommended sampling is invalid: {e}") from None
        return dataclasses.replace(base, **overrides) if overrides else base


def from_gguf_defaults(metadata: Mapping[str, Any], **overrides: Any) -> SamplingParams:
    """Module-level alias of `SamplingParams.from_gguf_defaults`."""
    return SamplingParams.from_gguf_defaults(metadata, **overrides)


def _check_range(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (f"between {lo:g} and {hi:g}" if lo is not None and hi is not None
                  else f"at least {lo:g}" if lo is not None else f"at most {hi:g}")
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def _breakers(value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise ValueError(f"dry_sequence_breakers must be a list of strings, got {value!r}")
    out = tuple(value)
    if not out or not all(isinstance(s, str) for s in out):
        raise ValueError("dry_sequence_breakers must be a non-empty list of strings")
    return out


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    out = []
    for item in items:
        try:
            token, bias = item
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias entries must be (token id, bias) pairs, got {item!r}") from None
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)   # JSON object keys arrive as strings
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) \
                or bias == math.inf or (math.isfinite(bias) and not -100 <= bias <= 100):
            raise ValueError(f"logit_bias for token {token} must be between -100 and 100, got {bias!r}")
        out.append((token, float(bias)))
    distinct = len({token for token, _ in out})
    if distinct > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} distinct tokens, got {distinct}")
    return tuple(sorted(out))


# --- host-side rows ---------------------------------------------------------------------

def bias_pairs(params: SamplingParams, vocab_size: int,
               eog_ids: Iterable[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    """The logit bias of one request as (ids int32 [n], values float32 [n]): the tokens whose
    bias_row entry is set, ascending and unique, and exactly bias_row's values there, by its
    rules: repeated ids add up in float32 in logit_bias order, -100 and below become -inf
    (banned), ids outside the vocabulary are ignored, ignore_eos bans `eog_ids`. At most
    MAX_LOGIT_BIAS + len(eog_ids) pairs."""
    acc: dict[int, np.float32] = {}
    for token, bias in params.logit_bias:
        if token < vocab_size:
            # np.float32 + float, as bias_row's row[token] + bias
            acc[token] = (np.float32(-np.inf) if bias <= -100
                          else np.float32(acc.get(token, np.float32(0.0)) + bias))
    if params.ignore_eos:
        for t in eog_ids:
            if 0 <= t < vocab_size:
                acc[t] = np.float32(-np.inf)
    ids = sorted(acc)
    return np.asarray(ids, np.int32), np.asarray([acc[t] for t in ids], np.float32)


def bias_row(params: SamplingParams, vocab_size: int, eog_ids: Iterable[int] = ()) -> np.ndarray:
    """[V] float32: the logit bias of one request, dense (bias_pairs is what the engine
    sends). -100 and below become -inf (banned); ids outside the vocabulary are ignored, as
    llama-server does; ignore_eos bans `eog_ids`."""
    row = np.zeros(vocab_size, np.float32)
    for token, bias in params.logit_bias:
        if token < vocab_size:
            row[token] = -np.inf if bias <= -100 else row[token] + bias
    if params.ignore_eos:
        row[[t for t in eog_ids if 0 <= t < vocab_size]] = -np.inf
    return row


def history_rows(sequences: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """[B, width] int32: each sequence's last `width` tokens, right-aligned, -1 padded on the
    left (the layout `sampler.sample` expects for its penalty window)."""
    out = np.full((len(sequences), width), -1, np.int32)
    for i, seq in enumerate(sequences):
        tail = list(seq)[-width:] if width > 0 else []
        if tail:
            out[i, width - len(tail):] = tail
    return out


@dataclass(frozen=True)
class DryBreakers:
    """DRY sequence breakers as token sequences: head token -> tails (tuples of token ids).

    Built as llama.cpp processes its breaker strings: a token whose piece contains a breaker is
    a breaker by itself (empty tail); a token whose piece ends with the start of a breaker is a
    head, its tail the tokenization of the rest of the breaker (at most 20 tokens). Breakers are
    cut to 40 bytes. Building scans the whole vocabulary: do it once per breaker list and cache.
    """

    heads: Mapping[int, tuple[tuple[int, ...], ...]]

    @classmethod
    def build(cls, breakers: Sequence[str], pieces: Sequence[bytes | str],
              tokenize: Callable[[str], list[int]]) -> "DryBreakers":
        """`pieces[t]` is token t's text (llama.cpp detokenizes with special tokens rendered);
        `tokenize` encodes text without special tokens."""
        heads: dict[int, list[tuple[int, ...]]] = {}
        texts = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in pieces]
        for breaker in breakers:
            brk = breaker.encode("utf-8")[:40]
            if not brk:
                continue
            for tid, word in enumerate(texts):
                if brk in word:
                    _add_tail(heads, tid, ())
                    continue
                pos = word.find(brk[:1])
                while pos != -1:
                    rest = len(word) - pos   # the word's tail is a proper prefix of brk
                    if brk.startswith(word[pos:]):
                        tail = tokenize(brk[rest:].decode("utf-8", errors="replace"))
                        _add_tail(heads, tid, tuple(tail[:20]))
                    pos = word.find(brk[:1], pos + 1)
        return cls({t: tuple(v) for t, v in heads.items()})

    def single_token(self, token: int) -> bool:
        return () in self.heads.get(token, ())


def _add_tail(heads: dict[int, list[tuple[int, ...]]], tid: int, tail: tuple[int, ...]) -> None:
    tails = heads.setdefault(tid, [])
    if tail not in tails:
        tails.append(tail)


def dry_row(tokens: Sequence[int], params: SamplingParams, breakers: DryBreakers,
            vocab_size: int, n_ctx: int) -> np.ndarray:
    """[V] float32: the DRY penalty (>= 0, to subtract) of each candidate next token, from the
    sequence's own tokens (prompt and output), as llama.cpp's DRY sampler defines it: a token
    that would extend a repeat of length L >= allowed_length of the sequence's end is penalised
    multiplier * base ** (L - allowed_length); repeats do not reach back across a breaker.
    The dense form of dry_pairs (0 for the tokens it does not name)."""
    row = np.zeros(vocab_size, np.float32)
    ids, values = dry_pairs(tokens, params, breakers, vocab_size, n_ctx)
    row[ids] = values
    return row


def dry_pairs(tokens: Sequence[int], params: SamplingParams, breakers: DryBreakers,
              vocab_size: int, n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """The DRY penalties of dry_row as (ids int32 [n], values float32 [n]), ids ascending and
    unique: the penalised tokens, what the engine sends (sampler.Sparse).

    Each penalised token follows an earlier occurrence of the window's last allowed_length
    tokens, so n is at most the number of distinct tokens in the DRY window (and below V):
    usually a handful, but up to the whole window's with allowed_length 0 or an adversarial
    prompt."""
    empty = np.zeros(0, np.int32), np.zeros(0, np.float32)
    last_n = n_ctx if params.dry_penalty_last_n == -1 else params.dry_penalty_last_n
    if params.dry_multiplier == 0 or params.dry_base < 1 or last_n == 0:
        return empty
    allowed = params.dry_allowed_length
    seq = list(tokens)[-min(last_n, n_ctx):] if len(tokens) else []
    n = len(seq)
    if n <= allowed:
        return empty
    rev = seq[::-1]   # rev[0] is the last token
    limit = n
    for i, tok in enumerate(rev):   # the most recent breaker bounds how far a repeat can reach
        match = max((len(t) for t in breakers.heads.get(tok, ())
                     if len(t) <= i and all(rev[i - 1 - j] == t[j] for j in range(len(t)))),
                    default=-1)
        if match >= 0:
            limit = i - match
            break
    if limit < allowed:
        return empty
    z = _z_function(rev)
    longest: dict[int, int] = {}
    for k in range(1, n):
        # the tokens ending k places before the end repeat the sequence's last z[k] tokens;
        # the token that followed them would extend the repeat
        length = min(z[k], limit)
        if length >= allowed:
            nxt = rev[k - 1]
            if longest.get(nxt, -1) < length:
                longest[nxt] = length
    max_exp = int(88.7228391 / math.log(params.dry_base)) if params.dry_base > 1.000001 else 0
    pen: dict[int, np.float32] = {}
    for tok, length in longest.items():
        if 0 <= tok < vocab_size and not breakers.single_token(tok):
            exp = length - allowed
            if max_exp > 0:
                exp = min(exp, max_exp)
            pen[tok] = np.float32(params.dry_multiplier * params.dry_base ** exp)
    ids = sorted(pen)
    return np.asarray(ids, np.int32), np.asarray([pen[t] for t in ids], np.float32)


def _z_function(s: Sequence[int]) -> list[int]:
    """z[k] = length of the longest common prefix of s and s[k:] (z[0] = len(s)); O(len(s))."""
    n = len(s)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0   # [left, right) is the rightmost window known to match a prefix of s
    for k in range(1, n):
        length = min(right - k, z[k - left]) if k < right else 0
        while k + length < n and s[length] == s[k + length]:
            length += 1
        z[k] = length
        if k + length > right:
            left, right = k, k + length
    return z
