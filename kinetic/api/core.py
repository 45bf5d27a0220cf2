"""What every dialect shares: the server's state, request bodies, answers as JSON or
server-sent events, and the bridge from a route to the engine (`generation`).

Each dialect (kinetic/api/dialects/: openai.py, llama_server.py, prefill.py, ollama.py)
imports this module and nothing of another dialect; app.py assembles them into one Quart app,
and access.py holds the checks every request passes before its route runs and writes every
error.

A route, in order: `server_state()` -> `require_kind` (the loaded model serves this kind of
endpoint) -> `json_body` (strict UTF-8 JSON of valid Unicode, body.py) -> its dialect's
parser (params.py) -> `generation` runs it in the engine, recorded in `ServerState.activity`
(metrics.py) for /metrics and /slots -> its deltas folded into one answer or written as a
stream (answer.py) -> `json_response` or `sse_response`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from quart import Response, current_app, request

from kinetic.api.body import parse_json_object
from kinetic.api.errors import bad_request, unavailable
from kinetic.api.metrics import Activity, Task
from kinetic.api.params import Shape, compile_shape
from kinetic.api.offload import prompt_tokens
from kinetic.api.stream_store import MAX_ID_CHARS, StreamStore
from kinetic.engine.request import Delta, GenerationRequest, TokenLogprob
from kinetic.grammar import Grammar, GrammarTooCostly

if TYPE_CHECKING:
    from kinetic.llm import Model

log = logging.getLogger("kinetic.server")

# what each kind of model serves, to name the right endpoint in a 400
ENDPOINTS = {"text": "/v1/chat/completions or /v1/completions",
             "embedding": "/v1/embeddings", "rerank": "/v1/rerank"}


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP side of `kinetic serve` (one flag, one field; engine sizes are EngineConfig's)."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()     # --api-key / --api-key-file; empty: no authentication
    max_connections: int = 64          # more open connections are answered 503 and closed
    request_timeout: float = 30.0      # seconds a client has to send its request
    stall_timeout: float = 60.0        # /health answers 503 once a step runs longer
    max_body_bytes: int = 16 << 20
    sign_key: str | None = None        # --sign-key: kept for signed receipts
    ollama: bool = False               # --ollama: also listen on Ollama's port, 11434
    aliases: tuple[str, ...] = ()      # --alias: the model's names in answers (the first is
                                       # its id); empty: the file name without extension
    tags: tuple[str, ...] = ()         # --tags: shown in /v1/models, nothing more
    n_predict: int = -1                # --n-predict: most tokens of any answer; -1: no limit
    slots_endpoint: bool = True        # --no-slots: GET /slots answers 501
    slot_save_path: str | None = None  # --slot-save-path: where /slots/N?action=save writes
    allowed_hosts: tuple[str, ...] = ()   # --allowed-hosts: Host names served beside this
                                          # computer's own ("*": any), on a loopback address
    verbose: bool = False              # --verbose: a log line per request
    webui: bool = True                 # --no-webui: no page at /

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, got {self.max_connections}")
        if not self.request_timeout > 0:
            raise ValueError(f"--timeout must be more than 0 seconds, got {self.request_timeout}")
        if not self.stall_timeout > 0:
            raise ValueError(f"--stall-timeout must be more than 0 seconds, got "
                             f"{self.stall_timeout}")
        if any(not k for k in self.api_keys):
            raise ValueError("an API key must not be empty")
        if any(not h or h != h.strip().lower().rstrip(".") for h in self.allowed_hosts):
            raise ValueError("--allowed-hosts: names must be non-empty, in lower case, without "
                             "spaces or a final dot")
        if any(not a for a in self.aliases):
            raise ValueError("--alias: a name must not be empty")
        if self.n_predict == 0 or self.n_predict < -1:
            raise ValueError(f"--n-predict must be -1 (no limit) or at least 1, got "
                             f"{self.n_predict}")


class ServerState:
    """What the routes share: the config, the model once it is loaded, how loading goes."""

    def __init__(self, config: ServerConfig, model_id: str):
        self.config = config
        self.model_id = config.aliases[0] if config.aliases else model_id
        self.model: Model | None = None
        self.kind = "text"                 # what the model serves: "text" (generation),
                                           # "embedding" or "rerank" (kinetic.embedding)
        self.loading = "Loading model"     # the 503 message while loading
        self.created = int(time.time())
        self.activity = Activity()         # every generation since ready (metrics.py)
        self.streams = StreamStore()       # resumable streams (X-Conversation-Id)
        self.generations: dict[int, Callable[[str], None]] = {}   # running generations by
                                           # engine id: each one's `end(message)` (core.
                                           # generation), called when the server stops

    def end_generations(self, message: str) -> int:
        """End every running generation now with an error `message` (a stop: server.py), so
        that each answer, streamed or not, ends with an error in its dialect's shape instead
        of a connection cut without a word. Returns how many there were."""
        ends = list(self.generations.values())
        for end in ends:
            end(message)
        return len(ends)

    @property
    def ready(self) -> bool:
        return self.model is not None

    def set_ready(self, model: "Model") -> None:
        """Serve `model` from now on."""
        self.kind = getattr(model, "kind", "text")
        self.model = model

    def require_model(self) -> "Model":
        if self.model is None:
            raise unavailable(self.loading)
        return self.model


def server_state() -> ServerState:
    return current_app.extensions["kinetic"]


def token_limit(state: ServerState, requested: int | None) -> int | None:
    """The most tokens an answer may have: the request's, else --n-predict's, as llama-server
    does (its --n-predict is the default of requests, not a cap); None: no limit."""
    server = state.config.n_predict
    return requested if requested is not None or server < 0 else server


def serves(state: ServerState) -> list[str]:
    """What the loaded model serves, as /v1/models and /props list it ("vision": it reads
    images, with --mmproj)."""
    if state.kind == "text":
        vision = getattr(state.require_model(), "projector", None) is not None
        return ["chat", "completion"] + (["vision"] if vision else [])
    return [state.kind]


def require_kind(state: ServerState, kind: str, what: str):
    """The loaded model, which must be of `kind`: 400 naming the right endpoint otherwise (503
    while it loads)."""
    if state.kind != kind:
        article = "an" if state.kind[0] in "aeiou" else "a"
        raise bad_request(f"the loaded model {state.model_id!r} is {article} {state.kind} model: "
                          f"it does not serve {what}; use {ENDPOINTS[state.kind]}")
    return state.require_model()


def completion_prompt_ids(model, prompt: str | list[int]) -> list[int]:
    """A completion's prompt as token ids: ids checked against the vocabulary (400), text
    tokenized as llama-server does (BOS where the model adds it, special tokens parsed), the
    context 400 as soon as it cannot fit (offload.prompt_tokens). Blocking: a worker thread."""
    if isinstance(prompt, list):
        bad = [t for t in prompt if not 0 <= t < model.config.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary "
                              f"(0..{model.config.vocab_size - 1})", "prompt")
        return list(prompt)
    return prompt_tokens(model.tokenizer, prompt, model.n_ctx, "prompt")


def ready_grammar(model, grammar: Grammar, param: str) -> Grammar:
    """`grammar`, its start state and first token mask built for `model`'s vocabulary within
    the engine's grammar budget (blocking: a worker thread, so that a costly grammar never
    reaches the engine thread); 400 naming `param` when even that first mask overruns it."""
    try:
        model.engine.prepare_grammar(grammar)
    except GrammarTooCostly as e:
        raise bad_request(f"the grammar is too costly to follow: {e}", param) from None
    return grammar


def shape_grammar(model, shape: Shape) -> Grammar:
    """A shape's grammar (params.compile_shape), readied for `model` (`ready_grammar`).
    Blocking: run it in a worker thread."""
    return ready_grammar(model, compile_shape(shape), shape.param)


def chat_logprobs(tok, lps: tuple[TokenLogprob, ...] | list[TokenLogprob]) -> list:
    """Tokens' log-probabilities in OpenAI's chat shape (Ollama's too): per token its text,
    log-probability, UTF-8 bytes and alternatives. `tok`: the model's Tokenizer."""
    def entry(tid: int, logprob: float) -> dict[str, Any]:
        return {"token": tok.token_piece(tid), "logprob": logprob,
                "bytes": list(tok.token_bytes(tid))}
    return [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, l) for t, l in lp.top])
            for lp in lps]


# --- bodies and answers -------------------------------------------------------------------

INLINE_BODY_BYTES = 64 << 10   # larger bodies are parsed in a worker thread


async def json_body() -> dict[str, Any]:
    """The request body as a JSON object of valid Unicode, at most body.MAX_DEPTH deep (400
    saying what is wrong, and where, otherwise: body.py). A large body is parsed in a worker
    thread: 16 MiB take up to seconds, and the event loop streams everyone's tokens."""
    raw = await request.get_data()
    if len(raw) > INLINE_BODY_BYTES:
        return await asyncio.to_thread(parse_json_object, raw)
    return parse_json_object(raw)


class JSONText:
    """A value already written as JSON text (an embeddings vector: kinetic.kernels.json_floats
    writes it as json.dumps would, many times faster), which dumps copies into its output."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def dumps(obj: Any) -> str:
    """obj as compact JSON; a JSONText inside it goes in as it is written."""
    texts: list[str] = []
    mark = f"\x00{secrets.token_hex(8)}:"   # no string of the answer can hold it

    def stand_in(value: Any) -> str:
        if not isinstance(value, JSONText):
            raise TypeError(f"{type(value).__name__} is not JSON serializable")
        texts.append(value.text)
        return f"{mark}{len(texts) - 1}"

    out = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=stand_in)
    if not texts:
        return out
    quoted = re.escape(json.dumps(mark))[:-1]   # the mark as dumps wrote it, less its last quote
    return re.sub(quoted + r'(\d+)"', lambda m: texts[int(m.group(1))], out)


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(dumps(obj), status=status, mimetype="application/json")


def sse_response(events: AsyncIterator[str], resumable: bool = True) -> Response:
    """A server-sent events answer from an async iterator of ready-made `data: ...` events
    (answer.stream writes them).
    Closing it (the client went away) closes `events`, which cancels its generation; unless
    the request has an X-Conversation-Id: then the answer is recorded and goes on without
    the client, who can resume it from any byte (stream_store.py). resumable=False: never
    recorded (a resumed stream itself)."""
    conv_id = request.headers.get("X-Conversation-Id") if resumable else None
    if conv_id is not None:
        if not 0 < len(conv_id) <= MAX_ID_CHARS:
            raise bad_request(f"X-Conversation-Id must have 1 to {MAX_ID_CHARS} characters")
        try:
            events = server_state().streams.record(conv_id, events).read(0)
        except LookupError as e:
            raise unavailable(f"{e}; try again later") from None
    resp = Response(events, mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    resp.timeout = None  # a stream lasts as long as the generation, not RESPONSE_TIMEOUT
    return resp


async def generation(state: ServerState, request_: GenerationRequest, label: str, *,
                     stream: bool = False, task: Task | None = None) -> AsyncIterator[Delta]:
    """The engine's deltas for one request, recorded in `state.activity` (as `task` if given:
    its slot, cached tokens and timings are known once the first delta has come). Iterate it
    inside `aclosing` (or let Quart close a streamed body): leaving early, by a client that
    went away or by cancellation, cancels the request in the engine at once, freeing its
    slot. Nothing runs until it is iterated."""
    engine = state.require_model().engine
    if engine.failure is not None:   # (also a process of a split model that stopped: hosts.py)
        raise unavailable(f"the engine has stopped ({engine.failure}); restart the server")
    if task is None:
        task = Task(request_, stream)
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[Delta] = asyncio.Queue()

    def sink(delta: Delta) -> None:  # on the engine thread
        task.engine_delta(delta, engine)
        loop.call_soon_threadsafe(out.put_nowait, delta)

    task.id = engine.start(request_, sink)
    state.activity.started(task)
    done = False

    stop = Delta(finish_reason="error", busy=True)   # ended by the server's stop (end)

    def end(message: str) -> None:   # on the loop: after what the engine has sent, an error
        nonlocal stop
        engine.cancel(task.id)
        stop = dataclasses.replace(stop, error=message)
        out.put_nowait(stop)

    state.generations[task.id] = end
    try:
        while not done:
            delta = await out.get()
            state.activity.saw(task, delta)
            done = delta.finish_reason is not None
            if delta is stop:
                log.info("%s cancelled after %d tokens (the server is stopping)", label,
                         task.n_decoded)
            elif delta.finish_reason == "error":
                log.error("%s failed: %s", label, delta.error)
            yield delta
    finally:
        state.generations.pop(task.id, None)
        state.activity.ended(task)
        if not done:
            engine.cancel(task.id)
            log.info("%s cancelled after %d tokens (the client went away, or the server is "
                     "stopping)", label, task.n_decoded)
