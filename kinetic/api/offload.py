"""Request work too heavy for the event loop, which streams every connection's tokens: parsing
a body (params.py: logit_bias keys are tokenized, image parts decoded), rendering the chat
template and tokenizing prompts run in a few worker threads (`offload`), and a prompt that
cannot fit the context is refused as early as can be proved (`prompt_tokens`).

    req = await offload(parse_chat, body, model.default_params, model.text_tokens)

At most WORKERS jobs run at once; more wait their turn in order. A job's exceptions come
back to the route as they are, so an APIError raised in a worker is the same 400 as before.
A route cancelled while its job waits or runs (its client went away) abandons the job: one
not started never runs, and `prompt_tokens` in one that runs stops at its next piece.

A prompt of B bytes has at least Tokenizer.min_tokens tokens (ceil(B / L), L the most bytes
one token stands for: kinetic/text/chunks.py), so one that cannot fit is refused before any
tokenizing; the rest is tokenized in pieces of a few thousand characters, the same ids as in
one go, counted as they come: once they fill the context the prompt is refused without
tokenizing the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, TypeVar

from kinetic.api.errors import APIError, context_exceeded

WORKERS = 4   # CPU-bound Python shares one interpreter lock: more threads only take turns
# The event loop shares that lock with the workers: each time it wakes it waits for a worker
# to hand the lock over, at most one switch interval, and answering one request takes a few
# dozen wake-ups. Python's 5 ms made /health take 130 ms (p50) while two clients' 1 MB
# logit_bias bodies were parsed; at 0.5 ms it took 8 ms (bench/event_loop.py, docs/server.md).
# (kinetic serve sets it: server.run)
SWITCH_INTERVAL = 0.0005
_pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kinetic-parse")
# set in a job's context: the request that asked for it has been cancelled
_abandon: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "kinetic_abandon", default=None)

T = TypeVar("T")


class Abandoned(Exception):
    """The request a job was for has gone (raised in the worker; nobody waits for it)."""


async def offload(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) in a worker thread (at most WORKERS at once), its result or its
    exception. Cancelling the caller abandons the job (module docstring)."""
    abandon = threading.Event()
    ctx = contextvars.copy_context()
    ctx.run(_abandon.set, abandon)
    job = functools.partial(ctx.run, fn, *args, **kwargs)
    try:
        return await asyncio.get_running_loop().run_in_executor(_pool, job)
    except asyncio.CancelledError:
        abandon.set()
        raise


# requests whose images are decoded, resized and laid out at once (the rest wait, holding
# nothing): a 32-megapixel image decodes to 96 MB, and 16 of them to a request, so without a
# bound a few requests' images held gigabytes and every parse worker (text requests queued
# behind them for tens of seconds)
IMAGE_REQUESTS = 1
_image_gates: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = \
    weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def image_work(has_images: bool) -> AsyncIterator[None]:
    """Around a request's parse and plan: where it has images, at most IMAGE_REQUESTS such
    requests are inside at once (a request cancelled while it waits leaves the queue)."""
    if not has_images:
        yield
        return
    loop = asyncio.get_running_loop()
    gate = _image_gates.get(loop)
    if gate is None:
        gate = _image_gates[loop] = asyncio.Semaphore(IMAGE_REQUESTS)
    async with gate:
        yield


def check_abandoned() -> None:
    """Raises Abandoned in a job whose request has gone."""
    abandon = _abandon.get()
    if abandon is not None and abandon.is_set():
        raise Abandoned


def refuse_by_length(tok, text: str, n_ctx: int, param: str, *, parse_special: bool = True,
                     used: int = 0) -> None:
    """The context 400 (naming `param`) for a prompt text whose length alone proves that it
    cannot fit in `n_ctx` tokens with `used` taken already (Tokenizer.min_tokens)."""
    least = used + tok.min_tokens(text, parse_special)
    if least >= n_ctx:
        raise context_exceeded(least, n_ctx, param, at_least=True)


def prompt_tokens(tok, text: str, n_ctx: int | None, param: str, *, add_special: bool = True,
                  parse_special: bool = True, used: int = 0) -> list[int]:
    """tok.encode(text, add_special, parse_special) for a prompt that must leave room in a
    context of `n_ctx` tokens, `used` of them taken by what comes before it (None: no
    limit). The context 400 (naming `param`) as soon as it is sure: from the text's length
    alone, or once the ids counted so far fill the context; a shorter prompt's ids are
    returned whole, for the route's own exact check. Raises Abandoned once the request has
    gone. Blocking: a worker thread (`offload`)."""
    if n_ctx is not None:
        refuse_by_length(tok, text, n_ctx, param, parse_special=parse_special, used=used)
    out: list[int] = []
    pieces = tok.encode_chunks(text, add_special, parse_special, check=check_abandoned)
    for ids in pieces:
        out.extend(ids)
        check_abandoned()
        if n_ctx is not None and used + len(out) >= n_ctx:
            rest = next(pieces, None)
            if rest is None:
                break   # all of it: the exact count, for the route's own check
            raise context_exceeded(used + len(out) + len(rest), n_ctx, param, at_least=True)
    return out


# --- embedding and rerank inputs (embeddings.py) -------------------------------------------

def input_ids(state, items: list, param: str, truncate: bool) -> list[list[int]]:
    """embeddings.token_ids(state, items, param, truncate), except that an input whose text
    alone cannot fit the context is refused (unless truncated) before any is tokenized, with
    token_ids's 400. Blocking: a worker thread."""
    from kinetic.api import embeddings as emb   # it imports core, which imports this module
    if not truncate:
        model = state.require_model()
        tok, n_ctx = model.tokenizer, model.n_ctx
        for i, item in enumerate(items):
            parts = [item] if isinstance(item, str) else item
            least = sum(tok.min_tokens(p, True) if isinstance(p, str) else 1 for p in parts)
            _refuse_input(param, i, least, n_ctx)
    return emb.token_ids(state, items, param, truncate)


def rank_ids(state, query: str, documents: list[str], truncate: bool) -> list[list[int]]:
    """The token ids each (query, document) pair is scored on (EmbeddingModel.rank_prompt),
    checked as embeddings.token_ids checks them; a pair whose text alone cannot fit is
    refused (unless truncated) before any is tokenized. Blocking: a worker thread."""
    from kinetic.api import embeddings as emb
    model = state.require_model()
    template = model.rerank_template
    if not truncate and (template is None or "{query}" in template and "{document}" in template):
        for i, doc in enumerate(documents):
            # the rerank template's text holds both; without one, each is tokenized alone,
            # and a bound with special tokens parsed is never above one without
            _refuse_input("documents", i, model.tokenizer.min_tokens(query + doc, True),
                          model.n_ctx)
    prompts = []
    for doc in documents:
        prompts.append(model.rank_prompt(query, doc))
        check_abandoned()
    return emb.token_ids(state, prompts, "documents", truncate)


def _refuse_input(param: str, i: int, least: int, n_ctx: int) -> None:
    if least > n_ctx:   # token_ids's 400, with the count known so far
        raise APIError(400, f"{param}[{i}] is too large: at least {least} tokens; the context "
                       f"holds {n_ctx} (send truncate: true to cut it)", param=param,
                       code="context_length_exceeded")
