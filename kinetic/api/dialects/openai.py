"""The OpenAI dialect: /v1/models, /v1/chat/completions, /v1/completions.

A chat completion, in order: `json_body` -> `parse_chat` (every field checked, 400 naming the
one at fault) -> `plan_chat` (chat_reply.py) renders the messages with the tools, makes the
prompt and compiles the answer's grammar (in a worker thread: a long prompt must not stall
other connections) -> the prompt must fit the context (400) -> `generation` runs it in the
engine, and a `ChatReader` takes the text apart into reasoning, content and tool calls.
Streamed, each Delta becomes `chat.completion.chunk` events; otherwise the same deltas are
folded into one answer and read by the same reader, so the two always agree (the fold and the
stream writer are kinetic/api/answer.py's; `_Job` gives the OpenAI objects).

The paths also answer without /v1, except /completions and /embeddings, which are
llama-server's there (docs/server.md, kinetic/api/dialects/llama_server.py).
"""

from __future__ import annotations

import asyncio
import codecs
import dataclasses
import functools
import json
import secrets
import time
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from quart import Blueprint

from kinetic import __version__
from kinetic.api import embeddings as emb
from kinetic.api.answer import Folded, fold, sse_event, stream
from kinetic.api.core import (ServerState, chat_logprobs, completion_prompt_ids, generation,
                              json_body, json_response, require_kind, server_state, serves,
                              shape_grammar, sse_response, token_limit)
from kinetic.api.errors import APIError, bad_request
from kinetic.api.metrics import Task
from kinetic.api.offload import input_ids, offload, rank_ids
from kinetic.api.chat_reply import ChatReader, parse_and_plan, tool_call_objects
from kinetic.api.params import Options, check_prompt_fits, parse_chat, parse_completion
from kinetic.api.receipt import receipt_maker
from kinetic.engine.encoder import normalize
from kinetic.engine.request import Delta, GenerationRequest, TokenLogprob, Usage
from kinetic.grammar import Grammar
from kinetic.text.tokenizer import Tokenizer

blueprint = Blueprint("openai", __name__)

FINGERPRINT = f"kinetic-{__version__}"
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}
DONE = "data: [DONE]\n\n"   # a finished stream's last event


# --- models -------------------------------------------------------------------------------

def _model_object(state: ServerState) -> dict[str, Any]:
    model = {"id": state.model_id, "object": "model", "created": state.created,
             "owned_by": "kinetic", "context_length": state.require_model().n_ctx,
             "capabilities": serves(state)}
    model["aliases"] = list(state.config.aliases or (state.model_id,))   # as llama-server lists
    model["tags"] = list(state.config.tags)
    return model


@blueprint.get("/v1/models")
@blueprint.get("/models")
async def list_models():
    return json_response({"object": "list", "data": [_model_object(server_state())]})


@blueprint.get("/v1/models/<path:model_id>")
@blueprint.get("/models/<path:model_id>")
async def get_model(model_id: str):
    state = server_state()
    if model_id != state.model_id and model_id not in state.config.aliases:
        raise APIError(404, f"no model {model_id!r}: this server serves {state.model_id!r}",
                       param="model", code="model_not_found")
    return json_response(_model_object(state))


# --- endpoints the loaded model does not serve --------------------------------------------

@blueprint.post("/v1/embeddings")
async def embeddings():
    """OpenAI's embeddings: one L2-normalized vector per input (embeddings.py reads them)."""
    state = server_state()
    model = require_kind(state, "embedding", "embeddings")
    body = await json_body()
    if model.pooling == "none":
        raise bad_request("the model's pooling is none (a vector per token), which the OpenAI "
                          "API cannot answer; use /embedding")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format must be float or base64", "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and dims != model.dim:
        raise bad_request(f"the model's vectors have {model.dim} dimensions; dimensions cannot "
                          f"change that", "dimensions")
    truncate = emb.flag(body, "truncate")
    ids = await offload(input_ids, state, emb.parse_inputs(body.get("input"), "input"),
                        "input", truncate)
    vectors = await emb.encode(state, ids, model.encoder.pooled)
    data = [{"object": "embedding", "index": i,
             "embedding": emb.vector_json(normalize(v, 2), fmt)} for i, v in enumerate(vectors)]
    return json_response({"object": "list", "model": state.model_id, "data": data,
                          "usage": emb.usage(sum(len(t) for t in ids))})


@blueprint.post("/v1/rerank")
@blueprint.post("/v1/reranking")
@blueprint.post("/rerank")
@blueprint.post("/reranking")
async def rerank():
    """Documents scored against a query, most relevant first (llama-server's and Jina's
    shape)."""
    state = server_state()
    model = require_kind(state, "rerank", "reranking")
    body = await json_body()
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("query must be a non-empty string", "query")
    docs = emb.parse_documents(body.get("documents"))
    top_n = body.get("top_n", len(docs))
    if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
        raise bad_request("top_n must be a whole number of at least 0", "top_n")
    with_docs = emb.flag(body, "return_documents")
    ids = await offload(rank_ids, state, query, docs, emb.flag(body, "truncate"))
    scores = await emb.encode(state, ids, model.encoder.scores)
    order = sorted(range(len(docs)), key=lambda i: -scores[i])
    results = []
    for i in order[:top_n]:
        r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if with_docs:
            r["document"] = {"text": docs[i]}
        results.append(r)
    return json_response({"object": "list", "model": state.model_id, "results": results,
                          "usage": emb.usage(sum(len(t) for t in ids))})


# --- chat completions ---------------------------------------------------------------------

def _generation_request(state: ServerState, prompt: list[int], opts: Options, param: str,
                        grammar: Grammar | None = None, special_text: bool = False,
                        images: tuple = ()) -> GenerationRequest:
    try:
        return GenerationRequest(prompt, opts.params, token_limit(state, opts.max_tokens),
                                 opts.stop, opts.logprobs, grammar=grammar,
                                 special_text=special_text, images=images)
    except ValueError as e:
        raise bad_request(str(e), param) from None


def _has_images(body: dict) -> bool:
    """Whether a chat body has image parts (parse_chat decodes them)."""
    messages = body.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
                for p in m["content"]) for m in messages)


@blueprint.post("/v1/chat/completions")
@blueprint.post("/chat/completions")
async def chat_completions():
    state = server_state()
    model = require_kind(state, "text", "chat completions")
    body = await json_body()
    req, plan = await parse_and_plan(model, functools.partial(
        parse_chat, body, model.default_params, model.text_tokens,
        vision=model.projector is not None), _has_images(body))
    check_prompt_fits(len(plan.prompt), model.n_ctx, "messages")
    gen = _generation_request(state, plan.prompt, req.options, "messages", plan.grammar,
                              special_text=plan.calls is not None, images=plan.images)
    jobs = await _choices("chatcmpl", state, model.tokenizer, req.options, gen)
    if req.options.stream:
        return sse_response(_merged([job.chat_events(g, plan.reader()) for job, g in jobs]))
    return json_response(_whole(await _all(
        job.chat_answer(g, plan.reader()) for job, g in jobs)))


# --- completions --------------------------------------------------------------------------

@blueprint.post("/v1/completions")
async def completions():
    state = server_state()
    model = require_kind(state, "text", "completions")
    req = await offload(parse_completion, await json_body(), model.default_params,
                        model.text_tokens)
    prompt = await offload(completion_prompt_ids, model, req.prompt)
    check_prompt_fits(len(prompt), model.n_ctx, "prompt")
    grammar = None
    if req.options.shape is not None:
        grammar = await asyncio.to_thread(shape_grammar, model, req.options.shape)
    gen = _generation_request(state, prompt, req.options, "prompt", grammar)
    jobs = await _choices("cmpl", state, model.tokenizer, req.options, gen)
    if req.options.stream:
        return sse_response(_merged([job.completion_events(g) for job, g in jobs]))
    return json_response(_whole(await _all(job.completion_answer(g) for job, g in jobs)))


# --- n choices ----------------------------------------------------------------------------
#
# `n` answers of one prompt are n sequences of the engine, one _Job each under one id: the
# first runs its prompt, the others start once it has (its first delta), so that they find
# the prompt's whole pages in the prefix cache and share them. Choice i's seed is the
# request's plus i (a request without one gets a fresh seed per choice), so each choice is
# what a request with n = 1 and that seed gives.

async def _choices(prefix: str, state: ServerState, tok: Tokenizer, opts: Options,
                   gen: GenerationRequest) -> list[tuple["_Job", GenerationRequest]]:
    """The jobs of `opts.n` choices and their requests, receipt makers made if asked for."""
    first = _Job(prefix, state, tok, opts)
    jobs = []
    gate = asyncio.Event() if opts.n > 1 else None
    for i in range(opts.n):
        job = first if i == 0 else _Job(prefix, state, tok, opts, job_id=first.id)
        g = gen if opts.n == 1 else dataclasses.replace(
            _seeded(gen, i), group=first.id)   # one client's sequences, for fairness
        job.started, job.after = (gate, None) if i == 0 else (None, gate)
        if opts.receipt:
            job.receipt = await receipt_maker(state, g)
        jobs.append((job, g))
    return jobs


def _seeded(gen: GenerationRequest, i: int) -> GenerationRequest:
    seed = gen.params.seed
    if i == 0 or seed is None or seed < 0:
        return gen
    return dataclasses.replace(gen, params=dataclasses.replace(gen.params, seed=seed + i))


async def _all(answers) -> list[dict[str, Any]]:
    """The choices' whole answers, run together; one failing cancels the others, and its
    error is the request's."""
    answers = list(answers)
    if len(answers) == 1:
        return [await answers[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(a) for a in answers]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def _whole(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer of the choices' answers: their choices indexed in order (each with its
    receipt, when n > 1), the prompt counted once in the usage."""
    if len(answers) == 1:
        return answers[0]
    out = dict(answers[0])
    out.pop("receipt", None)
    out["choices"] = []
    for i, a in enumerate(answers):
        choice = dict(a["choices"][0], index=i)
        if "receipt" in a:
            choice["receipt"] = a["receipt"]
        out["choices"].append(choice)
    out["usage"] = _usage_sum([a["usage"] for a in answers])
    return out


def _usage_sum(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's usage of n choices: the prompt once (as the first choice ran it), the
    completion tokens of all."""
    out = dict(usages[0])
    out["completion_tokens"] = sum(u["completion_tokens"] for u in usages)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


async def _merged(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The choices' streams as one: each chunk's choices indexed by its stream, in the order
    they come; the usage chunks (include_usage) summed into one at the end, then one [DONE].
    An error event ends the whole stream (the other choices are cancelled)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as events:
            async for event in events:
                yield event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, events: AsyncIterator[str]) -> None:
        try:
            async with aclosing(events) as it:
                async for event in it:
                    await queue.put((i, event))
        finally:
            queue.put_nowait((i, None))
    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    usages, usage_chunk, live = [], None, len(tasks)
    try:
        while live:
            i, event = await queue.get()
            if event is None:
                live -= 1
                continue
            if event == DONE:
                continue
            obj = json.loads(event[len("data: "):])
            if "error" in obj:
                yield event
                return
            for choice in obj.get("choices") or []:
                choice["index"] = i
            if obj.get("choices") == [] and obj.get("usage"):
                usages.append(obj["usage"])
                usage_chunk = obj
                continue
            yield sse_event(obj)
        if usage_chunk is not None:
            yield sse_event(dict(usage_chunk, usage=_usage_sum(usages)))
        yield DONE
    finally:
        for t in tasks:
            t.cancel()


# --- answers ------------------------------------------------------------------------------

def usage_object(u: Usage | None) -> dict[str, Any]:
    u = u or Usage(0, 0, 0, 0)
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


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

    def __init__(self, prefix: str, state: ServerState, tok: Tokenizer, opts: Options,
                 job_id: str | None = None):
        self.id = job_id or f"{prefix}-{secrets.token_hex(12)}"
        # n choices (_choices): the first sets `started` at its first delta (its prompt has
        # run), the others wait for it (`after`) before they start
        self.started: asyncio.Event | None = None
        self.after: asyncio.Event | None = None
        self.created, self.model_id = int(time.time()), state.model_id
        self.state = state
        self.tok, self.opts = tok, opts
        self.receipt = None   # a ReceiptMaker when the request asks for a receipt
        self.task: Task | None = None   # the generation's record: llama-server's timings

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "system_fingerprint": FINGERPRINT}

    async def _fold(self, gen: GenerationRequest) -> Folded:
        self.task = Task(gen)
        return await fold(self._deltas(gen, False), self.receipt)

    async def _deltas(self, gen: GenerationRequest, streamed: bool) -> AsyncIterator[Delta]:
        """generation's deltas, after `after` is set; `started` set at the first (or when
        this one ends without any)."""
        try:
            if self.after is not None:
                await self.after.wait()
            async with aclosing(generation(self.state, gen, self.id, stream=streamed,
                                           task=self.task)) as deltas:
                async for d in deltas:
                    if self.started is not None:
                        self.started.set()
                    yield d
        finally:
            if self.started is not None:
                self.started.set()

    def _with_receipt(self, answer: dict[str, Any]) -> dict[str, Any]:
        """The whole answer with llama-server's timings, and its receipt if asked for."""
        answer["timings"] = self.task.timings()
        if self.receipt is not None:
            answer["receipt"] = self.receipt.receipt()
        return answer

    async def chat_answer(self, gen: GenerationRequest, reader: ChatReader) -> dict[str, Any]:
        whole = await self._fold(gen)
        reasoning, content, calls = reader.read(whole.text)
        logprobs = ({"content": chat_logprobs(self.tok, whole.logprobs)}
                    if self.opts.logprobs is not None else None)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = content or None
            message["tool_calls"] = tool_call_objects(calls, streamed=False)
        return self._with_receipt(dict(self._head("chat.completion"), choices=[{
            "index": 0, "message": message, "logprobs": logprobs,
            "finish_reason": _finish_reason(whole.last.finish_reason, calls),
        }], usage=usage_object(whole.last.usage)))

    async def completion_answer(self, gen: GenerationRequest) -> dict[str, Any]:
        whole = await self._fold(gen)
        logprobs = (LegacyLogprobs(self.tok).take(tuple(whole.logprobs))
                    if self.opts.logprobs is not None else None)
        return self._with_receipt(dict(self._head("text_completion"), choices=[{
            "index": 0, "text": whole.text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS.get(whole.last.finish_reason, "stop"),
        }], usage=usage_object(whole.last.usage)))

    def _chunk_object(self, kind: str, choice: dict[str, Any]) -> dict[str, Any]:
        obj = dict(self._head(kind), choices=[{"index": 0, **choice}])
        if self.opts.include_usage:
            obj["usage"] = None  # only the last chunk carries usage
        return obj

    def _chunks(self, kind: str, d: Delta, choices: list[dict[str, Any]]) -> list[dict]:
        """The chunks of one delta: one per choice (for the last delta they end with the
        choice that carries the finish reason), then the usage chunk if asked for; the last
        chunk carries llama-server's timings and the receipt, if asked for."""
        chunks = [self._chunk_object(kind, choice) for choice in choices]
        if d.finish_reason is not None:
            if self.opts.include_usage:
                chunks.append(dict(self._head(kind), choices=[], usage=usage_object(d.usage)))
        if chunks and (self.opts.timings_per_token or d.finish_reason is not None):
            # llama-server's timings: in the last chunk, and with timings_per_token in every
            # chunk after the role chunk
            timings = self.task.timings()
            for chunk in (chunks if self.opts.timings_per_token else chunks[-1:]):
                chunk["timings"] = timings
        if self.receipt is not None and d.finish_reason is not None and chunks:
            chunks[-1]["receipt"] = self.receipt.receipt()
        return chunks

    async def _events(self, gen: GenerationRequest, kind: str,
                      choices: Callable[[Delta], list[dict[str, Any]]],
                      first: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """The stream (answer.stream): the `first` chunk's event if given, then those of the
        chunks of each delta's `choices`, then [DONE]; an engine error ends it with an error
        event in the OpenAI shape."""
        if first is not None:
            yield sse_event(self._chunk_object(kind, first))
        self.task = Task(gen, stream=True)   # the generation's timings start here
        deltas = self._deltas(gen, True)
        async with aclosing(stream(deltas, lambda d: self._chunks(kind, d, choices(d)),
                                   sse_event, APIError.body, receipt=self.receipt,
                                   end=DONE)) as events:
            async for event in events:
                yield event

    def chat_events(self, gen: GenerationRequest, reader: ChatReader) -> AsyncIterator[str]:
        """Reasoning streams as delta.reasoning_content and the answer as delta.content, as
        the reader releases them; tool calls come whole in one delta.tool_calls chunk.
        Framed as llama-server frames it: a first chunk with the role and content null, then
        only chunks that carry text (never an empty delta), the finish chunk with an empty
        delta. A token's log-probability waits with its text when that is held back (part of
        a UTF-8 character, a possible tag or call) and comes in the next chunk that carries
        text; those of the tokens that became calls come with the calls, any left with the
        finish chunk, so the stream's entries add up to the whole answer's."""
        held: list[TokenLogprob] = []   # log-probabilities not sent yet

        def logprobs(always: bool = True) -> dict[str, Any] | None:
            if self.opts.logprobs is None or not (always or held):
                return None
            out = {"content": chat_logprobs(self.tok, held)}
            held.clear()
            return out

        def choice(reasoning: str, content: str) -> dict[str, Any]:
            delta = {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content:
                delta["content"] = content
            return {"delta": delta, "finish_reason": None, "logprobs": logprobs()}

        def pieces(d: Delta) -> list[dict[str, Any]]:
            held.extend(d.logprobs)
            out = []
            reasoning, content = reader.feed(d.text)
            if reasoning or content:
                out.append(choice(reasoning, content))
            if d.finish_reason is not None:
                reasoning, content, calls = reader.finish()
                if reasoning or content:
                    out.append(choice(reasoning, content))
                if calls:
                    out.append({"delta": {"tool_calls": tool_call_objects(calls, streamed=True)},
                                "finish_reason": None, "logprobs": logprobs(always=False)})
                out.append({"delta": {}, "logprobs": logprobs(always=False),
                            "finish_reason": _finish_reason(d.finish_reason, calls)})
            return out

        return self._events(gen, "chat.completion.chunk", pieces, first={
            "delta": {"role": "assistant", "content": None}, "logprobs": None,
            "finish_reason": None})

    def completion_events(self, gen: GenerationRequest) -> AsyncIterator[str]:
        """Chunks that carry text, then the finish chunk; log-probabilities of held-back text
        wait for it, as in `chat_events`."""
        legacy = LegacyLogprobs(self.tok) if self.opts.logprobs is not None else None
        held: list[TokenLogprob] = []

        def logprobs(always: bool = True) -> dict[str, list] | None:
            if legacy is None or not (always or held):
                return None
            out = legacy.take(tuple(held))
            held.clear()
            return out

        def pieces(d: Delta) -> list[dict[str, Any]]:
            held.extend(d.logprobs)
            out = []
            if d.text:
                out.append({"text": d.text, "finish_reason": None, "logprobs": logprobs()})
            if d.finish_reason is not None:
                out.append({"text": "", "logprobs": logprobs(always=False),
                            "finish_reason": _finish_reason(d.finish_reason, ())})
            return out
        return self._events(gen, "text_completion", pieces)


def _finish_reason(engine_reason: str | None, calls) -> str:
    """OpenAI's finish_reason: tool_calls when the answer ended in calls."""
    reason = FINISH_REASONS.get(engine_reason, "stop")
    return "tool_calls" if calls and reason == "stop" else reason

