"""/v1/prefill: Zero Wait. An app sends the conversation while its user is still writing the
last message, as often as it changes, and the chat completion that follows only runs what is
new.

One prefill, in order: the body is read as a chat completion's (`parse_chat`, with the same
400s; only messages, tools, tool_choice and chat_template_kwargs shape the prompt) ->
`prefill_prompt` renders the prompt exactly as that completion will (`chat_prompt`) and keeps
its tokens up to where the last message's last word starts -> the engine runs their whole
pages into the prefix cache (`Engine.submit_prefill`: on a free slot, with the rows requests
leave, ended early by any request or a newer prefill of the conversation) -> the answer,
`{"object": "prefill", "cached_tokens": N}`, N the leading prompt tokens now in the cache.

Where to cut. The last word may still grow, and whatever the template writes after the last
message (the end of the turn, the assistant's header) is not the next prompt's yet. The prompt
is rendered a second time with the last word replaced by a character no text holds
(SENTINEL): the token ids the two renders share from the start are those that do not depend on
how the last message ends, so the cut never falls inside a token that the word's next letters
could merge into (a tokenizer joins the space before a word to it, say), nor after the word.
Whatever the cut, no answer changes: the cache is found by token ids, so a cut one token too
far only costs the pages after the first token the request does not share.
"""

from __future__ import annotations

import dataclasses

from quart import Blueprint

from kinetic.api.core import json_body, json_response, require_kind, server_state
from kinetic.api.chat_reply import chat_prompt
from kinetic.api.errors import APIError, bad_request
from kinetic.api.offload import offload
from kinetic.api.params import ChatRequest, check_prompt_fits, parse_chat

blueprint = Blueprint("prefill", __name__)

SENTINEL = "\x01"   # stands for "another last word": a control character no text writes


@blueprint.post("/v1/prefill")
@blueprint.post("/prefill")
async def prefill():
    state = server_state()
    model = require_kind(state, "text", "prefills")
    req = await offload(parse_chat, await json_body(), model.default_params, model.text_tokens,
                        vision=model.projector is not None)
    if req.images:
        raise bad_request("a prefill takes no images yet: send the conversation's text",
                          "messages")
    prompt, cut = await offload(prefill_prompt, model, req, model.n_ctx)
    check_prompt_fits(len(prompt), model.n_ctx, "messages")   # the completion would fail too
    result = await model.engine.submit_prefill(prompt[:cut])
    if result.error is not None:
        raise APIError(500, result.error)
    state.activity.prefilled(result)
    return json_response({"object": "prefill", "cached_tokens": result.cached_tokens})


def prefill_prompt(model, req: ChatRequest, n_ctx: int | None = None) -> tuple[list[int], int]:
    """(the chat prompt's token ids, how many of them a prefill runs): the ids the prompt
    shares with the same conversation whose last word is another (module docstring); with
    `n_ctx`, the context 400 as soon as the prompt cannot fit (offload.prompt_tokens).
    Blocking: run it in a worker thread."""
    _, ids = chat_prompt(model, req, n_ctx)
    # no limit: it differs from the prompt, which fits, in its last word only
    _, other = chat_prompt(model, with_last_word(req, SENTINEL))
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return ids, n


def with_last_word(req: ChatRequest, word: str) -> ChatRequest:
    """`req` with the last word of its last message's text replaced by `word`."""
    messages = list(req.messages)
    last = dict(messages[-1])
    content = last.get("content")
    if isinstance(content, list):
        parts = list(content)
        texts = [i for i, p in enumerate(parts) if p.get("type") == "text"]
        if texts:
            i = texts[-1]
            parts[i] = dict(parts[i], text=before_last_word(parts[i].get("text") or "") + word)
        else:
            parts.append({"type": "text", "text": word})
        last["content"] = parts
    else:
        last["content"] = before_last_word(content or "") + word
    messages[-1] = last
    return dataclasses.replace(req, messages=messages)


def before_last_word(text: str) -> str:
    """`text` up to where its last word (its last run of non-space characters) starts."""
    start = len(text.rstrip())
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[:start]
