"""One request inside the engine: its decoder, stop strings, sampler state and sink."""

from __future__ import annotations

import weakref
from typing import Callable

import numpy as np

from kinetic.engine.request import Delta, GenerationRequest, TokenLogprob, Usage
from kinetic.engine.sampling_params import DryBreakers, bias_pairs, dry_pairs
from kinetic.grammar import Matcher, TokenVocab
from kinetic.text.decoder import IncrementalDecoder
from kinetic.text.stop import StopMatcher
from kinetic.text.tokenizer import Tokenizer

# tokenizer -> breaker strings -> DryBreakers (building one scans the whole vocabulary)
_dry_breakers: "weakref.WeakKeyDictionary[Tokenizer, dict]" = weakref.WeakKeyDictionary()


class Job:
    """Turns a sequence's accepted tokens into deltas for its sink (engine thread only)."""

    def __init__(self, seq_id: int, request: GenerationRequest, sink: Callable[[Delta], None],
                 tokenizer: Tokenizer, seed: int, all_logits: bool = False,
                 vocab: TokenVocab | None = None):
        """vocab: the engine's token trie, for a request with a grammar."""
        self.seq_id, self.request, self.sink = seq_id, request, sink
        self.tokenizer, self.seed, self.all_logits = tokenizer, seed, all_logits
        special = request.special_text or request.grammar is not None
        self.decoder = IncrementalDecoder(tokenizer, special)
        self.matcher: Matcher | None = (Matcher(request.grammar, vocab)
                                        if request.grammar is not None else None)
        self.stops = StopMatcher(list(request.stop))
        self.mu: float | None = None         # Mirostat state, None until the first draw
        self.pending_mu: float | None = None
        self.n_out = 0
        self.cached = 0                      # prompt tokens reused from the prefix cache
        self.gone = False                    # the sink failed: nobody reads this job any more
        self._bias: tuple[np.ndarray, np.ndarray] | None | bool = False

    def take(self, tokens: list[int], lps: list | None) -> tuple[int, str | None]:
        """Process accepted tokens in order; send what they complete. Returns (how many of
        them belong to the answer, finish reason if the answer ended here)."""
        if self.pending_mu is not None:
            self.mu = self.pending_mu
        params = self.request.params
        out_ids, out_lp, text, reason, keep = [], [], [], None, len(tokens)
        for i, t in enumerate(tokens):
            if t < 0:  # no token was allowed (everything banned)
                keep, reason = i, "stop"
                break
            if t in self.tokenizer.eog_ids and not params.ignore_eos:
                keep, reason = i, "stop"
                break
            if self.matcher is not None and not self.matcher.accept_token(t):
                keep, reason = i, "stop"   # masks make this unreachable; never emit off-grammar
                break
            out_ids.append(t)
            if lps is not None:
                chosen, top_ids, top_lp = lps[i]
                n = self.request.logprobs
                out_lp.append(TokenLogprob(t, chosen, tuple(
                    (int(a), float(b)) for a, b in zip(top_ids[:n], top_lp[:n]))))
            text.append(self.stops.feed(self.decoder.add(t)))
            if self.stops.stopped is not None:
                keep, reason = i + 1, "stop"
                break
        self.n_out += len(out_ids)
        if out_ids:
            self.send(Delta(tuple(out_ids), "".join(text), tuple(out_lp)))
        if self.gone and reason is None:
            reason = "cancelled"
        return keep, reason

    def finish(self, reason: str, usage: Usage) -> None:
        tail = "" if self.stops.stopped is not None else self.stops.feed(self.decoder.flush())
        tail += self.stops.flush()
        self.send(Delta(text=tail, finish_reason=reason, usage=usage,
                        stop_word=self.stops.stopped if reason == "stop" else None))

    def fail(self, message: str, busy: bool = False) -> None:
        """End the request with an error (`busy`: it overran a budget of its own)."""
        self.send(Delta(finish_reason="error", error=message, busy=busy))

    def send(self, delta: Delta) -> None:
        """Hand a delta to the sink. A sink that raises (its consumer's event loop has
        closed, say) means nobody is listening: the job is marked gone and the engine ends
        it, instead of the engine thread dying."""
        if self.gone:
            return
        try:
            self.sink(delta)
        except Exception:
            self.gone = True

    def usage(self) -> Usage:
        return Usage(len(self.request.prompt), self.n_out, self.cached, self.seed)

    def bias_pairs(self, vocab_size: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The logit bias (and ignore_eos bans) as (ids, values) pairs (sampling_params.
        bias_pairs), or None when the request has none (computed once: the engine reuses the
        step's device copy while the same objects come back)."""
        if self._bias is False:
            p = self.request.params
            self._bias = (bias_pairs(p, vocab_size, self.tokenizer.eog_ids)
                          if p.logit_bias or p.ignore_eos else None)
        return self._bias

    def dry_pairs(self, history: list[int], vocab_size: int,
                  n_ctx: int) -> tuple[np.ndarray, np.ndarray]:
        """The DRY penalties of the token after `history` as (ids, values) pairs
        (sampling_params.dry_pairs; none without DRY)."""
        p = self.request.params
        if p.dry_multiplier <= 0:
            return np.zeros(0, np.int32), np.zeros(0, np.float32)
        tok, key = self.tokenizer, tuple(p.dry_sequence_breakers)
        built = _dry_breakers.setdefault(tok, {})
        if key not in built:
            pieces = [tok.token_piece(i, special=True) for i in range(vocab_size)]
            built[key] = DryBreakers.build(list(key), pieces,
                                           lambda text: tok.encode(text, add_special=False))
        return dry_pairs(history, p, built[key], vocab_size, n_ctx)
