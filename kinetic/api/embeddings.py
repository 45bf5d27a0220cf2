"""What every embedding and rerank route shares, whatever its dialect: reading the inputs,
their limits, running them through the model's encoder off the event loop, and counting them
in /metrics. The routes (openai.py: /v1/embeddings, /v1/rerank; llama_server.py: /embedding,
/embeddings) only read their own fields and write their own answer shapes.

Limits: at most MAX_INPUTS texts (or documents) a request, each 1 to n_ctx tokens; a token id
must be in the vocabulary. An input over the context is a 400 naming its index, unless the
request asks to truncate it (then its first n_ctx tokens run).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, Callable

import numpy as np

from kinetic import kernels
from kinetic.api.core import JSONText, ServerState
from kinetic.api.errors import APIError, bad_request

MAX_INPUTS = 256

Item = str | list[int | str]   # a text, token ids, or ids and texts in one sequence


def parse_inputs(value: Any, param: str) -> list[Item]:
    """An embedding input: a string, a list of strings, a list of token ids (texts may stand
    among the ids, as llama-server takes them: [12, 34, "text", 56] is one input), or a list
    of such lists (strings and id lists may mix). 400 for anything else, an empty list or
    string, or more than MAX_INPUTS."""
    if isinstance(value, str):
        items: list[Any] = [value]
    elif isinstance(value, list) and value and any(_is_id(t) for t in value):
        items = [value]
    elif isinstance(value, list):
        items = value
    else:
        raise bad_request(f"{param} must be a string, a list of strings, a list of token ids "
                          f"or a list of such lists", param)
    if not items:
        raise bad_request(f"{param} must not be empty", param)
    if len(items) > MAX_INPUTS:
        raise bad_request(f"{param} has {len(items)} inputs; at most {MAX_INPUTS} a request",
                          param)
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"{param}[{i}] is an empty string", param)
        elif not (isinstance(item, list) and any(_is_id(t) for t in item)
                  and all(_is_id(t) or (isinstance(t, str) and t) for t in item)):
            raise bad_request(f"{param}[{i}] must be a non-empty string or a non-empty list of "
                              f"token ids (non-empty texts may stand among them)", param)
    return items


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def parse_documents(value: Any, param: str = "documents") -> list[str]:
    """Rerank documents: strings or objects with a string `text`, 1 to MAX_INPUTS."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"{param} must be a non-empty list of strings (or of objects with "
                          f"text)", param)
    if len(value) > MAX_INPUTS:
        raise bad_request(f"{param} has {len(value)} documents; at most {MAX_INPUTS} a request",
                          param)
    out = []
    for i, d in enumerate(value):
        if isinstance(d, dict):
            d = d.get("text")
        if not isinstance(d, str):
            raise bad_request(f"{param}[{i}] must be a string or an object with a string text",
                              param)
        out.append(d)
    return out


def token_ids(state: ServerState, items: list[Item], param: str,
              truncate: bool = False) -> list[list[int]]:
    """Each input's tokens (texts tokenized as llama-server does), checked against the
    vocabulary and the context."""
    model = state.require_model()
    vocab, n_ctx = model.config.vocab_size, model.n_ctx
    out = []
    for i, item in enumerate(items):
        ids = model.input_ids(item)
        if not ids:
            raise bad_request(f"{param}[{i}] has no tokens", param)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"{param}[{i}] has token id {bad[0]}, outside the vocabulary "
                              f"(0..{vocab - 1})", param)
        if len(ids) > n_ctx:
            if not truncate:
                raise APIError(400, f"{param}[{i}] is too large: {len(ids)} tokens; the context "
                               f"holds {n_ctx} (send truncate: true to cut it)", param=param,
                               code="context_length_exceeded")
            ids = ids[:n_ctx]
        out.append(ids)
    return out


async def encode(state: ServerState, texts: list[list[int]], run: Callable[[list], list]) -> list:
    """run(texts) (one of the model's encoder methods: pooled, hidden, scores) in a worker
    thread, counted in /metrics as one request of sum(len) prompt tokens."""
    state.activity.encoding += 1
    began = time.perf_counter()
    try:
        return await asyncio.to_thread(run, texts)
    finally:
        state.activity.encoding -= 1
        state.activity.encoded(sum(len(t) for t in texts), max(len(t) for t in texts),
                               time.perf_counter() - began)


def flag(body: dict[str, Any], name: str) -> bool:
    """A true/false field, false when absent (and a 400 for anything but a JSON boolean)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false", name)
    return value


def vector_json(v: np.ndarray, encoding: str = "float") -> JSONText | list[float] | str:
    """A vector as the OpenAI API writes it: a list of floats (as JSON text written in C++
    where the kernels are built: the same text as json.dumps of the list), or base64 of its
    little-endian float32 bytes."""
    v = np.asarray(v, np.float32)
    if encoding == "base64":
        return base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
    text = kernels.json_floats(v)
    return v.tolist() if text is None else JSONText(text)


def usage(n_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
