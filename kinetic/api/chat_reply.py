"""A chat answer's text taken apart: reasoning, content and tool calls (kinetic/chat).

    plan = plan_chat(model, request)        # prompt ids, grammar, and how to read the answer
    out = plan.reader()
    reasoning, content = out.feed(delta.text)   # per delta, what can be sent now
    reasoning, content, calls = out.finish()    # at the end: the rest, and the calls whole
    reasoning, content, calls = out.read(text)  # or a whole answer at once (not streamed)

Thinking is split off when the chat template knows <think> or the prompt opened a think
block; tool calls are read in the template's own format when tools are offered. A forced
call (tool_choice "required" or a function) is held to that format by a grammar; otherwise
the request's own grammar or response_format, if any, shapes the answer.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any, Callable

from kinetic.api.errors import bad_request
from kinetic.api.offload import image_work, offload, prompt_tokens, refuse_by_length
from kinetic.api.core import ready_grammar, shape_grammar
from kinetic.api.params import ChatRequest
from kinetic.chat.reasoning import (ReasoningSplitter, prompt_opens_thinking,
                                    template_knows_thinking)
from kinetic.chat.tool_calls import ToolCall, ToolFormat, tool_format
from kinetic.grammar import Grammar, GrammarError, UnsupportedSchema
from kinetic.text.chat_messages import MEDIA_MARKER
from kinetic.text.chat_template import ChatTemplateError


@dataclass(frozen=True)
class ChatPlan:
    prompt: list[int]
    images: tuple                  # the prompt's image rows (engine.request.ImageRows)
    grammar: Grammar | None
    thinking: bool                 # split reasoning off the answer
    opens_thinking: bool           # the prompt ended inside a <think> block
    calls: ToolFormat | None       # read tool calls in this format
    tools: list[dict] | None       # the tools offered (their schemas type XML call values)

    def reader(self) -> "ChatReader":
        return ChatReader(self)


def chat_text(model, req: ChatRequest) -> str:
    """The prompt text of a chat request: its messages and tools through the model's chat
    template, with the generation prompt. Raises APIError 400 for messages the template
    refuses."""
    try:
        return model.apply_chat_template(req.messages, tools=req.tools, **req.template_kwargs)
    except ChatTemplateError as e:
        raise bad_request(f"the chat template refused the messages: {e}", "messages") from None


def chat_prompt(model, req: ChatRequest, n_ctx: int | None = None,
                param: str = "messages") -> tuple[str, list[int]]:
    """The prompt of a chat request, as text (chat_text) and token ids (a prefill renders it
    the same way: kinetic/api/dialects/prefill.py); with `n_ctx`, the context 400 (naming
    `param`) as soon as the text cannot fit (offload.prompt_tokens)."""
    text = chat_text(model, req)
    return text, prompt_tokens(model.tokenizer, text, n_ctx, param)


def plan_chat(model, req: ChatRequest, param: str = "messages") -> ChatPlan:
    """Render and tokenize the prompt and compile the answer's grammar (blocking: run it in a
    worker thread, offload.py). Raises APIError 400 for messages the template refuses, a
    prompt that cannot fit the context, an invalid grammar or schema, or a tool schema
    kinetic cannot enforce."""
    if req.images:
        from kinetic.vision.images import ImageError
        text = chat_text(model, req)
        # text that cannot fit is refused before the images are laid out (their rows
        # only add to it)
        refuse_by_length(model.tokenizer, text.replace(MEDIA_MARKER, ""), model.n_ctx, param)
        try:
            prompt, images = model.image_prompt(text, list(req.images))
        except ImageError as e:
            raise bad_request(str(e), "messages") from None
    else:
        (text, prompt), images = chat_prompt(model, req, model.n_ctx, param), ()
    source = model.chat_template.source
    opens = prompt_opens_thinking(text)
    thinking = opens or template_knows_thinking(source)
    fmt = tool_format(source) if req.tools else None
    grammar = None
    if req.forced_call:
        # a request that turned thinking off gets no think block before its call
        may_think = thinking and req.template_kwargs.get("enable_thinking") is not False
        think = "open" if opens else "optional" if may_think else "none"
        try:
            grammar = ready_grammar(model, fmt.grammar(req.tools, req.parallel_tool_calls,
                                                       think), "tools")
        except (UnsupportedSchema, GrammarError) as e:
            raise bad_request(f"cannot hold the reply to these tools: {e}", "tools") from None
        except RecursionError:
            raise bad_request("a tool's parameters are nested too deeply", "tools") from None
    elif req.options.shape is not None:
        grammar = shape_grammar(model, req.options.shape)
    return ChatPlan(prompt, images, grammar, thinking, opens, fmt, req.tools)


async def parse_and_plan(model, parse: Callable[[], ChatRequest], has_images: bool,
                         param: str = "messages") -> tuple[ChatRequest, ChatPlan]:
    """parse() (which decodes a request's images) and plan_chat, each in a parse worker;
    with images (and a projector to read them), inside offload.image_work, one such request
    at a time. The request comes back without its images' pixels: the plan holds their
    rows, and a request is kept while it generates."""
    async with image_work(has_images and model.projector is not None):
        req = await offload(parse)
        plan = await offload(plan_chat, model, req, param)
    return dataclasses.replace(req, images=()), plan


class ChatReader:
    """Reads one answer as it streams: `feed` returns the (reasoning, content) that can be
    sent now, holding back what may still turn out to be a tag or a call; `finish` returns
    the rest and the calls. Calls that do not parse come back as content, never lost."""

    def __init__(self, plan: ChatPlan):
        self._think = ReasoningSplitter(plan.opens_thinking) if plan.thinking else None
        self._calls = plan.calls.streamer(plan.tools) if plan.calls is not None else None

    def feed(self, text: str) -> tuple[str, str]:
        reasoning, content = self._think.feed(text) if self._think else ("", text)
        if self._calls is not None:
            content = self._calls.feed(content)
        return reasoning, content

    def finish(self) -> tuple[str, str, tuple[ToolCall, ...]]:
        reasoning, content = self._think.finish() if self._think else ("", "")
        if self._calls is None:
            return reasoning, content, ()
        content = self._calls.feed(content)
        reply = self._calls.finish()
        return reasoning, content + reply.content, reply.calls

    def read(self, text: str) -> tuple[str, str, tuple[ToolCall, ...]]:
        """A whole answer's reasoning, content and calls: `feed` it all, then `finish`."""
        reasoning, content = self.feed(text)
        more_reasoning, more_content, calls = self.finish()
        return reasoning + more_reasoning, content + more_content, calls


def tool_call_objects(calls: tuple[ToolCall, ...], streamed: bool) -> list[dict[str, Any]]:
    """OpenAI's tool_calls entries, each with a fresh id (and its index when streamed)."""
    out = []
    for i, call in enumerate(calls):
        entry: dict[str, Any] = {"id": f"call-{secrets.token_hex(12)}", "type": "function",
                                 "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": i, **entry} if streamed else entry)
    return out
