"""llama-server's own API: /completion, /tokenize, /detokenize, /props, /slots, /metrics.

Scripts and apps written for llama-server work against kinetic unchanged: the routes, request
fields and answer fields are llama-server's (scripts/llama_server_compat.py lists what still
differs, docs/compat.md explains why). Errors keep kinetic's OpenAI shape. These routes take
bodies of any content type, as llama-server does; the Origin rule in access.py keeps web pages of
other sites from using them.

A /completion, in order: `json_body` -> `parse_completion` (llama_completion.py:
llama-server's field names and prompt forms, checked like the OpenAI ones, 400 naming the
field) -> each prompt's token ids (text is tokenized with BOS and special tokens, as
llama-server does) -> `generation` runs each, recorded as a `Task` (metrics.py) whose slot,
cached tokens and timings the answer reports. Streamed, each delta the engine sends is one
`data: {"content": ..., "tokens": [...], "stop": false}` event (with n_probs, its tokens'
probabilities) and the last event is the whole answer object with empty content and
"stop": true; the events of several prompts come interleaved, each naming its `index`.
Otherwise the deltas are folded into that object, or a list of them for several prompts.
The fold and the stream writer are kinetic/api/answer.py's; this module gives the objects.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from contextlib import aclosing
from typing import Any, AsyncIterator, Iterator

from quart import Blueprint, Response, request

from kinetic import __version__, kernels
from kinetic.api import embeddings as emb
from kinetic.api.answer import fold, sse_event, stream
from kinetic.api.core import (ServerState, dumps, generation, json_body, json_response,
                              require_kind, server_state, serves, shape_grammar, sse_response,
                              token_limit)
from kinetic.api.errors import APIError, bad_request, unavailable
from kinetic.api.dialects.llama_completion import (LlamaCompletion, parse_completion, pick_fields,
                                          probabilities, progress, prompt_ids)
from kinetic.api.metrics import Task, metric_values, prometheus_text
from kinetic.api.offload import input_ids, offload, prompt_tokens
from kinetic.api.receipt import receipt_maker
from kinetic.api.params import INT32_MAX, boolean, check_prompt_fits, integer
from kinetic.engine.engine_config import cache_type_name
from kinetic.engine.encoder import normalize
from kinetic.engine.request import Delta, GenerationRequest
from kinetic.engine.sampling_params import SamplingParams
from kinetic.text.tokenizer import Tokenizer

blueprint = Blueprint("llama_server", __name__)

DEFAULT_SEED = 0xFFFFFFFF     # llama-server's "no seed given" (LLAMA_DEFAULT_SEED)
# llama-server's default sampler chain, under its names; with Mirostat it is the other one
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
            "temperature"]
MIROSTAT_SAMPLERS = ["temperature", "mirostat"]
# generation settings that llama-server leaves out of the params of /slots and /props
NOT_IN_PARAMS = ("dry_sequence_breakers", "stop", "logit_bias", "grammar")


# --- /completion ------------------------------------------------------------------------

def generation_settings(p: SamplingParams, *, seed: int | None = None,
                        n_predict: int | None = None, stop: tuple[str, ...] = (),
                        stream: bool = False, n_probs: int = 0,
                        grammar: str = "", timings_per_token: bool = False,
                        post_sampling_probs: bool = False) -> dict[str, Any]:
    """A request's settings under llama-server's names, in its order. seed: the one used
    (llama-server reports 4294967295 when none was given); grammar: the request's GBNF."""
    if seed is None:
        seed = p.seed if p.seed not in (None, -1) else DEFAULT_SEED
    limit = -1 if n_predict is None else n_predict
    return {
        "seed": seed, "temperature": p.temperature, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p,
        "top_n_sigma": p.top_n_sigma, "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold, "typical_p": p.typical_p,
        "repeat_last_n": p.repeat_last_n, "repeat_penalty": p.repeat_penalty,
        "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty,
        "dry_multiplier": p.dry_multiplier, "dry_base": p.dry_base,
        "dry_allowed_length": p.dry_allowed_length, "dry_penalty_last_n": p.dry_penalty_last_n,
        "dry_sequence_breakers": list(p.dry_sequence_breakers), "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau, "mirostat_eta": p.mirostat_eta, "stop": list(stop),
        "max_tokens": limit, "n_predict": limit, "n_keep": 0, "n_discard": 0,
        "ignore_eos": p.ignore_eos, "stream": stream,
        "logit_bias": [[t, b] for t, b in p.logit_bias], "n_probs": n_probs,
        "min_keep": p.min_keep, "grammar": grammar,
        "samplers": MIROSTAT_SAMPLERS if p.mirostat else SAMPLERS,
        "timings_per_token": timings_per_token, "post_sampling_probs": post_sampling_probs,
    }


@blueprint.post("/completion")
@blueprint.post("/completions")
async def completion():
    state = server_state()
    model = require_kind(state, "text", "completions")
    req = await offload(parse_completion, await json_body(), model.default_params,
                        model.text_tokens)
    prompts = await offload(_prompts_ids, model, req)
    grammar = None
    if req.shape is not None:
        grammar = await asyncio.to_thread(shape_grammar, model, req.shape)
    if req.post_sampling_probs and req.n_probs:
        await asyncio.to_thread(model.engine.prepare_post_sampling)   # once: seconds
    limit = None if req.n_predict == -1 else token_limit(state, req.n_predict)
    answers = []
    group = object()   # the prompts take turns for slots with other requests' (scheduler.py)
    for index, ids in enumerate(prompts):
        gen = GenerationRequest(ids, req.params, limit, req.stop, logprobs=req.n_probs or None,
                                post_sampling=req.post_sampling_probs and req.n_probs > 0,
                                grammar=grammar, group=group)
        # the prompt as run, as llama-server shows it: BOS and special tokens written out
        answer = _Answer(state, req, gen, model.tokenizer.decode_pieces(ids), index)
        if req.receipt:
            answer.receipt = await receipt_maker(state, gen)
        answers.append(answer)
    if req.stream:
        return sse_response(answers[0].events() if len(answers) == 1
                            else _interleaved([a.events() for a in answers]))
    if len(answers) == 1:
        return json_response(await answers[0].whole())
    running = [asyncio.ensure_future(a.whole()) for a in answers]
    try:
        return json_response(list(await asyncio.gather(*running)))
    finally:   # one failed (its error is the answer), or the client went away
        for r in running:
            r.cancel()


def _prompts_ids(model, req: LlamaCompletion) -> list[list[int]]:
    """Each prompt's token ids, checked: not empty, and room left in the context (400 naming
    the prompt). Blocking: a worker thread."""
    out = []
    for i, prompt in enumerate(req.prompts):
        at = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
        ids = prompt_ids(model, prompt, at)
        if not ids:
            raise bad_request("the prompt is empty", at)
        check_prompt_fits(len(ids), model.n_ctx, at)
        out.append(ids)
    return out


async def _interleaved(streams: list[AsyncIterator[str]]) -> AsyncIterator[str]:
    """The events of several answers' streams as each comes, as llama-server streams several
    prompts (each event names its prompt by `index`). Closing it (the client went away)
    cancels every stream, which cancels their generations."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(events: AsyncIterator[str]) -> None:
        try:
            async with aclosing(events):
                async for event in events:
                    queue.put_nowait(event)
        except Exception as e:   # handed to the reader, which raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Answer:
    """One prompt's answer, whole or streamed."""

    def __init__(self, state: ServerState, req: LlamaCompletion, gen: GenerationRequest,
                 prompt_text: str, index: int = 0):
        self.state, self.req, self.gen, self.prompt_text = state, req, gen, prompt_text
        self.index = index
        self.tok = state.require_model().tokenizer
        self.task = Task(gen, req.stream)
        self.label = f"completion-{secrets.token_hex(6)}"
        self.receipt = None   # a ReceiptMaker when the request asks for a receipt

    def final(self, content: str, tokens: list[int], last: Delta,
              probs: list | None = None) -> dict[str, Any]:
        """The answer object: llama-server's fields, in its order (only response_fields', if
        the request lists them)."""
        t, req = self.task, self.req
        limit = last.finish_reason == "length"
        word = last.stop_word if last.finish_reason == "stop" else None
        answer = {
            "index": self.index, "content": content,
            "tokens": tokens if req.return_tokens else [],
            "id_slot": t.slot, "stop": True, "model": self.state.model_id,
            "tokens_predicted": t.n_decoded, "tokens_evaluated": t.n_prompt,
            "generation_settings": generation_settings(
                req.params, seed=last.usage.seed if last.usage else None,
                n_predict=self.gen.max_tokens, stop=req.stop, stream=req.stream,
                n_probs=req.n_probs,
                grammar=req.shape.value if req.shape and req.shape.kind == "gbnf" else "",
                timings_per_token=req.timings_per_token,
                post_sampling_probs=req.post_sampling_probs),
            "prompt": self.prompt_text, "has_new_line": t.has_new_line,
            # the context ran out before n_predict
            "truncated": limit and (self.gen.max_tokens is None
                                    or t.n_decoded < self.gen.max_tokens),
            "stop_type": "limit" if limit else "word" if word else "eos",
            "stopping_word": word or "",
            # this request's tokens in the slot's cache: the last token drawn is never run,
            # unless the end-of-generation token came after it (that one is not counted)
            "tokens_cached": t.n_prompt + t.n_decoded - (1 if limit or word else 0),
            "timings": t.timings(),
        }
        if probs:
            answer["completion_probabilities"] = probs
        if self.receipt is not None:
            answer["receipt"] = self.receipt.receipt()
        return pick_fields(answer, req.response_fields) if req.response_fields else answer

    def piece(self, text: str, tokens: tuple[int, ...], entries: tuple = (),
              n_decoded: int | None = None) -> dict[str, Any]:
        """A streamed event before the last: llama-server's fields, in its order."""
        event = {"index": self.index, "content": text, "tokens": list(tokens), "stop": False,
                 "id_slot": -1, "tokens_predicted": self.task.n_decoded if n_decoded is None
                 else n_decoded, "tokens_evaluated": self.task.n_prompt}
        if self.req.timings_per_token:
            event["timings"] = self.task.timings()
        if entries:
            event["completion_probabilities"] = probabilities(
                self.tok, entries, self.req.post_sampling_probs)
        return event

    async def whole(self) -> dict[str, Any]:
        whole = await fold(generation(self.state, self.gen, self.label, task=self.task),
                           self.receipt)
        entries, last = whole.logprobs, whole.last
        if last.stop_word and entries:
            # as llama-server: the entries of as many tokens as the stop string has are
            # left out (the stop string is not part of the content)
            n = len(self.tok.encode(last.stop_word, add_special=False))
            entries = entries[:len(entries) - min(n, len(entries))]
        probs = probabilities(self.tok, entries, self.req.post_sampling_probs)
        return self.final(whole.text, whole.tokens, last, probs)

    def events(self) -> AsyncIterator[str]:
        """The stream (answer.stream): an event per delta the engine sends (its text, token
        ids and their probabilities; text held back for a possible stop string comes in a
        later event), after the prompt's progress if asked for, then the answer object; an
        engine error ends it with an error event in the OpenAI shape."""
        started = False

        def pieces(d: Delta) -> Iterator[dict[str, Any]]:
            nonlocal started
            if not started and self.req.return_progress:
                # the engine tells of a prompt once it is done: one event, at 100%
                event = self.piece("", (), n_decoded=0)
                event["prompt_progress"] = progress(self.task.n_prompt, self.task.n_cached,
                                                    self.task.timings()["prompt_ms"])
                yield event
            started = True
            if d.token_ids or d.text:
                yield self.piece(d.text, d.token_ids, d.logprobs)
            if d.finish_reason is not None:   # its text and tokens are sent already
                yield self.final("", [], d)

        deltas = generation(self.state, self.gen, self.label, stream=True, task=self.task)
        return stream(deltas, pieces, sse_event, APIError.body, receipt=self.receipt)


# --- tokens -------------------------------------------------------------------------------

def _piece(tok: Tokenizer, token_id: int) -> str | list[int]:
    """A token's text as llama-server's with_pieces shows it: special tokens as written, a
    string when the bytes are valid UTF-8, else the list of bytes."""
    data = tok.token_bytes(token_id) or tok.token_piece(token_id, special=True).encode()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


@blueprint.post("/tokenize")
async def tokenize():
    model = server_state().require_model()
    body = await json_body()
    content = body.get("content", "")
    if not isinstance(content, str):
        raise bad_request("content must be a string", "content")
    add_special = boolean(body, "add_special")
    parse_special = boolean(body, "parse_special")
    with_pieces = boolean(body, "with_pieces")
    # llama-server's defaults: no BOS, special tokens written in the text are parsed
    answer = await offload(_tokens_answer, model.tokenizer, content, bool(add_special),
                           parse_special is not False, bool(with_pieces))
    return Response(answer, mimetype="application/json")


def _tokens_answer(tok: Tokenizer, content: str, add_special: bool, parse_special: bool,
                   with_pieces: bool) -> str:
    """/tokenize's answer as JSON text: no context limit (llama-server has none here; the
    body's size is one), tokenized in pieces that stop if the client goes away. Blocking: a
    worker thread, which also writes the answer (millions of ids for a large body)."""
    ids = prompt_tokens(tok, content, None, "content", add_special=add_special,
                        parse_special=parse_special)
    if with_pieces:
        return _tokens_json([{"id": t, "piece": _piece(tok, t)} for t in ids])
    return _tokens_json(ids)


def _tokens_json(items: list, per: int = 1 << 16) -> str:
    """dumps({"tokens": items}), written `per` items at a time: one dumps of millions holds
    the interpreter lock, and so the event loop, for the whole of it (half a second)."""
    parts = (dumps(items[i:i + per])[1:-1] for i in range(0, len(items), per))
    return '{"tokens":[' + ",".join(parts) + "]}"


@blueprint.post("/detokenize")
async def detokenize():
    tok = server_state().require_model().tokenizer
    body = await json_body()
    return Response(await offload(_text_answer, tok, body.get("tokens", [])),
                    mimetype="application/json")


def _text_answer(tok: Tokenizer, ids) -> str:
    """/detokenize's answer as JSON text, the ids checked (400). Blocking: a worker thread
    (a large body holds millions of ids)."""
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("tokens must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < tok.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                          f"(0..{tok.vocab_size - 1})", "tokens")
    return dumps({"content": tok.decode_pieces(ids)})


# --- the server ---------------------------------------------------------------------------

# --- resumable streams (stream_store.py) --------------------------------------------------

def _conv_id() -> str:
    conv_id = request.args.get("conv_id")
    if not conv_id:
        raise bad_request("conv_id is missing: GET or DELETE /v1/stream?conv_id=ID", "conv_id")
    return conv_id


@blueprint.get("/v1/stream")
async def resume_stream():
    """A recorded stream from byte `from` (default 0), followed live until it ends; 404 for
    an id with no recording."""
    session = server_state().streams.get(_conv_id())
    start = request.args.get("from", "0")
    if not start.isdigit() or len(start) > 18:
        raise bad_request("from must be a byte offset: a whole number of at least 0", "from")
    if session is None:
        raise APIError(404, "no stream is recorded under this conv_id (it ended more than "
                       "10 minutes ago, was stopped, or never had an X-Conversation-Id)",
                       param="conv_id")
    return sse_response(session.read(int(start)), resumable=False)


@blueprint.delete("/v1/stream")
async def stop_stream():
    """Stop a recorded stream's generation and forget it: 204, known or not."""
    server_state().streams.stop(_conv_id())
    return Response(status=204)


@blueprint.get("/health")
@blueprint.get("/v1/health")
async def health() -> Response:
    """{"status": "ok"} and the slots once the model is ready; 503 while it loads, once the
    engine thread has died, or while its current step has run past `stall_timeout` (a
    supervisor polling health can then restart the server)."""
    state = server_state()
    model = state.require_model()
    if state.kind != "text":   # an encoder: nothing runs between requests
        busy = int(state.activity.encoding > 0)
        return json_response({"status": "ok", "slots_idle": 1 - busy, "slots_processing": busy})
    engine = model.engine
    if engine.failure is not None:
        raise unavailable(f"the engine has stopped ({engine.failure}); restart the server")
    stalled = engine.stalled_for()
    if stalled > state.config.stall_timeout:
        raise unavailable(f"the engine has not finished a step for {stalled:.0f} s (the "
                          f"limit is {state.config.stall_timeout:g} s); restart the server")
    slots = engine.stats().slots
    busy = sum(1 for s in slots if s.busy)
    return json_response({"status": "ok", "slots_idle": len(slots) - busy,
                          "slots_processing": busy})


@blueprint.get("/props")
async def props():
    state = server_state()
    model = state.require_model()
    if state.kind != "text":
        return json_response(_encoder_props(state, model))
    engine, tok = model.engine, model.tokenizer

    def token_text(tid: int | None) -> str:
        return "" if tid is None else tok.token_piece(tid, special=True)
    return json_response({
        "default_generation_settings": {"params": _params(generation_settings(
            model.default_params, n_predict=token_limit(state, None))), "n_ctx": model.n_ctx},
        "total_slots": engine.config.parallel,
        "model_alias": state.model_id,
        "model_path": model.loaded.file.path,
        "model_ftype": file_type(model.loaded.file.metadata),
        "modalities": {"vision": model.projector is not None, "video": False, "audio": False},
        "is_sleeping": False,
        "endpoint_slots": state.config.slots_endpoint, "endpoint_props": False,
        "endpoint_metrics": True, "ui": state.config.webui,
        "chat_template": model.template_text,
        "chat_template_caps": dataclasses.asdict(model.chat_template.caps),
        "bos_token": token_text(tok.bos_id), "eos_token": token_text(tok.eos_id),
        "build_info": f"kinetic-{__version__}",
        "kernel": kernels.describe(model.loaded.config.kernel),
        "split": engine.runner.split,
        "cache_type_k": cache_type_name(engine.config.kv_dtype),
        "cache_type_v": cache_type_name(engine.config.kv_dtype),
        "capabilities": serves(state),
    })


def file_type(metadata: dict) -> str:
    """The GGUF file's general.file_type by llama.cpp's name (Q4_1, Q4_K_M...); "" if unknown."""
    import gguf
    try:
        return gguf.LlamaFileType(int(metadata.get("general.file_type"))).name.removeprefix(
            "MOSTLY_")
    except (TypeError, ValueError):
        return ""


def _encoder_props(state: ServerState, model) -> dict[str, Any]:
    """/props of an embedding or ranking model: what it serves, its context and pooling."""
    tok = model.tokenizer
    return {
        "default_generation_settings": {"n_ctx": model.n_ctx},
        "total_slots": 1,
        "model_alias": state.model_id,
        "model_path": model.loaded.file.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "capabilities": serves(state),
        "pooling": model.pooling,
        "n_embd": model.dim,
        "bos_token": "" if tok.bos_id is None else tok.token_piece(tok.bos_id, special=True),
        "eos_token": "" if tok.eos_id is None else tok.token_piece(tok.eos_id, special=True),
        "build_info": f"kinetic-{__version__}",
        "kernel": kernels.describe(model.loaded.config.kernel),
    }


@blueprint.get("/slots")
async def slots():
    """Each slot with its current or last request (llama-server's fields); 501 with
    --no-slots (llama-server's message); with ?fail_on_no_slot (any value), 503 when no slot
    is idle."""
    state = server_state()
    if not state.config.slots_endpoint:
        raise APIError(501, "This server does not support slots endpoint. Start it with "
                       "`--slots`")
    model = state.require_model()
    if "fail_on_no_slot" in request.args:
        busy = ([state.activity.encoding > 0] if state.kind != "text"
                else [s.busy for s in model.engine.stats().slots])
        if all(busy):
            raise unavailable("no slot available")
    if state.kind != "text":   # one encoder runs a batch at a time: one slot
        return json_response([{"id": 0, "n_ctx": model.n_ctx, "speculative": False,
                               "is_processing": state.activity.encoding > 0}])
    engine = model.engine
    activity = state.activity
    out = []
    for s in engine.stats().slots:
        slot: dict[str, Any] = {"id": s.slot, "n_ctx": engine.max_context,
                                "speculative": engine.config.speculative
                                or engine.drafter is not None,
                                "is_processing": s.busy}
        task = activity.running.get(s.seq_id) if s.busy else None
        task = task or activity.last.get(s.slot)
        if task is not None:
            slot.update(_slot_task(state, task, s if s.busy and s.seq_id == task.id else None))
        out.append(slot)
    return json_response(out)


def _slot_task(state: ServerState, task: Task, live) -> dict[str, Any]:
    """A slot's request: `live` is the engine's SlotStats while it runs there."""
    n_cached = live.n_cached if live is not None else task.n_cached
    n_decoded = max(task.n_decoded, live.n_decoded if live is not None else 0)
    params = generation_settings(task.request.params, n_predict=task.request.max_tokens,
                                 stream=task.stream, n_probs=task.request.logprobs or 0,
                                 seed=task.usage.seed if task.usage else None)
    tok = state.require_model().tokenizer
    limit = task.request.max_tokens
    return {
        "id_task": task.id,
        "n_prompt_tokens": task.n_prompt,
        "n_prompt_tokens_processed": task.n_prompt - n_cached,
        "n_prompt_tokens_cache": n_cached,
        "params": _params(params),
        "prompt": tok.decode_pieces(task.request.prompt),
        "next_token": [{"has_next_token": live is not None,
                        "has_new_line": task.has_new_line,
                        "n_remain": -1 if limit is None else max(limit - n_decoded, 0),
                        "n_decoded": n_decoded}],
    }


def _params(settings: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in settings.items() if k not in NOT_IN_PARAMS}


@blueprint.get("/metrics")
@blueprint.get("/v1/metrics")
async def metrics():
    state = server_state()
    model = state.require_model()
    if state.kind != "text":
        processing, deferred = state.activity.encoding, 0
    else:
        stats = model.engine.stats()
        processing, deferred = stats.requests_processing, stats.queue_length
    values = metric_values(state.activity.totals, processing, deferred)
    return Response(prometheus_text(values), mimetype="text/plain",
                    headers={"Content-Type": "text/plain; version=0.0.4"})


# --- endpoints of other kinds of models ---------------------------------------------------

@blueprint.post("/embedding")
@blueprint.post("/embeddings")
async def embedding():
    """llama-server's own embeddings: `content` (or `input`) as /v1/embeddings takes input;
    per input {"index", "embedding"}, the embedding a list of vectors: one pooled vector,
    scaled as `embd_normalize` says (encoder.normalize: 2, Euclidean, by default; -1 none), or
    one per token, as they are, when the model's pooling is none."""
    state = server_state()
    model = require_kind(state, "embedding", "embeddings")
    body = await json_body()
    param = "content" if "content" in body else "input"
    kind = body.get("embd_normalize", 2)
    if not isinstance(kind, int) or isinstance(kind, bool):
        raise bad_request("embd_normalize must be a whole number (-1: none, 0: max absolute, "
                          "1: taxicab, 2: Euclidean, p > 2: p-norm)", "embd_normalize")
    integer(body, "embd_normalize", -INT32_MAX - 1, INT32_MAX)   # 32 bits, as llama-server's
    ids = await offload(input_ids, state, emb.parse_inputs(body.get(param), param), param,
                        emb.flag(body, "truncate"))
    if model.pooling == "none":   # as llama-server: token vectors are never normalized
        vectors = [[emb.vector_json(row) for row in h]
                   for h in await emb.encode(state, ids, model.encoder.hidden)]
    else:
        pooled = await emb.encode(state, ids, model.encoder.pooled)
        vectors = [[emb.vector_json(normalize(v, kind))] for v in pooled]
    return json_response([{"index": i, "embedding": v} for i, v in enumerate(vectors)])
