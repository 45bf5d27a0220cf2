"""llama-server's /completion, the parts that are not the route: the request (`parse_completion`
with llama-server's prompt forms, `prompt_ids`) and the pieces of its answers that kinetic's
other dialects do not have (`probabilities`, `progress`, `pick_fields`). The route and the
answer itself are llama_server.py's.

Prompts, as llama-server reads them. `prompt` is one prompt or a list of prompts:
  - one prompt: a string; a list of token ids; a list mixing ids and strings
    ([12, 34, "text", 56]: the strings tokenized where they stand, BOS only when the list
    starts with a string); an object {"prompt_string": one of those} (with
    "multimodal_data": 400, images go to /v1/chat/completions);
  - a list holding no token id is a list of prompts, each one of the forms above (a list of
    strings alone is not one of them): the answer is then a list of answers, one per prompt
    with its `index`, unless it holds one prompt. At most MAX_PROMPTS.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from kinetic.api.embeddings import MAX_INPUTS
from kinetic.api.errors import bad_request
from kinetic.api.offload import prompt_tokens
from kinetic.api.params import (MAX_STOP_CHARS, MAX_TOKENS_LIMIT, Shape, Tokenize, boolean,
                                integer, sampling_params, shape, strings)
from kinetic.engine.request import MAX_LOGPROBS, MAX_STOP_STRINGS, TokenLogprob
from kinetic.engine.sampling_params import SamplingParams

MAX_PROMPTS = MAX_INPUTS        # prompts a request, as texts an embedding request (docs/server.md)
MAX_RESPONSE_FIELDS = 64

# one prompt: text, token ids, or ids and texts mixed in one sequence
Prompt = Union[str, list[Union[int, str]]]


@dataclass(frozen=True)
class LlamaCompletion:
    """A /completion body, checked."""

    prompts: tuple[Prompt, ...]
    many: bool                 # answer with a list (more than one prompt)
    params: SamplingParams
    n_predict: int | None      # None: not given (--n-predict's); -1: until the answer ends or
                               # the context is full
    stop: tuple[str, ...]
    stream: bool
    return_tokens: bool
    n_probs: int               # 0: no completion_probabilities
    post_sampling_probs: bool  # probabilities after the sampler chain, not the raw logits'
    timings_per_token: bool    # timings in every streamed event
    return_progress: bool      # prompt_progress events in a stream
    response_fields: tuple[str, ...]   # empty: every field
    shape: Shape | None        # grammar or json_schema (or response_format)
    receipt: bool = False      # add the answer's receipt (kinetic/api/receipt.py)


def parse_completion(body: dict, defaults: SamplingParams,
                     tokenize: Tokenize | None = None) -> LlamaCompletion:
    """llama-server's /completion fields. Raises APIError (400) naming the field at fault."""
    prompts = parse_prompts(body.get("prompt"))
    n_predict = integer(body, "n_predict", -1, MAX_TOKENS_LIMIT)
    if n_predict is None:
        n_predict = integer(body, "max_tokens", -1, MAX_TOKENS_LIMIT)
    if n_predict == 0:
        raise bad_request("n_predict must be -1 (no limit) or at least 1", "n_predict")
    boolean(body, "cache_prompt")  # always on: checked, nothing more
    return LlamaCompletion(
        prompts=tuple(prompts),
        many=len(prompts) > 1,
        params=sampling_params(body, defaults, tokenize),
        n_predict=n_predict,
        stop=strings(body, "stop", MAX_STOP_STRINGS, MAX_STOP_CHARS) or (),
        stream=bool(boolean(body, "stream")),
        return_tokens=bool(boolean(body, "return_tokens")),
        n_probs=integer(body, "n_probs", 0, MAX_LOGPROBS) or 0,
        post_sampling_probs=bool(boolean(body, "post_sampling_probs")),
        timings_per_token=bool(boolean(body, "timings_per_token")),
        return_progress=bool(boolean(body, "return_progress")),
        response_fields=strings(body, "response_fields", MAX_RESPONSE_FIELDS,
                                MAX_STOP_CHARS) or (),
        shape=shape(body),
        receipt=bool(boolean(body, "receipt")),
    )


# --- prompts ------------------------------------------------------------------------------

def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_prompts(value: Any) -> list[Prompt]:
    """The prompts of a `prompt` field (module docstring), each checked; 400 naming
    `prompt` (or `prompt[i]`) otherwise."""
    if isinstance(value, list) and not any(_is_id(x) for x in value):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        if len(value) > MAX_PROMPTS:
            raise bad_request(f"prompt has {len(value)} prompts; at most {MAX_PROMPTS} a "
                              f"request", "prompt")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    if value is None:
        raise bad_request("prompt is required: a string, token ids, or a list of prompts",
                          "prompt")
    return [_one_prompt(value, "prompt")]


def _one_prompt(value: Any, at: str) -> Prompt:
    if isinstance(value, dict):
        if "multimodal_data" in value:
            raise bad_request("multimodal_data is not read by /completion yet: send images as "
                              "image_url parts to /v1/chat/completions (with --mmproj)", at)
        if "prompt_string" not in value:
            raise bad_request(f'{at} must be a string, token ids (mixed with strings or not) or '
                              f'{{"prompt_string": ...}}', at)
        value, at = value["prompt_string"], f"{at}.prompt_string"
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{at} is an empty string", at)
        return value
    if isinstance(value, list) and value and any(_is_id(x) for x in value) \
            and all(_is_id(x) or isinstance(x, str) for x in value):
        return list(value)
    if isinstance(value, list) and not value:
        raise bad_request(f"{at} is an empty list", at)
    raise bad_request(f"{at} must be a string, token ids (mixed with strings or not) or "
                      f'{{"prompt_string": ...}}', at)


def prompt_ids(model, prompt: Prompt, at: str) -> list[int]:
    """A prompt's token ids, as llama-server makes them: text tokenized with special tokens
    parsed, BOS (where the model adds it) only before text that starts the prompt; ids
    checked against the vocabulary (400 naming `at`); the context 400 as soon as the prompt
    cannot fit (offload.prompt_tokens). Blocking: run it in a worker thread."""
    tok, n_ctx = model.tokenizer, model.n_ctx
    if isinstance(prompt, str):
        return prompt_tokens(tok, prompt, n_ctx, at)
    vocab = model.config.vocab_size
    bad = [p for p in prompt if not isinstance(p, str) and not 0 <= p < vocab]
    if bad:   # before any text is tokenized, which may refuse the prompt as too long
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", at)
    out: list[int] = []
    for i, part in enumerate(prompt):
        if isinstance(part, str):
            out += prompt_tokens(tok, part, n_ctx, at, add_special=i == 0, used=len(out))
        else:
            out.append(part)
    return out


# --- pieces of answers ----------------------------------------------------------------------

def probabilities(tok, entries: tuple[TokenLogprob, ...] | list[TokenLogprob],
                  post_sampling: bool) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities of generated tokens: per token its id, text,
    bytes and log-probability with the top alternatives (`top_logprobs`), or with
    `post_sampling` the probabilities after the sampler chain (`prob`, `top_probs`, which
    leave out the tokens the chain dropped, so there may be fewer than n_probs)."""
    if post_sampling:
        def entry(t: int, lp: float) -> dict[str, Any]:
            return dict(_token(tok, t), prob=_exp(lp))
        return [dict(entry(e.token, e.logprob),
                     top_probs=[entry(t, lp) for t, lp in e.top if lp != float("-inf")])
                for e in entries]

    def entry(t: int, lp: float) -> dict[str, Any]:
        return dict(_token(tok, t), logprob=_finite(lp))
    return [dict(entry(e.token, e.logprob), top_logprobs=[entry(t, lp) for t, lp in e.top])
            for e in entries]


def _token(tok, t: int) -> dict[str, Any]:
    """A token as a probability entry names it: control tokens as nothing, as llama-server."""
    return {"id": t, "token": tok.token_piece(t), "bytes": list(tok.token_bytes(t))}


def _exp(lp: float) -> float:
    return math.exp(lp) if lp != float("-inf") else 0.0


def _finite(lp: float) -> float:
    """JSON has no -inf: llama-server writes the lowest float32 instead."""
    return lp if lp != float("-inf") else -3.4028234663852886e38


def progress(n_prompt: int, n_cached: int, prompt_ms: float) -> dict[str, int]:
    """A finished prompt's prompt_progress: llama-server's total, cache, processed, time_ms."""
    return {"total": n_prompt, "cache": n_cached, "processed": n_prompt,
            "time_ms": int(prompt_ms)}


def pick_fields(answer: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Only `fields` of an answer, in their order, as llama-server's response_fields: a path
    "a/b" takes answer["a"]["b"] under the key "a/b"; a field the answer lacks is left out."""
    out: dict[str, Any] = {}
    for path in fields:
        node: Any = answer
        for key in path.split("/"):
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            out[path] = node
    return out
