"""Draft proposals for speculative decoding, and their exact verification.

Prompt-lookup (n-gram) drafting needs no second model: when the sequence's last n tokens
occurred earlier in it, the tokens that followed them then are proposed. Verification is
exact because every drafted position is sampled with the full sampler chain, keyed by its
own (seed, position), from logits that are bitwise those plain decoding would compute
(the step's rows never see each other); a draft token is accepted while it equals that
sample, and the first sample that differs is kept as the next token. So the output is what
plain decoding would give, token for token and log-probability for log-probability.
"""

from __future__ import annotations


def ngram_draft(tokens: list[int], max_draft: int, max_ngram: int = 3,
                min_ngram: int = 2) -> list[int]:
    """Up to max_draft tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (n from max_ngram down to min_ngram); [] when there is none."""
    n_tok = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_tok <= n:
            continue
        tail = tokens[n_tok - n:]
        # latest earlier occurrence whose continuation exists
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                follow = tokens[start + n:start + n + max_draft]
                if follow:
                    return follow
    return []


def accept(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verification step yields: the draft's prefix that equals the samples,
    then the first sample that differs (or the bonus sample after a fully accepted draft).
    sampled[j] is the token drawn at the j-th verified position (len(draft) + 1 of them)."""
    out = []
    for d, s in zip(draft, sampled):
        out.append(s)
        if s != d:
            return out
    out.append(sampled[len(draft)])
    return out
