"""What goes into the engine and what comes out: typed, with no JSON and no arrays.

The API layer parses a request into a `GenerationRequest`; the engine answers with a stream
of `Delta`s, the last of which carries `finish_reason` and `usage`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from kinetic.engine.sampling_params import SamplingParams
from kinetic.grammar import Grammar

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


@dataclass(frozen=True, eq=False)
class ImageRows:
    """An image's place in a prompt: prompt positions start .. start + n - 1 take the rows of
    `embeddings` [n, d_model] (the projector's output) as their input instead of a token's
    embedding. `digest` (the image's SHA-256) names those rows in the prefix cache's page
    keys. non_causal: the rows attend to each other both ways (Gemma 3's images)."""

    start: int
    embeddings: np.ndarray
    digest: bytes
    non_causal: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.embeddings)


@dataclass(frozen=True)
class GenerationRequest:
    """prompt: token ids; max_tokens None means until the answer ends or the context is full;
    logprobs None means none, n >= 0 the chosen token's plus n alternatives; post_sampling: they
    are those of the distribution the token was drawn from, after the whole sampler chain
    (llama-server's post_sampling_probs), instead of the raw logits'. grammar: every
    token drawn (and every drafted token kept) follows it, and end-of-generation is allowed
    only where it may end. special_text: control tokens come out as their text (always so with
    a grammar, which matches them by their text; tool-call markers need it too). images:
    prompt rows given as embeddings (ImageRows; their prompt ids are placeholders). group:
    who asked, any hashable (one HTTP request's prompts share one): the scheduler hands free
    slots round-robin across groups; None: a group of its own."""

    prompt: list[int]
    params: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    post_sampling: bool = False
    speculative: bool = True
    grammar: Grammar | None = None
    special_text: bool = False
    images: tuple[ImageRows, ...] = ()   # prompt rows that are image embeddings, in order
    group: Hashable | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_LOGPROBS}")
        if self.post_sampling and self.logprobs is None:
            raise ValueError("post_sampling needs logprobs")
        at = 0
        for image in self.images:
            if image.start < at or image.end > len(self.prompt) or not len(image.embeddings):
                raise ValueError("image rows must lie in the prompt, in order, apart")
            at = image.end


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the raw logits (or the sampler chain's
    distribution: GenerationRequest.post_sampling), and the top alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    seed: int


@dataclass(frozen=True)
class Delta:
    """New output of one request: tokens accepted this step and the text they complete
    (incomplete UTF-8 and possible stop-string starts are held back until resolved)."""

    token_ids: tuple[int, ...] = ()
    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None   # "stop", "length", "cancelled" or "error"
    stop_word: str | None = None       # with "stop": the stop string that ended the answer
                                       # (None: an end-of-generation token)
    usage: Usage | None = None
    error: str | None = None           # with finish_reason "error": what went wrong
    busy: bool = False                 # with "error": this request alone overran a budget
                                       # (its grammar's masks), or the server is stopping;
                                       # not an engine failure: 503
