"""Request bodies (parsed JSON) checked and turned into typed requests, at the edge.

Every field of SPEC.md's chat completions table is read here, under its OpenAI name and,
where llama-server has another, under that one too. A field with the wrong type or out of
range is a 400 naming it (`APIError.param`). Fields that are null count as absent, and
fields kinetic does not know are ignored, as OpenAI clients send many. Everything a client
controls is bounded: the body size by the server, and here max_tokens, the stop strings,
logit_bias entries and DRY breakers.

The result is an `Options` (what the engine needs besides the prompt) inside a
`ChatRequest` (messages, tools) or a `CompletionRequest` (prompt); the routes render and
tokenize the prompt and make the engine's `GenerationRequest`. A shape for the answer
(grammar, json_schema, response_format) stays as the client gave it in `Options.shape`;
`compile_shape` turns it into a Grammar off the event loop.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from kinetic.api.errors import APIError, bad_request, not_supported
from kinetic.engine.request import MAX_LOGPROBS, MAX_STOP_STRINGS
from kinetic.engine.sampling_params import SamplingParams
from kinetic.grammar import (Grammar, GrammarError, UnsupportedSchema, compile_gbnf,
                             compile_json_schema)

MAX_TOKENS_LIMIT = 1 << 20      # generation also ends when the context is full
MAX_LOGIT_BIAS = 1024           # entries
MAX_STOP_CHARS = 1000           # per stop string
MAX_DRY_BREAKERS = 64
INT32_MAX = 2**31 - 1
SEED_MAX = 2**64 - 1            # the sampler keys draws with the seed modulo 2**32

# keys the server itself passes to the chat template; chat_template_kwargs may not set them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "prefill_assistant")


@dataclass(frozen=True)
class Shape:
    """The answer's shape as the client gave it: GBNF text or a JSON Schema (True: any JSON)."""

    kind: str      # "gbnf" or "json_schema"
    value: Any
    param: str     # the field it came in, for errors


@dataclass(frozen=True)
class Options:
    """What a chat or completion request asks of the engine, besides its prompt."""

    params: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None      # None: none; n: the chosen token's and n alternatives
    stream: bool = False
    include_usage: bool = False
    shape: "Shape | None" = None


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    template_kwargs: dict[str, Any]
    options: Options
    tools: list[dict] | None = None      # the tools offered (none when tool_choice is "none")
    tool_choice: str | None = None       # "auto", "required", or the one function's name
    parallel_tool_calls: bool = False

    @property
    def forced_call(self) -> bool:
        return bool(self.tools) and self.tool_choice not in (None, "auto")


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

def _refuse_unsupported(body: dict) -> None:
    n = integer(body, "n", 1)
    if n is not None and n != 1:
        raise not_supported("n other than 1", "n")
    if boolean(body, "receipt"):
        raise not_supported("receipt", "receipt", "receipts come in a later version")


# --- structured output and tools ----------------------------------------------------------

MAX_GRAMMAR_CHARS = 256 * 1024
MAX_TOOLS = 128


def shape(body: dict) -> Shape | None:
    """The answer's shape: grammar (GBNF, as llama-server takes it), json_schema
    (llama-server's field) or response_format (OpenAI's); one of them at most."""
    given = []
    grammar = _get(body, "grammar")
    if grammar not in (None, ""):
        if not isinstance(grammar, str):
            raise bad_request("grammar must be a string of GBNF rules", "grammar")
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"grammar must be at most {MAX_GRAMMAR_CHARS} characters",
                              "grammar")
        given.append(Shape("gbnf", grammar, "grammar"))
    schema = _get(body, "json_schema")
    if schema not in (None, {}):
        if not isinstance(schema, (dict, bool)):
            raise bad_request("json_schema must be a JSON Schema object", "json_schema")
        given.append(Shape("json_schema", schema, "json_schema"))
    fmt = obj(body, "response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            inner = fmt.get("schema")   # llama-server also takes a schema here
            given.append(Shape("json_schema", inner if inner else True, "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_request("response_format.json_schema must be an object with a "
                                  "schema", "response_format")
            inner = spec.get("schema", True)
            if not isinstance(inner, (dict, bool)):
                raise bad_request("response_format.json_schema.schema must be a JSON Schema "
                                  "object", "response_format")
            given.append(Shape("json_schema", inner if inner != {} else True,
                               "response_format"))
        elif kind != "text":
            raise bad_request('response_format.type must be "text", "json_object" or '
                              '"json_schema"', "response_format")
    if len(given) > 1:
        raise bad_request(f"give one of grammar, json_schema and response_format, not "
                          f"{' and '.join(g.param for g in given)}", given[1].param)
    return given[0] if given else None


def compile_shape(shape: Shape) -> Grammar:
    """The Grammar of a shape; an invalid grammar or a schema feature kinetic cannot enforce
    is a 400 that says what and where."""
    param = shape.param
    try:
        if shape.kind == "gbnf":
            return compile_gbnf(shape.value)
        return compile_json_schema(shape.value)
    except GrammarError as e:
        raise bad_request(f"invalid grammar: {e}", param) from None
    except UnsupportedSchema as e:
        raise bad_request(f"unsupported JSON Schema: {e}", param) from None
    except RecursionError:
        raise bad_request("the grammar or schema is nested too deeply", param) from None


def tools(body: dict) -> tuple[list[dict] | None, str | None, bool]:
    """(the tools offered, tool_choice, parallel_tool_calls). tool_choice "none" offers no
    tools; a named function offers only that one."""
    offered = _get(body, "tools")
    if offered is not None and not isinstance(offered, list):
        raise bad_request("tools must be a list", "tools")
    offered = offered or []
    if len(offered) > MAX_TOOLS:
        raise bad_request(f"at most {MAX_TOOLS} tools", "tools")
    names = []
    for t in offered:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise bad_request('each tool must be {"type": "function", "function": {"name": '
                              '..., "parameters": {...}}}', "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, (dict, bool)):
            raise bad_request(f"tool {fn['name']!r}: parameters must be a JSON Schema object",
                              "tools")
        names.append(fn["name"])
    choice = _get(body, "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request('tool_choice must be "auto", "none", "required" or {"type": '
                              '"function", "function": {"name": ...}}', "tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools",
                              "tool_choice")
        offered = [t for t in offered if t["function"]["name"] == name]
        choice = name
    elif choice not in (None, "auto", "none", "required"):
        raise bad_request('tool_choice must be "auto", "none", "required" or {"type": '
                          '"function", "function": {"name": ...}}', "tool_choice")
    if choice == "none":
        offered = []
    if choice == "required" and not offered:
        raise bad_request('tool_choice "required" needs tools', "tool_choice")
    parallel = bool(boolean(body, "parallel_tool_calls"))
    return (offered or None), (None if choice in (None, "none") else choice), parallel


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
        shape=shape(body),
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
    opts = options(body, defaults, logprobs)
    offered, choice, parallel = tools(body)
    req = ChatRequest(messages, dict(kwargs), opts, offered, choice, parallel)
    if req.forced_call and opts.shape is not None:
        raise bad_request(f"tool_choice {'required' if choice == 'required' else 'of a function'}"
                          f" cannot be combined with {opts.shape.param}", "tool_choice")
    return req


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
