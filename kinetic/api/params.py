"""Request bodies (parsed JSON) checked and turned into typed requests, at the edge.

Every field of SPEC.md's chat completions table is read here, under its OpenAI name and,
where llama-server has another, under that one too. A field with the wrong type or out of
range is a 400 naming it (`APIError.param`). Fields that are null count as absent, and
fields kinetic does not know are ignored, as OpenAI clients send many. Everything a client
controls is bounded: the body size by the server, and here max_tokens, the stop strings,
logit_bias entries and DRY breakers.

The result is an `Options` (what the engine needs besides the prompt) inside a
`ChatRequest` (messages) or a `CompletionRequest` (prompt); the routes render and tokenize
the prompt and make the engine's `GenerationRequest`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kinetic.api.errors import APIError, bad_request, not_supported
from kinetic.engine.request import MAX_LOGPROBS, MAX_STOP_STRINGS
from kinetic.engine.sampling_params import SamplingParams

MAX_TOKENS_LIMIT = 1 << 20      # generation also ends when the context is full
MAX_LOGIT_BIAS = 1024           # entries
MAX_STOP_CHARS = 1000           # per stop string
MAX_DRY_BREAKERS = 64
INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 1            # the sampler keys draws with the seed modulo 2**32

# keys the server itself passes to the chat template; chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "prefill_assistant")


@dataclass(frozen=True)
class Options:
    """What a chat or completion request asks of the engine, besides its prompt."""

    params: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # None: none; n: the chosen token's and n alternatives
    stream: bool = False
    include_usage: bool = False


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    template_kwargs: dict[str, Any]
    options: Options


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | list[int]
    options: Options


# --- field readers: each returns None when the field is absent or null ---------------------

def _get(body: dict, name: str) -> Any:
    return body.get(name)


def number(body: dict, name: str, lo: float | None = None, hi: float | None = None,
           above: float | None = None) -> float | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    if above is not None and value <= above:
        raise bad_request(f"{name} must be greater than {above:g}, got {value!r}", name)
    _in_range(name, value, lo, hi)
    return float(value)


def integer(body: dict, name: str, lo: int | None = None, hi: int | None = INT32_MAX) -> int | None:
    value = _get(body, name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    _in_range(name, value, lo, hi)
    return value


def boolean(body: dict, name: str) -> bool | None:
    value = _get(body, name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def obj(body: dict, name: str) -> dict | None:
    value = _get(body, name)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{name} must be an object, got {type(value).__name__}", name)
    return value


def _in_range(name: str, value: float, lo: float | None, hi: float | None) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        if lo is not None and hi is not None:
            bounds = f"between {lo:g} and {hi:g}"
        else:
            bounds = f"at least {lo:g}" if lo is not None else f"at most {hi:g}"
        raise bad_request(f"{name} must be {bounds}, got {value!r}", name)


def strings(body: dict, name: str, max_count: int, max_chars: int) -> tuple[str, ...] | None:
    """A string or a list of strings (empty strings dropped)."""
    value = _get(body, name)
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(f"{name} must be a string or a list of strings", name)
    if len(items) > max_count:
        raise bad_request(f"{name} takes at most {max_count} strings, got {len(items)}", name)
    for s in items:
        if len(s) > max_chars:
            raise bad_request(f"each of {name} must be at most {max_chars} characters", name)
    return tuple(s for s in items if s)


# --- sampling ---------------------------------------------------------------------------

# (JSON name, SamplingParams field, reader): the names clients send, llama-server's included.
SAMPLING_FIELDS = [
    ("temperature", "temperature", lambda b, n: number(b, n, 0, 100)),
    ("top_p", "top_p", lambda b, n: number(b, n, 0, 1)),
    ("top_k", "top_k", lambda b, n: integer(b, n, -INT32_MAX)),
    ("min_p", "min_p", lambda b, n: number(b, n, 0, 1)),
    ("typical_p", "typical_p", lambda b, n: number(b, n, 0, 1)),
    ("top_n_sigma", "top_n_sigma", lambda b, n: number(b, n, -1e9, 1e9)),
    ("xtc_probability", "xtc_probability", lambda b, n: number(b, n, 0, 1)),
    ("xtc_threshold", "xtc_threshold", lambda b, n: number(b, n, 0, 1)),
    ("repeat_penalty", "repeat_penalty", lambda b, n: number(b, n, hi=1e9, above=0)),
    ("repetition_penalty", "repeat_penalty", lambda b, n: number(b, n, hi=1e9, above=0)),
    ("repeat_last_n", "repeat_last_n", lambda b, n: integer(b, n, -1)),
    ("presence_penalty", "presence_penalty", lambda b, n: number(b, n, -2, 2)),
    ("frequency_penalty", "frequency_penalty", lambda b, n: number(b, n, -2, 2)),
    ("dry_multiplier", "dry_multiplier", lambda b, n: number(b, n, 0, 1e9)),
    ("dry_base", "dry_base", lambda b, n: number(b, n, -1e9, 1e9)),
    ("dry_allowed_length", "dry_allowed_length", lambda b, n: integer(b, n, 0)),
    ("dry_penalty_last_n", "dry_penalty_last_n", lambda b, n: integer(b, n, -1)),
    ("dry_sequence_breakers", "dry_sequence_breakers",
     lambda b, n: strings(b, n, MAX_DRY_BREAKERS, MAX_STOP_CHARS)),
    ("mirostat", "mirostat", lambda b, n: integer(b, n, 0, 2)),
    ("mirostat_tau", "mirostat_tau", lambda b, n: number(b, n, 0, 1e9)),
    ("mirostat_eta", "mirostat_eta", lambda b, n: number(b, n, 0, 1e9)),
    ("min_keep", "min_keep", lambda b, n: integer(b, n, 0)),
    ("seed", "seed", lambda b, n: integer(b, n, -1, SEED_MAX)),
    ("ignore_eos", "ignore_eos", boolean),
]


def sampling_params(body: dict, defaults: SamplingParams) -> SamplingParams:
    """`defaults` (the model's recommended sampling) with the request's fields applied."""
    overrides: dict[str, Any] = {}
    for name, field, read in SAMPLING_FIELDS:
        value = read(body, name)
        if value is not None:
            overrides[field] = value
    if overrides.get("dry_sequence_breakers") == ():
        raise bad_request("dry_sequence_breakers must not be empty", "dry_sequence_breakers")
    bias = logit_bias(body)
    if bias is not None:
        overrides["logit_bias"] = bias
    try:
        return dataclasses.replace(defaults, **overrides)
    except ValueError as e:  # SamplingParams' own checks; its messages start with the field
        first = str(e).split(" ")[0]
        names = {f for _, f, _ in SAMPLING_FIELDS} | {"logit_bias"}
        raise bad_request(str(e), first if first in names else None) from None


def logit_bias(body: dict) -> tuple[tuple[int, float], ...] | None:
    """{"token id": bias} (or llama-server's [[id, bias], ...]); bias -100..100."""
    value = _get(body, "logit_bias")
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [(k, v) for k, v in value]
    else:
        raise bad_request("logit_bias must be an object of token id -> bias", "logit_bias")
    if len(items) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(items)}",
                          "logit_bias")
    out = []
    for key, bias in items:
        token = key
        if isinstance(key, str) and key.isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad_request(f"logit_bias keys must be token ids (integers >= 0), got {key!r}",
                              "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias for token {token} must be a number between -100 "
                              f"and 100, got {bias!r}", "logit_bias")
        out.append((token, float(bias)))
    return tuple(out)


# --- whole requests ---------------------------------------------------------------------

GRAMMAR_LATER = "it comes with structured output (the grammar issue)"


def _refuse_unsupported(body: dict) -> None:
    n = integer(body, "n", 1)
    if n is not None and n != 1:
        raise not_supported("n other than 1", "n")
    if _get(body, "grammar") not in (None, ""):
        raise not_supported("grammar", "grammar", GRAMMAR_LATER)
    if _get(body, "json_schema") is not None:
        raise not_supported("json_schema", "json_schema", GRAMMAR_LATER)
    fmt = obj(body, "response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind in ("json_object", "json_schema"):
            raise not_supported(f"response_format {kind}", "response_format", GRAMMAR_LATER)
        if kind != "text":
            raise bad_request('response_format.type must be "text", "json_object" or '
                              '"json_schema"', "response_format")
    tools = _get(body, "tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    if tools:
        raise not_supported("tools (function calling)", "tools", GRAMMAR_LATER)
    choice = _get(body, "tool_choice")
    if choice not in (None, "none", "auto"):
        raise not_supported(f"tool_choice {choice!r}", "tool_choice", GRAMMAR_LATER)
    if boolean(body, "receipt"):
        raise not_supported("receipt", "receipt", "receipts come in a later version")


def options(body: dict, defaults: SamplingParams, logprobs: int | None) -> Options:
    _refuse_unsupported(body)
    max_tokens = integer(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    stream = bool(boolean(body, "stream"))
    stream_options = obj(body, "stream_options") or {}
    include_usage = boolean(stream_options, "include_usage")
    return Options(
        params=sampling_params(body, defaults),
        max_tokens=max_tokens,
        stop=strings(body, "stop", MAX_STOP_STRINGS, MAX_STOP_CHARS) or (),
        logprobs=logprobs,
        stream=stream,
        include_usage=bool(include_usage),
    )


def parse_chat(body: dict, defaults: SamplingParams) -> ChatRequest:
    """A /v1/chat/completions body. Raises APIError (400) naming the field at fault."""
    messages = _get(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request("each message must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("image_url", "input_image", "input_audio"):
                    raise bad_request(f"{kind} parts need a vision or audio model: the loaded "
                                      f"model reads text only, and kinetic serve does not "
                                      f"take --mmproj yet", "messages")
    kwargs = obj(body, "chat_template_kwargs") or {}
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want else None
    return ChatRequest(messages, dict(kwargs), options(body, defaults, logprobs))


def parse_completion(body: dict, defaults: SamplingParams) -> CompletionRequest:
    """A /v1/completions body: prompt is a string, a list of one string, or token ids."""
    prompt = _get(body, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("prompt must be a string, a list of one string, or a list of "
                              "token ids (one prompt per request)", "prompt")
    elif not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    if boolean(body, "echo"):
        raise not_supported("echo", "echo")
    if _get(body, "suffix") not in (None, ""):
        raise not_supported("suffix", "suffix")
    best_of = integer(body, "best_of", 1)
    if best_of is not None and best_of != 1:
        raise not_supported("best_of other than 1", "best_of")
    logprobs = integer(body, "logprobs", 0, MAX_LOGPROBS)
    return CompletionRequest(prompt, options(body, defaults, logprobs))


def check_prompt_fits(n_tokens: int, n_ctx: int, param: str) -> None:
    """400 when the prompt leaves no room in the context for one generated token."""
    if n_tokens >= n_ctx:
        raise APIError(400, f"the prompt is {n_tokens} tokens long; the context holds {n_ctx} "
                       f"(start the server with a larger -c)", param=param,
                       code="context_length_exceeded")
