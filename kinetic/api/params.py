"""Request bodies (parsed JSON) checked and turned into typed requests, at the edge.

Every field of docs/server.md's request fields is read here, under its OpenAI name and,
where llama-server has another, under that one too. A field with the wrong type or out of
range is a 400 naming it (`APIError.param`: a top-level field by its name, a value inside
one by its path, `messages[0].content[1].text`, as body.py names a bad string). Fields that
are null count as absent, and fields kinetic does not know are ignored, as OpenAI clients
send many. Every value a route or the chat template reads is type-checked here, so a wrong
type is a 400 and never a TypeError later. Everything a client controls is bounded: the body
size and depth by the server (body.py), and here max_tokens, the stop strings, logit_bias
entries and DRY breakers.

The result is an `Options` (what the engine needs besides the prompt) inside a
`ChatRequest` (messages, tools) or a `CompletionRequest` (prompt); the routes render and
tokenize the prompt and make the engine's `GenerationRequest`. Parsing tokenizes (logit_bias
keys written as text) and decodes images, so the routes run it in a worker thread
(offload.py), never on the event loop. A shape for the answer (grammar, json_schema,
response_format) stays as the client gave it in `Options.shape`; `compile_shape` turns it
into a Grammar off the event loop. The parser never calls the engine: the route readies the
grammar for it (core.shape_grammar).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable

from kinetic.api.errors import bad_request, context_exceeded, not_supported
from kinetic.engine.request import MAX_LOGPROBS, MAX_STOP_STRINGS
from kinetic.engine.sampling_params import INT32_MAX, MAX_LOGIT_BIAS, SEED_MAX, SamplingParams
from kinetic.grammar import (Grammar, GrammarError, UnsupportedSchema,
                             compile_gbnf, compile_json_schema)
from kinetic.grammar.json_schema import InvalidSchema, check_types
from kinetic.grammar.json_schema.keywords import unesc
from kinetic.text.chat_messages import MESSAGE_STRINGS

MAX_TOKENS_LIMIT = 1 << 20      # generation also ends when the context is full
MAX_STOP_CHARS = 1000           # per stop string
MAX_DRY_BREAKERS = 64

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
    receipt: bool = False            # add a receipt of the answer (kinetic/api/receipt.py)
    timings_per_token: bool = False  # llama-server's timings in every streamed chunk
    n: int = 1                       # choices: answers sampled from the one prompt


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    template_kwargs: dict[str, Any]
    options: Options
    tools: list[dict] | None = None      # the tools offered (none when tool_choice is "none")
    tool_choice: str | None = None       # "auto", "required", or the one function's name
    parallel_tool_calls: bool = False
    images: tuple = ()                   # the image parts' images (kinetic.vision.images.Image),
                                         # in the order of the messages' media markers

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
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    if above is not None and value <= above:
        raise bad_request(f"{name} must be greater than {above:g}, got {value!r}", name)
    _in_range(name, value, lo, hi)  # before float(): an integer past 1e308 cannot be one
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


# a model's tokenizer for text in a request's fields (logit_bias keys), without special tokens
Tokenize = Callable[[str], list[int]]


def sampling_params(body: dict, defaults: SamplingParams,
                    tokenize: Tokenize | None = None) -> SamplingParams:
    """`defaults` (the model's recommended sampling) with the request's fields applied."""
    overrides: dict[str, Any] = {}
    for name, field, read in SAMPLING_FIELDS:
        value = read(body, name)
        if value is not None:
            overrides[field] = value
    if overrides.get("dry_sequence_breakers") == ():
        raise bad_request("dry_sequence_breakers must not be empty", "dry_sequence_breakers")
    bias = logit_bias(body, tokenize)
    if bias is not None:
        overrides["logit_bias"] = bias
    try:
        return dataclasses.replace(defaults, **overrides)
    except ValueError as e:  # SamplingParams' own checks; its messages start with the field
        first = str(e).split(" ")[0]
        names = {f for _, f, _ in SAMPLING_FIELDS} | {"logit_bias"}
        raise bad_request(str(e), first if first in names else None) from None


def logit_bias(body: dict, tokenize: Tokenize | None = None
               ) -> tuple[tuple[int, float], ...] | None:
    """{"token id": bias} (or llama-server's [[id, bias], ...]); bias -100..100. As in
    llama-server, a key may also be text: the bias applies to each of its tokens (with
    `tokenize`, the model's tokenizer)."""
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
        tokens = [key]
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            tokens = [int(key)]  # not "²" or "１" (str.isdigit takes them), nor 5000 digits
        elif isinstance(key, str) and tokenize is not None and 0 < len(key) <= MAX_STOP_CHARS:
            tokens = tokenize(key)
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) \
                    or not 0 <= token <= INT32_MAX:
                raise bad_request(f"logit_bias keys must be token ids (integers 0 to "
                                  f"{INT32_MAX}) or text of at most {MAX_STOP_CHARS} "
                                  f"characters, got {key!r}", "logit_bias")
        # compared, not math.isfinite()'d: an integer past 1e308 cannot become a float
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) \
                or not -100 <= bias <= 100:
            raise bad_request(f"logit_bias for token {token} must be a number between -100 "
                              f"and 100, got {bias!r}", "logit_bias")
        out.extend((t, float(bias)) for t in tokens)
    if len(out) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(out)} "
                          f"(its texts' tokens counted)", "logit_bias")
    return tuple(out)


# --- whole requests ---------------------------------------------------------------------

MAX_CHOICES = 16   # `n`: answers of one request, each a sequence of its own


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
        check_json_schema(schema, "json_schema")
        given.append(Shape("json_schema", schema, "json_schema"))
    fmt = obj(body, "response_format")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            inner = fmt.get("schema")   # llama-server also takes a schema here
            if inner is not None:
                check_json_schema(inner, "response_format.schema")
            # JSON mode answers an object (OpenAI's json_object, and llama-server's)
            given.append(Shape("json_schema", inner if inner else {"type": "object"},
                               "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_request("response_format.json_schema must be an object with a "
                                  "schema", "response_format")
            inner = spec.get("schema", True)
            if not isinstance(inner, (dict, bool)):
                raise bad_request("response_format.json_schema.schema must be a JSON Schema "
                                  "object", "response_format")
            check_json_schema(inner, "response_format.json_schema.schema")
            given.append(Shape("json_schema", inner if inner != {} else True,
                               "response_format"))
        elif kind != "text":
            raise bad_request('response_format.type must be "text", "json_object" or '
                              '"json_schema"', "response_format")
    if len(given) > 1:
        raise bad_request(f"give one of grammar, json_schema and response_format, not "
                          f"{' and '.join(g.param for g in given)}", given[1].param)
    return given[0] if given else None


def check_json_schema(schema: Any, at: str) -> None:
    """400 naming the first keyword of `schema` (at body path `at`) whose value does not have
    its JSON Schema type (the keyword table's), `param` its path in the body
    (`json_schema.properties.name.minLength`). Linear in the schema's size, so done as the body
    is parsed: a tool's parameters are read as typed even when no grammar is compiled."""
    try:
        check_types(schema)
    except InvalidSchema as e:
        raise bad_request(f"invalid JSON Schema: {e}", body_path(schema, e.path, at)) from None


def body_path(doc: Any, pointer: str, at: str) -> str:
    """The body path of a JSON pointer into `doc`, `doc` being at body path `at`:
    `/anyOf/0/minLength` is `at.anyOf[0].minLength` (an index where `doc` has a list)."""
    node = doc
    for token in pointer.split("/")[1:] if pointer != "/" else ():
        key = unesc(token)
        if isinstance(node, list) and key.isdigit() and int(key) < len(node):
            at, node = f"{at}[{key}]", node[int(key)]
        else:
            at, node = f"{at}.{key}", node.get(key) if isinstance(node, dict) else None
    return at


def compile_shape(shape: Shape) -> Grammar:
    """The Grammar of a shape; an invalid grammar or a schema feature kinetic cannot enforce
    is a 400 that says what and where. Blocking: run it in a worker thread (the route then
    readies it for the engine: core.shape_grammar)."""
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
    for i, t in enumerate(offered):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" \
                or not isinstance(fn, dict):
            raise bad_request('each tool must be {"type": "function", "function": {"name": '
                              '..., "parameters": {...}}}', f"tools[{i}]")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string",
                              f"tools[{i}].function.name")
        if not isinstance(fn.get("description", ""), str):
            raise bad_request(f"tools[{i}].function.description must be a string",
                              f"tools[{i}].function.description")
        if fn.get("parameters") is not None:
            check_json_schema(fn["parameters"], f"tools[{i}].function.parameters")
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


def options(body: dict, defaults: SamplingParams, logprobs: int | None,
            tokenize: Tokenize | None = None) -> Options:
    max_tokens = integer(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:
        max_tokens = integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if max_tokens is None:   # llama-server's name, which its OpenAI routes take too
        n_predict = integer(body, "n_predict", -1, MAX_TOKENS_LIMIT)
        if n_predict == 0:
            raise bad_request("n_predict must be -1 (no limit) or at least 1", "n_predict")
        max_tokens = None if n_predict == -1 else n_predict
    stream = bool(boolean(body, "stream"))
    stream_options = obj(body, "stream_options") or {}
    include_usage = stream_options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad_request("stream_options.include_usage must be true or false",
                          "stream_options.include_usage")
    return Options(
        params=sampling_params(body, defaults, tokenize),
        max_tokens=max_tokens,
        stop=strings(body, "stop", MAX_STOP_STRINGS, MAX_STOP_CHARS) or (),
        logprobs=logprobs,
        stream=stream,
        include_usage=bool(include_usage),
        shape=shape(body),
        receipt=bool(boolean(body, "receipt")),
        timings_per_token=bool(boolean(body, "timings_per_token")),
        n=integer(body, "n", 1, MAX_CHOICES) or 1,
    )


# --- chat messages --------------------------------------------------------------------------

MEDIA_PARTS = ("image_url", "input_image", "input_audio")


def check_message(m: Any, at: str, images: list | None = None) -> None:
    """The types of one message, as far as kinetic and chat templates read it: a 400 naming
    the value at fault (`at` is the message's path). What is left to refuse (a missing
    content, a role or an order the template rejects) is chat_messages.py's and the
    template's, still a 400. images: a list the image parts' decoded images are appended
    to (a model with a vision projector); None: image parts are refused."""
    if not isinstance(m, dict):
        raise bad_request(f"{at} must be an object with a role", at)
    if not isinstance(m.get("role"), str):
        raise bad_request(f"{at}.role must be a string", f"{at}.role")
    content = m.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            _check_part(part, f"{at}.content[{j}]", images)
    elif content is not None and not isinstance(content, str):
        raise bad_request(f"{at}.content must be a string or a list of content parts",
                          f"{at}.content")
    for key in MESSAGE_STRINGS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise bad_request(f"{at}.{key} must be a string", f"{at}.{key}")
    calls = m.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise bad_request(f"{at}.tool_calls must be a list of tool calls", f"{at}.tool_calls")
    for j, call in enumerate(calls or []):
        where = f"{at}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": '
                              f'..., "arguments": ...}}}}', where)
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise bad_request(f"{where}.id must be a string", f"{where}.id")


def _check_part(part: Any, at: str, images: list | None = None) -> None:
    """One content part: {"type": "text", "text": "..."}, or with a vision projector
    (`images` not None) an image_url part, its data URL decoded and appended to `images`;
    other media parts are refused, as is a type kinetic does not know."""
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str):
        raise bad_request(f'{at} must be a content part, {{"type": "text", "text": ...}}', at)
    if kind == "image_url" and images is not None:
        from kinetic.vision.images import ImageError, check_count, from_data_url
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        try:
            check_count(len(images) + 1)
            images.append(from_data_url(url))
        except ImageError as e:
            raise bad_request(f"{at}: {e}", f"{at}.image_url") from None
        return
    if kind in MEDIA_PARTS:
        raise bad_request(f"{kind} parts need a vision model: kinetic serve reads images with "
                          f"--mmproj (image_url parts), and audio not at all", at)
    if kind != "text":
        raise bad_request(f'{at}.type must be "text", got {kind[:40]!r}', f"{at}.type")
    if not isinstance(part.get("text"), str):
        raise bad_request(f"{at}.text must be a string", f"{at}.text")


def parse_chat(body: dict, defaults: SamplingParams,
               tokenize: Tokenize | None = None, vision: bool = False) -> ChatRequest:
    """A /v1/chat/completions body. Raises APIError (400) naming the field at fault.
    vision: the model reads images (image_url parts, decoded here)."""
    messages = _get(body, "messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of messages", "messages")
    images: list | None = [] if vision else None
    for i, m in enumerate(messages):
        check_message(m, f"messages[{i}]", images)
    kwargs = obj(body, "chat_template_kwargs") or {}
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise bad_request(f"chat_template_kwargs may not set {key!r}", "chat_template_kwargs")
    want = boolean(body, "logprobs")
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if want else None
    opts = options(body, defaults, logprobs, tokenize)
    offered, choice, parallel = tools(body)
    req = ChatRequest(messages, dict(kwargs), opts, offered, choice, parallel,
                      tuple(images or ()))
    if req.images and opts.receipt:
        raise bad_request("requests with images cannot have a receipt yet", "receipt")
    if req.forced_call and opts.shape is not None:
        raise bad_request(f"tool_choice {'required' if choice == 'required' else 'of a function'}"
                          f" cannot be combined with {opts.shape.param}", "tool_choice")
    return req


def parse_completion(body: dict, defaults: SamplingParams,
                     tokenize: Tokenize | None = None) -> CompletionRequest:
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
    return CompletionRequest(prompt, options(body, defaults, logprobs, tokenize))


def check_prompt_fits(n_tokens: int, n_ctx: int, param: str) -> None:
    """400 when the prompt leaves no room in the context for one generated token."""
    if n_tokens >= n_ctx:
        raise context_exceeded(n_tokens, n_ctx, param)
