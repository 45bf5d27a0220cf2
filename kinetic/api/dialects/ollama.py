"""Ollama's API: /api/version, /api/tags, /api/ps, /api/show, /api/chat, /api/generate,
/api/embed and /api/embeddings, so that apps written for Ollama work with only their host
pointed here.

A chat, in order: `json_body` -> `chat_request` turns Ollama's body into the OpenAI dialect's
(messages with object arguments, `options` flattened, `format`, `think`) and `parse_chat`
checks every field of it, a 400 naming the Ollama field -> `plan_chat` renders the prompt and
compiles the answer's grammar, as for /v1/chat/completions -> `Answer` runs it in the engine
and reads the text with the same ChatReader: streamed as NDJSON lines (one per piece of
text, the tool calls whole in one line, then the `done` line with Ollama's counts and
durations in nanoseconds), or folded into one object with `"stream": false`. The two always
agree: kinetic/api/answer.py folds and writes the deltas, this module gives Ollama's objects.
/api/generate is the same over one user message (with `system`), or over the prompt as it is
with `raw`. What /api/tags, /api/ps and /api/show say of the model is ollama_model.py's.

Ollama knows many models; kinetic serves one. Any model name a request gives is the loaded
model, and answers name it as the request did. Errors are Ollama's shape, `{"error": "..."}`
(access.py writes it for every path under /api/), with its statuses: 400 for a bad request
and for a capability the model lacks, 503 while the model loads. Bodies of any content type
are read as JSON, as Ollama reads them; the Origin rule (access.py) keeps other sites' pages
out.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from contextlib import aclosing
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Iterator

import numpy as np
from quart import Blueprint, Response

from kinetic import __version__
from kinetic.api import embeddings as emb
from kinetic.api.answer import fold, ndjson_line, stream
from kinetic.api.chat_reply import ChatReader, parse_and_plan
from kinetic.api.core import (ServerState, chat_logprobs, completion_prompt_ids,
                              generation, json_body, json_response, server_state,
                              shape_grammar, token_limit)
from kinetic.api.dialects.ollama_model import (capabilities, details, file_time, listing,
                                                model_info)
from kinetic.api.errors import APIError, bad_request
from kinetic.api.metrics import Task
from kinetic.api.offload import input_ids, offload
from kinetic.api.params import (MAX_LOGPROBS, ChatRequest, Options, check_prompt_fits,
                                options as read_options, parse_chat)
from kinetic.engine.encoder import normalize
from kinetic.engine.request import Delta, GenerationRequest, TokenLogprob
from kinetic.grammar import Grammar
from kinetic.memory import resident_bytes

blueprint = Blueprint("ollama", __name__)

# the Ollama release whose API these routes follow (clients check it for features: format
# as a schema, think, logprobs); kinetic's own version is beside it
OLLAMA_VERSION = "0.13.0"
DONE_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}
MAX_NAME_CHARS = 512

# options that change the answer: Ollama's name -> the field params.options reads
OPTIONS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p",
           "min_p": "min_p", "typical_p": "typical_p", "seed": "seed",
           "num_predict": "n_predict", "stop": "stop", "repeat_penalty": "repeat_penalty",
           "repeat_last_n": "repeat_last_n", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty", "mirostat": "mirostat",
           "mirostat_tau": "mirostat_tau", "mirostat_eta": "mirostat_eta"}
# options Ollama knows that change nothing here (docs/server.md says why), and any option
# kinetic does not know, are accepted and ignored, as Ollama ignores unknown options
IGNORED_OPTIONS = ("num_batch", "num_gpu", "main_gpu", "num_thread",
                   "numa", "low_vram", "use_mmap", "use_mlock", "vocab_only", "f16_kv",
                   "logits_all", "embedding_only", "penalize_newline", "tfs_z")
DEFAULT_NUM_KEEP = 4   # Ollama's: the first tokens of a prompt a truncation keeps
# the OpenAI dialect's name of a field -> the Ollama body's, for errors
FIELD_NAMES = {**{v: f"options.{k}" for k, v in OPTIONS.items()},
               "json_schema": "format", "response_format": "format",
               "chat_template_kwargs": "think", "top_logprobs": "top_logprobs"}


# --- the model (ollama_model.py describes it) ---------------------------------------------

def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@blueprint.get("/api/version")
async def version():
    return json_response({"version": OLLAMA_VERSION, "kinetic": __version__})


@blueprint.get("/api/tags")
async def tags():
    return json_response({"models": [await listing(server_state())]})


@blueprint.get("/api/ps")
async def ps():
    state = server_state()
    entry = await listing(state)
    entry.update(size=resident_bytes() or entry["size"], size_vram=0,
                 context_length=state.require_model().n_ctx,
                 # kinetic keeps the model until it stops: no expiry, as keep_alive -1 shows
                 expires_at="2318-01-01T00:00:00Z")
    return json_response({"models": [entry]})


@blueprint.post("/api/show")
async def show():
    state = server_state()
    body = await json_body()
    model_name(body)
    verbose = _flag(body, "verbose", False)
    model = state.require_model()
    gguf = model.loaded.file
    template = gguf.metadata.get("tokenizer.chat_template") or ""
    if state.kind == "text":
        template = model.template_text
        p = model.default_params
        parameters = "\n".join(f"{k:<30} {v}" for k, v in (
            ("temperature", p.temperature), ("top_k", p.top_k), ("top_p", p.top_p),
            ("min_p", p.min_p), ("repeat_penalty", p.repeat_penalty)))
    else:
        parameters = ""
    license_ = gguf.metadata.get("general.license")
    return json_response({
        "license": license_ if isinstance(license_, str) else "",
        "modelfile": f"# Modelfile generated by kinetic\nFROM {gguf.path}\n",
        "parameters": parameters, "template": template, "details": details(state),
        "model_info": model_info(gguf, verbose), "capabilities": capabilities(state),
        "modified_at": file_time(gguf.path)})


# --- reading Ollama's bodies --------------------------------------------------------------

def model_name(body: dict) -> str:
    """The request's model (Ollama's older clients send it as name): any name serves the
    loaded model, but one must be given, as Ollama requires."""
    name = body.get("model")
    if name is None:
        name = body.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("model is required", "model")
    if len(name) > MAX_NAME_CHARS:
        raise bad_request(f"model must be at most {MAX_NAME_CHARS} characters", "model")
    return name


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value


def _refuse(body: dict, names: tuple[str, ...]) -> None:
    """docs/server.md: suffix, template and context are refused, with an error saying why."""
    why = {"suffix": "kinetic does not fill in the middle",
           "template": "the model's own chat template is always used (raw: true sends the "
                       "prompt as it is)",
           "context": "the conversation is not carried as token ids; send the messages to "
                      "/api/chat (a prompt that starts like an earlier one reuses its work)"}
    for name in names:
        if body.get(name) not in (None, "", []):
            raise bad_request(f"{name} is not supported: {why[name]}", name)


def _refuse_images(images: Any, at: str) -> None:
    if images not in (None, []):
        raise bad_request(f"{at}: images need a vision model: kinetic serve was started "
                          f"without --mmproj", at)


def _image_parts(images: Any, at: str) -> list[dict]:
    """A message's `images` (base64 PNG or JPEG files, as Ollama takes them) as the OpenAI
    dialect's image_url parts, which parse_chat decodes and checks."""
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise bad_request(f"{at} must be a list of base64 images", at)
    return [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + i}}
            for i in images]


def sampling_fields(body: dict) -> dict[str, Any]:
    """Ollama's `options` (and `format`, `logprobs`, `top_logprobs`) as the fields the OpenAI
    dialect's parser reads: num_predict -1 (no limit) and -2 (until the context is full) are
    no limit."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad_request("options must be an object", "options")
    out: dict[str, Any] = {}
    for key, value in opts.items():
        if key in OPTIONS and value is not None:
            out[OPTIONS[key]] = value
    if out.get("n_predict") == -2:
        out["n_predict"] = -1
    fmt = body.get("format")
    if fmt == "json":
        out["json_schema"] = {"type": "object"}   # Ollama's JSON mode answers an object
    elif isinstance(fmt, dict) and fmt:
        out["json_schema"] = fmt
    elif fmt not in (None, "", {}):
        raise bad_request('format must be "json" or a JSON schema object', "format")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) is not None:
            out[name] = body[name]
    return out


def _think_kwargs(body: dict, state: ServerState) -> dict[str, Any]:
    """`think` as the chat template's enable_thinking (and reasoning_effort for "low",
    "medium" or "high", which some clients send); unset: the template's default."""
    think = body.get("think")
    if think is None:
        return {}
    if think is False:
        return {"enable_thinking": False}
    if think is not True and think not in ("low", "medium", "high"):
        raise bad_request('think must be true, false, "low", "medium" or "high"', "think")
    if "thinking" not in capabilities(state):
        raise bad_request(f"{state.model_id!r} does not support thinking", "think")
    return ({"enable_thinking": True} if think is True
            else {"enable_thinking": True, "reasoning_effort": think})


def _message(m: Any, at: str, vision: bool = False) -> Any:
    """One Ollama message as the OpenAI dialect's: thinking -> reasoning_content, tool_name
    -> name, tool calls typed (their object arguments are kept: the template reads them);
    with a vision model, its images as image parts before its text."""
    if not isinstance(m, dict):
        return m   # parse_chat refuses it, naming it
    if not vision:
        _refuse_images(m.get("images"), f"{at}.images")
    out = {k: m[k] for k in ("role", "content", "tool_call_id") if k in m}
    if vision and m.get("images") not in (None, []):
        text = m.get("content")
        out["content"] = _image_parts(m["images"], f"{at}.images") + (
            [{"type": "text", "text": text}] if isinstance(text, str) and text else [])
    if m.get("thinking") is not None:
        out["reasoning_content"] = m["thinking"]
    if m.get("tool_name") is not None:
        out["name"] = m["tool_name"]
    calls = m.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [dict(c, type="function") if isinstance(c, dict) else c
                             for c in calls]
        for j, call in enumerate(out["tool_calls"]):
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and not isinstance(fn.get("arguments", {}), (dict, str)):
                raise bad_request(f"{at}.tool_calls[{j}].function.arguments must be an object",
                                  f"{at}.tool_calls[{j}].function.arguments")
    elif calls is not None:
        out["tool_calls"] = calls   # parse_chat refuses it, naming it
    return out


_IMAGE_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\](?:\.image_url)?")


def renamed(e: APIError) -> APIError:
    """An error of the OpenAI dialect's parser, naming the Ollama field instead. An image
    part (`messages[i].content[j].image_url`: _image_parts puts a message's images first, in
    order) is the message's `images[j]`."""
    param = e.param or ""
    if _IMAGE_PART.fullmatch(param):
        ours = _IMAGE_PART.sub(r"messages[\1].images[\2]", param)
        # the parser's message starts with the part's place: once, as Ollama names it
        message = _IMAGE_PART.sub(r"messages[\1].images[\2]", e.message)
        message = message.replace(f"{ours}: {ours}: ", f"{ours}: ", 1)
        e.message, e.param = message, ours
        e.args = (e.message,)
        return e
    for theirs, ours in FIELD_NAMES.items():
        if param == theirs or param.startswith((theirs + ".", theirs + "[")):
            e.message = e.message.replace(theirs, ours, 1)
            e.args = (e.message,)
            e.param = ours + param[len(theirs):]
            break
    return e


def chat_request(body: dict, state: ServerState, messages: list) -> ChatRequest:
    """An Ollama chat (or a generate made into one) as the OpenAI dialect's ChatRequest."""
    model = state.require_model()
    fields = sampling_fields(body)
    tools = body.get("tools")
    if tools not in (None, []) and not model.chat_template.supports_tools:
        raise bad_request(f"{state.model_id!r} does not support tools", "tools")
    vision = model.projector is not None
    fields.update(messages=[_message(m, f"messages[{i}]", vision)
                            for i, m in enumerate(messages)],
                  tools=tools, chat_template_kwargs=_think_kwargs(body, state))
    try:
        return parse_chat(fields, model.default_params, model.text_tokens, vision)
    except APIError as e:
        raise renamed(e) from None


def _ready_answer(name: str, key: str, keep_alive: Any) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate (no messages, or an empty
    prompt): the model is ready (done_reason "load"; "unload" for keep_alive 0, though kinetic
    keeps it)."""
    answer: dict[str, Any] = {"model": name, "created_at": _now()}
    answer.update({"message": {"role": "assistant", "content": ""}} if key == "message"
                  else {"response": ""})
    reason = "unload" if keep_alive in (0, "0", "0s", "0m") else "load"
    return dict(answer, done=True, done_reason=reason)


# --- chat and generate ----------------------------------------------------------------------

@blueprint.post("/api/chat")
async def chat():
    began, state, body, name = await _text_request("chat")
    messages = body.get("messages")
    if messages is not None and not isinstance(messages, list):
        raise bad_request("messages must be a list of messages", "messages")
    if not messages:
        return json_response(_ready_answer(name, "message", body.get("keep_alive")))
    req, plan = await parse_and_plan(
        state.require_model(), functools.partial(chat_request, body, state, messages),
        any(isinstance(m, dict) and m.get("images") for m in messages))
    answer = Answer(state, name, "message", began, req.options, plan.reader())
    return await answer.respond(body, plan.prompt, plan.grammar,
                                special_text=plan.calls is not None, images=plan.images)


@blueprint.post("/api/generate")
async def generate():
    began, state, body, name = await _text_request("generate")
    _refuse(body, ("suffix", "template", "context"))
    model, images, raw = state.require_model(), body.get("images"), _flag(body, "raw", False)
    if model.projector is None:
        _refuse_images(images, "images")
    elif raw and images not in (None, []):   # images go with the prompt through the template
        raise bad_request("images: a raw prompt takes no images (send them without \"raw\", "
                          "or through /api/chat)", "images")
    prompt, system = body.get("prompt"), body.get("system")
    for field, value in (("prompt", prompt), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise bad_request(f"{field} must be a string", field)
    if not prompt:
        return json_response(_ready_answer(name, "response", body.get("keep_alive")))
    if raw:
        try:
            opts = await offload(read_options, sampling_fields(body), model.default_params,
                                 _logprobs(body), model.text_tokens)
        except APIError as e:
            raise renamed(e) from None
        ids = await offload(completion_prompt_ids, model, prompt)
        grammar = (None if opts.shape is None else
                   await asyncio.to_thread(shape_grammar, model, opts.shape))
        return await Answer(state, name, "response", began, opts).respond(body, ids, grammar)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt, **({"images": images} if images else {})}]
    req, plan = await parse_and_plan(
        model, functools.partial(chat_request, body, state, messages), bool(images), "prompt")
    answer = Answer(state, name, "response", began, req.options, plan.reader())
    return await answer.respond(body, plan.prompt, plan.grammar, images=plan.images)


def fit_context(body: dict, prompt: list[int], limit: int | None, n_ctx: int, param: str,
                images: bool = False) -> tuple[list[int], int | None]:
    """(the prompt, the answer's token limit) within this request's context, as Ollama
    runs them: `options.num_ctx` (within the server's context: kinetic does not reload the
    model for a larger one), and a prompt that does not fit cut to its first
    `options.num_keep` tokens (4) and its newest ones, unless `"truncate": false` (then a
    400). The cut leaves room for the answer that Ollama's context shift would make: its
    num_predict, at most half the context (half when none is given). The answer stops at
    the context (done_reason "length")."""
    opts = body.get("options") if isinstance(body.get("options"), dict) else {}
    ctx = n_ctx
    if opts.get("num_ctx") is not None:
        num_ctx = opts["num_ctx"]
        if isinstance(num_ctx, bool) or not isinstance(num_ctx, int) or num_ctx < 1:
            raise bad_request("num_ctx must be a positive integer", "options.num_ctx")
        ctx = min(num_ctx, n_ctx)
    keep = opts.get("num_keep")
    if keep is None:
        keep = DEFAULT_NUM_KEEP
    elif isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise bad_request("num_keep must be an integer of at least 0", "options.num_keep")
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise bad_request("truncate must be true or false", "truncate")
    if len(prompt) >= ctx:
        if not truncate or images:   # an image's rows cannot be cut apart
            check_prompt_fits(len(prompt), ctx, param)
        room = min(max(1, ctx // 2 if limit is None else min(limit, ctx // 2)), ctx - 1)
        if room < 1:   # a context of one token holds no prompt and no answer
            check_prompt_fits(len(prompt), ctx, param)
        keep = min(keep, ctx - room)
        newest = ctx - room - keep
        prompt = prompt[:keep] + (prompt[-newest:] if newest else [])
    left = ctx - len(prompt)
    return prompt, left if limit is None else min(limit, left)


def _logprobs(body: dict) -> int | None:
    """logprobs / top_logprobs as the parser's one value (None: none asked for)."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise bad_request("logprobs must be true or false", "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(f"top_logprobs must be an integer between 0 and {MAX_LOGPROBS}",
                          "top_logprobs")
    return (top or 0) if want else None


async def _text_request(what: str) -> tuple[float, ServerState, dict, str]:
    """The start of a chat or a generate: when it began, the server's state, the body and
    the model name it gives; 400 unless the loaded model generates text."""
    began = time.perf_counter()
    state = server_state()
    body = await json_body()
    name = model_name(body)
    state.require_model()
    if state.kind != "text":
        use = " (use /api/embed)" if state.kind == "embedding" else ""
        raise bad_request(f"{state.model_id!r} does not support {what}: it is a {state.kind} "
                          f"model{use}")
    return began, state, body, name


class Answer:
    """One generation in Ollama's shape: `key` "message" (a chat: the text in message.content,
    reasoning in message.thinking, calls in message.tool_calls) or "response" (a generate:
    response and thinking). `lines` streams it as NDJSON, `whole` folds the same deltas into
    one object; both read the text with the same reader."""

    def __init__(self, state: ServerState, name: str, key: str, began: float, opts: Options,
                 reader: ChatReader | None = None):
        self.state, self.name, self.key, self.began = state, name, key, began
        self.opts, self.reader = opts, reader   # reader None: the text as it comes (raw)
        self.tokenizer = state.require_model().tokenizer
        self.task: Task | None = None

    async def respond(self, body: dict, prompt: list[int], grammar: Grammar | None,
                      special_text: bool = False, images: tuple = ()) -> Response:
        """Run `prompt` (400 if it leaves no room in the context) and answer, streamed unless
        the body says "stream": false."""
        opts = self.opts
        limit = token_limit(self.state, opts.max_tokens)
        prompt, limit = fit_context(body, prompt, limit, self.state.require_model().n_ctx,
                                    "messages" if self.key == "message" else "prompt",
                                    bool(images))
        try:
            gen = GenerationRequest(prompt, opts.params, limit,
                                    opts.stop, opts.logprobs, grammar=grammar,
                                    special_text=special_text, images=images)
        except ValueError as e:
            raise bad_request(str(e), "options") from None
        if _flag(body, "stream", True):
            resp = Response(self.lines(gen), mimetype="application/x-ndjson")
            resp.timeout = None   # a stream lasts as long as its generation
            return resp
        return json_response(await self.whole(gen))

    def _piece(self, reasoning: str, content: str, calls=(),
               lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.name, "created_at": _now()}
        if self.key == "message":
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = [
                    {"function": {"index": i, "name": c.name,
                                  "arguments": _arguments(c.arguments)}}
                    for i, c in enumerate(calls)]
            out["message"] = message
        else:
            out["response"] = content
            if reasoning:
                out["thinking"] = reasoning
        if self.opts.logprobs is not None and lps is not None:
            out["logprobs"] = chat_logprobs(self.tokenizer, lps)
        out["done"] = False
        return out

    def _done(self, piece: dict[str, Any], last: Delta) -> dict[str, Any]:
        """The last object: done, why, and Ollama's counts and durations (nanoseconds)."""
        usage = last.usage
        timings = self.task.timings()
        piece.update(done=True, done_reason=DONE_REASONS.get(last.finish_reason, "stop"),
                     total_duration=int((time.perf_counter() - self.began) * 1e9),
                     load_duration=0,   # the model was loaded when the server started
                     prompt_eval_count=usage.prompt_tokens if usage else 0,
                     prompt_eval_duration=int(timings["prompt_ms"] * 1e6),
                     eval_count=usage.completion_tokens if usage else 0,
                     eval_duration=int(timings["predicted_ms"] * 1e6))
        return piece

    async def whole(self, gen: GenerationRequest) -> dict[str, Any]:
        self.task = Task(gen)
        whole = await fold(generation(self.state, gen, "ollama", task=self.task))
        reasoning, content, calls = (self.reader.read(whole.text) if self.reader
                                     else ("", whole.text, ()))
        return self._done(self._piece(reasoning, content, calls, whole.logprobs), whole.last)

    async def lines(self, gen: GenerationRequest) -> AsyncIterator[str]:
        """The stream (answer.stream): a line per piece of text the reader releases
        (log-probabilities of held-back text wait for the next line), the calls whole in one
        line, then the done line. An engine error ends it with an {"error": ...} line."""
        reader = self.reader
        held: list[TokenLogprob] = []

        def sent(piece: dict[str, Any]) -> dict[str, Any]:
            held.clear()   # the piece carries them
            return piece

        def pieces(d: Delta) -> Iterator[dict[str, Any]]:
            held.extend(d.logprobs)
            reasoning, content = reader.feed(d.text) if reader else ("", d.text)
            if reasoning or content:
                yield sent(self._piece(reasoning, content, lps=held))
            if d.finish_reason is None:
                return
            reasoning, content, calls = reader.finish() if reader else ("", "", ())
            if reasoning or content or calls:
                yield sent(self._piece(reasoning, content, calls, lps=held))
            yield sent(self._done(self._piece("", "", lps=held if held else None), d))

        self.task = Task(gen, stream=True)   # the generation's timings start here
        deltas = generation(self.state, gen, "ollama", stream=True, task=self.task)
        async with aclosing(stream(deltas, pieces, ndjson_line,
                                   lambda e: {"error": e.message})) as out:
            async for line in out:
                yield line


def _arguments(text: str) -> Any:
    """A call's arguments as an object, as Ollama returns them (the reader only returns
    calls whose arguments parse; anything else stays as the text)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- embeddings -----------------------------------------------------------------------------

def _require_embedding(state: ServerState) -> Any:
    model = state.require_model()
    if state.kind != "embedding":
        raise bad_request(f"{state.model_id!r} does not support embeddings: it is a "
                          f"{state.kind} model; serve an embedding model for /api/embed")
    if model.pooling == "none":
        raise bad_request("the model's pooling is none (a vector per token), which Ollama's "
                          "API cannot answer; use /embedding")
    return model


@blueprint.post("/api/embed")
async def embed():
    """Vectors for one text or a list, L2-normalized as Ollama's are; `dimensions` keeps the
    first n of each (normalized again); truncate (on by default, as in Ollama) cuts inputs to
    the context."""
    began = time.perf_counter()
    state = server_state()
    body = await json_body()
    name = model_name(body)
    model = _require_embedding(state)
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                             or not 1 <= dims <= model.dim):
        raise bad_request(f"dimensions must be an integer between 1 and {model.dim}",
                          "dimensions")
    value = body.get("input")
    if value in (None, [], ""):
        return json_response({"model": name, "embeddings": [], "total_duration": 0,
                              "load_duration": 0, "prompt_eval_count": 0})
    ids = await offload(input_ids, state, emb.parse_inputs(value, "input"), "input",
                        _flag(body, "truncate", True))
    vectors = await emb.encode(state, ids, model.encoder.pooled)
    out = [emb.vector_json(normalize(np.asarray(v)[:dims], 2)) for v in vectors]
    return json_response({"model": name, "embeddings": out,
                          "total_duration": int((time.perf_counter() - began) * 1e9),
                          "load_duration": 0, "prompt_eval_count": sum(len(t) for t in ids)})


@blueprint.post("/api/embeddings")
async def embeddings():
    """Ollama's older route: one prompt, its vector as the model pools it (not normalized,
    as Ollama's is not); an empty prompt, an empty vector."""
    state = server_state()
    body = await json_body()
    model_name(body)
    model = _require_embedding(state)
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad_request("prompt must be a string", "prompt")
    if not prompt:
        return json_response({"embedding": []})
    ids = await offload(emb.token_ids, state, [prompt], "prompt", True)
    (vector,) = await emb.encode(state, ids, model.encoder.pooled)
    return json_response({"embedding": emb.vector_json(vector)})
