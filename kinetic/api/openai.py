"""The OpenAI dialect: /v1/models, /v1/chat/completions, /v1/completions.

A chat completion, in order: `json_body` -> `parse_chat` (every field checked, 400 naming the
one at fault) -> the chat template renders the messages and the tokenizer makes the prompt
(in a worker thread: a long prompt must not stall other connections) -> the prompt must fit
the context (400) -> `generation` runs it in the engine. Streamed, each Delta becomes a
`chat.completion.chunk` event; otherwise the same deltas are folded into one answer, so the
two always agree.

The paths also answer without /v1, except /completions and /embeddings, which are
llama-server's there (SPEC.md, kinetic/api/llama_server.py).
"""

from __future__ import annotations

import asyncio
import codecs
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator

from quart import Blueprint

from kinetic import __version__
from kinetic.api.app import (ServerState, generation, json_body, json_response,
                             server_state, sse_event, sse_response)
from kinetic.api.errors import APIError, bad_request
from kinetic.api.params import (ChatRequest, CompletionRequest, Options, check_prompt_fits,
                                parse_chat, parse_completion)
from kinetic.engine.request import Delta, GenerationRequest, TokenLogprob, Usage
from kinetic.text.chat_template import ChatTemplateError
from kinetic.text.tokenizer import Tokenizer

blueprint = Blueprint("openai", __name__)

FINGERPRINT = f"kinetic-{__version__}"
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}
# what each kind of model serves, to name the right endpoint in a 400
ENDPOINTS = {"text": "/v1/chat/completions or /v1/completions",
             "embedding": "/v1/embeddings", "rerank": "/v1/rerank"}


# --- models -------------------------------------------------------------------------------

def _model_object(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_id, "object": "model", "created": state.created,
            "owned_by": "kinetic", "context_length": state.require_model().n_ctx}


@blueprint.get("/v1/models")
@blueprint.get("/models")
async def list_models():
    return json_response({"object": "list", "data": [_model_object(server_state())]})


@blueprint.get("/v1/models/<path:model_id>")
@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str):
    state = server_state()
    if model_id != state.model_id:
        raise APIError(404, f"no model {model_id!r}: this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    return json_response(_model_object(state))


# --- endpoints the loaded model does not serve --------------------------------------------

def require_kind(state: ServerState, kind: str, what: str) -> None:
    """400 naming the right endpoint when the loaded model is not of `kind`."""
    if state.kind != kind:
        raise bad_request(f"the loaded model {state.model_id!r} is a {state.kind} model: it does "
                          f"not serve {what}; use {ENDPOINTS[state.kind]}")


@blueprint.post("/v1/embeddings")
async def embeddings():
    require_kind(server_state(), "embedding", "embeddings")
    raise bad_request("embedding models are not supported yet")


@blueprint.post("/v1/rerank")
@blueprint.post("/v1/reranking")
@blueprint.post("/rerank")
@blueprint.post("/reranking")
async def rerank():
    require_kind(server_state(), "rerank", "reranking")
    raise bad_request("reranking models are not supported yet")


# --- chat completions ---------------------------------------------------------------------

def _chat_prompt(model, req: ChatRequest) -> list[int]:
    try:
        text = model.apply_chat_template(req.messages, **req.template_kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from None
    return model.tokenize(text, add_special=True, parse_special=True)


def _generation_request(prompt: list[int], opts: Options, param: str) -> GenerationRequest:
    try:
        return GenerationRequest(prompt, opts.params, opts.max_tokens, opts.stop, opts.logprobs)
    except ValueError as e:
        raise bad_request(str(e), param) from None


@blueprint.post("/v1/chat/completions")
@blueprint.post("/chat/completions")
async def chat_completions():
    state = server_state()
    require_kind(state, "text", "chat completions")
    model = state.require_model()
    req = parse_chat(await json_body(), model.default_params)
    prompt = await asyncio.to_thread(_chat_prompt, model, req)
    check_prompt_fits(len(prompt), model.n_ctx, "messages")
    job = _Job("chatcmpl", state, model.tokenizer, req.options)
    gen = _generation_request(prompt, req.options, "messages")
    if req.options.stream:
        return sse_response(job.chat_events(model.engine, gen))
    return json_response(await job.chat_answer(model.engine, gen))


# --- completions --------------------------------------------------------------------------

def _completion_prompt(model, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, list):
        bad = [t for t in req.prompt if not 0 <= t < model.config.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{model.config.vocab_size - 1})", "prompt")
        return list(req.prompt)
    return model.prompt_ids(req.prompt)


@blueprint.post("/v1/completions")
async def completions():
    state = server_state()
    require_kind(state, "text", "completions")
    model = state.require_model()
    req = parse_completion(await json_body(), model.default_params)
    prompt = await asyncio.to_thread(_completion_prompt, model, req)
    check_prompt_fits(len(prompt), model.n_ctx, "prompt")
    job = _Job("cmpl", state, model.tokenizer, req.options)
    gen = _generation_request(prompt, req.options, "prompt")
    if req.options.stream:
        return sse_response(job.completion_events(model.engine, gen))
    return json_response(await job.completion_answer(model.engine, gen))


# --- answers ------------------------------------------------------------------------------

def usage_object(u: Usage | None) -> dict[str, Any]:
    u = u or Usage(0, 0, 0, 0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def chat_logprobs(tok: Tokenizer, lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list:
    """OpenAI's chat shape: per token its text, log-probability, UTF-8 bytes, alternatives."""
    def entry(tid: int, logprob: float) -> dict[str, Any]:
        return {"token": tok.token_piece(tid), "logprob": logprob,
                "bytes": list(tok.token_bytes(tid))}
    return [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, l) for t, l in lp.top])
            for lp in lps]


class LegacyLogprobs:
    """The completions shape (tokens, token_logprobs, top_logprobs, text_offset), built over
    the deltas of one answer: text_offset counts characters from the start of the answer."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.chars = tok, 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def take(self, lps: tuple[TokenLogprob, ...]) -> dict[str, list]:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        for lp in lps:
            out["tokens"].append(self.tok.token_piece(lp.token))
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self.tok.token_piece(t): l for t, l in lp.top})
            out["text_offset"].append(self.chars)
            self.chars += len(self._utf8.decode(self.tok.token_bytes(lp.token)))
        return out


class _Job:
    """One request's answer, whole or streamed: its id, header fields and how its deltas
    become OpenAI objects."""

    def __init__(self, prefix: str, state: ServerState, tok: Tokenizer, opts: Options):
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created, self.model_id = int(time.time()), state.model_id
        self.state = state
        self.tok, self.opts = tok, opts

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": FINGERPRINT}

    async def _fold(self, engine, gen: GenerationRequest) -> tuple[str, list, Delta]:
        text, lps, last = [], [], None
        async with aclosing(generation(self.state, gen, self.id)) as deltas:
            async for d in deltas:
                text.append(d.text)
                lps.extend(d.logprobs)
                last = d
        if last is None or last.finish_reason == "error":
            raise APIError(500, last.error if last and last.error else "the engine stopped")
        return "".join(text), lps, last

    async def chat_answer(self, engine, gen: GenerationRequest) -> dict[str, Any]:
        text, lps, last = await self._fold(engine, gen)
        logprobs = ({"content": chat_logprobs(self.tok, lps)}
                    if self.opts.logprobs is not None else None)
        return dict(self._head("chat.completion"), choices=[{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": logprobs, "finish_reason": FINISH_REASONS.get(last.finish_reason, "stop"),
        }], usage=usage_object(last.usage))

    async def completion_answer(self, engine, gen: GenerationRequest) -> dict[str, Any]:
        text, lps, last = await self._fold(engine, gen)
        logprobs = (LegacyLogprobs(self.tok).take(tuple(lps))
                    if self.opts.logprobs is not None else None)
        return dict(self._head("text_completion"), choices=[{
            "index": 0, "text": text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS.get(last.finish_reason, "stop"),
        }], usage=usage_object(last.usage))

    def _chunk(self, kind: str, choice: dict[str, Any]) -> str:
        obj = dict(self._head(kind), choices=[{"index": 0, **choice}])
        if self.opts.include_usage:
            obj["usage"] = None  # only the last chunk carries usage
        return sse_event(obj)

    async def _events(self, engine, gen: GenerationRequest, kind: str, piece,
                      finish: dict[str, Any]) -> AsyncIterator[str]:
        """The stream: one chunk per delta with text or log-probabilities (`piece` makes its
        choice), a last chunk with the finish reason (`finish` holds its empty content), the
        usage chunk if asked for, then [DONE]. An engine error ends it with an error event."""
        async with aclosing(generation(self.state, gen, self.id, stream=True)) as deltas:
            async for d in deltas:
                if d.finish_reason == "error":
                    yield sse_event(APIError(500, d.error or "the engine failed").body())
                    return
                if d.text or d.logprobs:
                    yield self._chunk(kind, piece(d))
                if d.finish_reason is not None:
                    reason = FINISH_REASONS.get(d.finish_reason, "stop")
                    yield self._chunk(kind, dict(finish, logprobs=None, finish_reason=reason))
                    if self.opts.include_usage:
                        yield sse_event(dict(self._head(kind), choices=[],
                                             usage=usage_object(d.usage)))
        yield "data: [DONE]\n\n"

    def chat_events(self, engine, gen: GenerationRequest) -> AsyncIterator[str]:
        want = self.opts.logprobs is not None

        def piece(d: Delta) -> dict[str, Any]:
            return {"delta": {"content": d.text}, "finish_reason": None,
                    "logprobs": {"content": chat_logprobs(self.tok, d.logprobs)} if want else None}

        async def events() -> AsyncIterator[str]:
            yield self._chunk("chat.completion.chunk", {
                "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None})
            async with aclosing(self._events(engine, gen, "chat.completion.chunk", piece,
                                             {"delta": {}})) as rest:
                async for event in rest:
                    yield event
        return events()

    def completion_events(self, engine, gen: GenerationRequest) -> AsyncIterator[str]:
        legacy = LegacyLogprobs(self.tok) if self.opts.logprobs is not None else None

        def piece(d: Delta) -> dict[str, Any]:
            return {"text": d.text, "finish_reason": None,
                    "logprobs": legacy.take(d.logprobs) if legacy else None}
        return self._events(engine, gen, "text_completion", piece, {"text": ""})

