"""llama-server's own API: /completion, /tokenize, /detokenize, /props, /slots, /metrics.

Scripts and apps written for llama-server work against kinetic unchanged: the routes, request
fields and answer fields are llama-server's (scripts/llama_server_compat.py lists what still
differs, docs/compat.md explains why). Errors keep kinetic's OpenAI shape. These routes take
bodies of any content type, as llama-server does; the Origin rule in access.py keeps web pages of
other sites from using them.

A /completion, in order: `json_body` -> `parse_completion` (llama-server's field names,
checked like the OpenAI ones, 400 naming the field) -> the prompt's token ids (text is
tokenized with BOS and special tokens, as llama-server does) -> `generation` runs it, recorded
as a `Task` (metrics.py) whose slot and timings the answer reports. Streamed, each delta's text
is one `data: {"content": ..., "stop": false}` event and the last event is the whole answer
object with empty content and "stop": true; otherwise the deltas are folded into that object.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator

from quart import Blueprint, Response

from kinetic import __version__, kernels
from kinetic.api import embeddings as emb
from kinetic.api.core import (ServerState, completion_prompt_ids, generation, json_body,
                              json_response, require_kind, server_state, serves, sse_event,
                              sse_response)
from kinetic.api.errors import bad_request, engine_error, unavailable
from kinetic.api.metrics import Task, metric_values, prometheus_text
from kinetic.api.receipt import receipt_maker
from kinetic.api.params import (MAX_STOP_CHARS, MAX_TOKENS_LIMIT, Shape, boolean,
                                check_prompt_fits, compile_shape, integer, sampling_params,
                                shape, strings)
from kinetic.engine.encoder import normalize
from kinetic.engine.request import MAX_STOP_STRINGS, Delta, GenerationRequest
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

@dataclass(frozen=True)
class LlamaCompletion:
    """A /completion body, checked."""

    prompt: str | list[int]
    params: SamplingParams
    n_predict: int | None      # None: until the answer ends or the context is full
    stop: tuple[str, ...]
    stream: bool
    return_tokens: bool
    n_probs: int
    shape: Shape | None        # grammar or json_schema (or response_format)
    receipt: bool = False      # add the answer's receipt (kinetic/api/receipt.py)


def parse_completion(body: dict, defaults: SamplingParams) -> LlamaCompletion:
    """llama-server's /completion fields. Raises APIError (400) naming the field at fault."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad_request("prompt must be a string or a list of token ids (one prompt "
                              "per request)", "prompt")
    elif not isinstance(prompt, str):
        raise bad_request("prompt must be a string or a list of token ids", "prompt")
    n_predict = integer(body, "n_predict", -1, MAX_TOKENS_LIMIT)
    if n_predict is None:
        n_predict = integer(body, "max_tokens", -1, MAX_TOKENS_LIMIT)
    if n_predict == 0:
        raise bad_request("n_predict must be -1 (no limit) or at least 1", "n_predict")
    boolean(body, "cache_prompt")  # always on: checked, nothing more
    return LlamaCompletion(
        prompt=prompt,
        params=sampling_params(body, defaults),
        n_predict=None if n_predict in (None, -1) else n_predict,
        stop=strings(body, "stop", MAX_STOP_STRINGS, MAX_STOP_CHARS) or (),
        stream=bool(boolean(body, "stream")),
        return_tokens=bool(boolean(body, "return_tokens")),
        n_probs=integer(body, "n_probs", 0) or 0,  # accepted; probabilities not returned yet
        shape=shape(body),
        receipt=bool(boolean(body, "receipt")),
    )


def generation_settings(p: SamplingParams, *, seed: int | None = None,
                        n_predict: int | None = None, stop: tuple[str, ...] = (),
                        stream: bool = False, n_probs: int = 0,
                        grammar: str = "") -> dict[str, Any]:
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
    }


@blueprint.post("/completion")
@blueprint.post("/completions")
async def completion():
    state = server_state()
    require_kind(state, "text", "completions")
    model = state.require_model()
    req = parse_completion(await json_body(), model.default_params)
    ids = await asyncio.to_thread(completion_prompt_ids, model, req.prompt)
    if not ids:
        raise bad_request("the prompt is empty", "prompt")
    check_prompt_fits(len(ids), model.n_ctx, "prompt")
    grammar = None
    if req.shape is not None:
        grammar = await asyncio.to_thread(compile_shape, req.shape, model)
    gen = GenerationRequest(ids, req.params, req.n_predict, req.stop, grammar=grammar)
    # the prompt as run, as llama-server shows it: BOS and special tokens written out
    answer = _Answer(state, req, gen, model.tokenizer.decode_pieces(ids))
    if req.receipt:
        answer.receipt = await receipt_maker(state, gen)
    if req.stream:
        return sse_response(answer.events())
    return json_response(await answer.whole())


class _Answer:
    """One /completion's answer, whole or streamed."""

    def __init__(self, state: ServerState, req: LlamaCompletion, gen: GenerationRequest,
                 prompt_text: str):
        self.state, self.req, self.gen, self.prompt_text = state, req, gen, prompt_text
        self.task = Task(gen, req.stream)
        self.label = f"completion-{secrets.token_hex(6)}"
        self.receipt = None   # a ReceiptMaker when the request asks for a receipt

    def final(self, content: str, tokens: list[int], last: Delta) -> dict[str, Any]:
        """The answer object: llama-server's fields, in its order."""
        t = self.task
        limit = last.finish_reason == "length"
        answer = {
            "index": 0, "content": content, "tokens": tokens if self.req.return_tokens else [],
            "id_slot": t.slot, "stop": True, "model": self.state.model_id,
            "tokens_predicted": t.n_decoded, "tokens_evaluated": t.n_prompt,
            "generation_settings": generation_settings(
                self.req.params, seed=last.usage.seed if last.usage else None,
                n_predict=self.req.n_predict, stop=self.req.stop, stream=self.req.stream,
                n_probs=self.req.n_probs,
                grammar=self.req.shape.value if self.req.shape and self.req.shape.kind == "gbnf"
                else ""),
            "prompt": self.prompt_text, "has_new_line": t.has_new_line, "truncated": False,
            # kinetic does not tell a stop string from the end of generation (SPEC.md)
            "stop_type": "limit" if limit else "eos", "stopping_word": "",
            # this request's tokens in the slot's cache: a token drawn at the limit is never
            # run (the end-of-generation token is neither run nor counted)
            "tokens_cached": t.n_prompt + t.n_decoded - (1 if limit else 0),
            "timings": t.timings(),
        }
        if self.receipt is not None:
            answer["receipt"] = self.receipt.receipt()
        return answer

    async def whole(self) -> dict[str, Any]:
        text, tokens, last = [], [], None
        async with aclosing(generation(self.state, self.gen, self.label,
                                       task=self.task)) as deltas:
            async for d in deltas:
                text.append(d.text)
                tokens.extend(d.token_ids)
                last = d
                if self.receipt is not None:
                    self.receipt.feed(d)
        if last is None or last.finish_reason == "error":
            raise engine_error(last)
        return self.final("".join(text), tokens, last)

    async def events(self) -> AsyncIterator[str]:
        """A `data:` event per piece of text (no token ids: a piece's text and its tokens
        need not line up when a stop string is held back), then the answer object."""
        tokens: list[int] = []
        async with aclosing(generation(self.state, self.gen, self.label, stream=True,
                                       task=self.task)) as deltas:
            async for d in deltas:
                if d.finish_reason == "error":
                    yield sse_event(engine_error(d).body())
                    return
                tokens.extend(d.token_ids)
                if self.receipt is not None:
                    self.receipt.feed(d)
                if d.text:
                    yield sse_event({"index": 0, "content": d.text, "tokens": [],
                                     "stop": False, "id_slot": -1,
                                     "tokens_predicted": self.task.n_decoded,
                                     "tokens_evaluated": self.task.n_prompt})
                if d.finish_reason is not None:
                    yield sse_event(self.final("", tokens, d))


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
    tok = model.tokenizer
    # llama-server's defaults: no BOS, special tokens written in the text are parsed
    ids = await asyncio.to_thread(tok.encode, content, bool(add_special),
                                  parse_special is not False)
    if with_pieces:
        return json_response({"tokens": [{"id": t, "piece": _piece(tok, t)} for t in ids]})
    return json_response({"tokens": ids})


@blueprint.post("/detokenize")
async def detokenize():
    tok = server_state().require_model().tokenizer
    body = await json_body()
    ids = body.get("tokens", [])
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("tokens must be a list of token ids", "tokens")
    bad = [t for t in ids if not 0 <= t < tok.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                          f"(0..{tok.vocab_size - 1})", "tokens")
    return json_response({"content": tok.decode_pieces(ids)})


# --- the server ---------------------------------------------------------------------------

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
    meta = model.loaded.file.metadata

    def token_text(tid: int | None) -> str:
        return "" if tid is None else tok.token_piece(tid, special=True)
    return json_response({
        "default_generation_settings": {"params": _params(generation_settings(
            model.default_params)), "n_ctx": model.n_ctx},
        "total_slots": engine.config.parallel,
        "model_alias": state.model_id,
        "model_path": model.loaded.file.path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": meta.get("tokenizer.chat_template") or model.chat_template.source,
        "chat_template_caps": dataclasses.asdict(model.chat_template.caps),
        "bos_token": token_text(tok.bos_id), "eos_token": token_text(tok.eos_id),
        "build_info": f"kinetic-{__version__}",
        "kernel": kernels.describe(model.loaded.config.kernel),
        "capabilities": serves(state),
    })


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
    """Each slot with its current or last request (llama-server's fields)."""
    state = server_state()
    model = state.require_model()
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
    require_kind(state, "embedding", "embeddings")
    body = await json_body()
    param = "content" if "content" in body else "input"
    kind = body.get("embd_normalize", 2)
    if not isinstance(kind, int) or isinstance(kind, bool):
        raise bad_request("embd_normalize must be a whole number (-1: none, 0: max absolute, "
                          "1: taxicab, 2: Euclidean, p > 2: p-norm)", "embd_normalize")
    ids = emb.token_ids(state, emb.parse_inputs(body.get(param), param), param,
                        emb.flag(body, "truncate"))
    model = state.require_model()
    if model.pooling == "none":   # as llama-server: token vectors are never normalized
        vectors = [h.tolist() for h in await emb.encode(state, ids, model.encoder.hidden)]
    else:
        pooled = await emb.encode(state, ids, model.encoder.pooled)
        vectors = [[normalize(v, kind).tolist()] for v in pooled]
    return json_response([{"index": i, "embedding": v} for i, v in enumerate(vectors)])
