"""Chat templates rendered the way llama-server --jinja renders them.

A GGUF file carries its chat template as Jinja source. llama-server does not hand the OpenAI
messages to that template as they arrive: it normalises them (content parts joined or wrapped to
suit the template, JSON-string tool-call arguments parsed when the template reads them as
objects, a system message folded into the next one when the template ignores system messages,
a few model families' own adjustments), adds its own variables, continues a final assistant
message instead of opening a new turn, and strips a leading BOS that tokenization adds again.
`ChatTemplate.render` does all of that, so its output is the prompt llama-server evaluates.

One render, and where each step lives:
- `chat_messages`: each message parsed as llama-server stores it, then adapted to the template;
- `template_caps`: what the template reads, found as llama.cpp finds it, by rendering probe
  conversations whose values (`probe_values`) record how the template touched them;
- `template_families`: the model families llama.cpp handles apart (gpt-oss, Ministral, LFM2,
  DeepSeek V4, Gemma 4, ...): source patches, message rewrites, continuation strings;
- `jinja_env`: the immutable jinja2 sandbox templates run in, and ChatTemplateError;
- here: the context variables, the render itself, BOS/EOS stripping and continuing the last
  assistant message.
"""

from __future__ import annotations

import time
from typing import Any

from kinetic.text.chat_messages import MEDIA_MARKER, parse_message, parse_tools, prepare_messages
from kinetic.text.jinja_env import (ChatTemplateError, Sandbox, compile_template, freeze,
                                    run_template)
from kinetic.text.template_caps import TemplateCaps, preserve_flags, probe_caps, probe_thinking
from kinetic.text.template_families import (FAMILY_MIDDLES, FAMILY_TURNS, adjust_prompt,
                                            patch_source, template_family)

__all__ = ["CHATML_TEMPLATE", "MEDIA_MARKER", "ChatTemplate", "ChatTemplateError", "TemplateCaps"]

# llama-server's fallback when the model has no template; the newlines inside the Jinja string
# literals are real newlines in llama.cpp's source too.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}")

_SPECIAL_DEFAULTS = {  # tokenizer model -> (bos id, eos id, add_bos, add_eos), as llama.cpp's vocab
    "llama": (1, 2, True, False), "bert": (101, None, True, False),
    "gpt2": (11, 11, False, False), "t5": (None, 1, False, True),
    "rwkv": (None, None, False, False), "plamo2": (1, 2, False, False)}
_BPE_WITH_BOS = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                 "lfm2", "tekken", "chameleon"}


class ChatTemplate:
    """A model's chat template, rendering OpenAI-style conversations into prompt text exactly as
    llama-server --jinja does. `caps` holds what probing found; `supports_thinking` says whether
    the template reacts to enable_thinking (llama-server then turns thinking on by default) and
    `supports_tools` whether it describes the offered tools."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", *,
                 add_bos: bool = False, add_eos: bool = False):
        if not source or source == "chatml":
            source = CHATML_TEMPLATE
        source = patch_source(source)
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self.add_bos, self.add_eos = add_bos, add_eos
        self._template = compile_template(Sandbox(), source)
        self._family = template_family(source)
        self.caps: TemplateCaps = probe_caps(source)
        self.supports_tools: bool = self.caps.supports_tools
        self.supports_thinking, self._think_tags = probe_thinking(
            source, self._family, self.caps, self._render_probe)

    @classmethod
    def from_metadata(cls, metadata: dict) -> "ChatTemplate":
        """The GGUF file's template with its BOS/EOS token texts, or llama-server's ChatML
        fallback when the file has none."""
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        kind = metadata.get("tokenizer.ggml.model", "llama")
        bos_id, eos_id, add_bos, add_eos = _SPECIAL_DEFAULTS.get(kind, (None, None, False, False))
        if kind == "gpt2":
            add_bos = metadata.get("tokenizer.ggml.pre") in _BPE_WITH_BOS
            if metadata.get("tokenizer.ggml.pre") in ("glm4", "chatglm-bpe"):
                bos_id = None

        def piece(key: str, default: int | None) -> str:
            tid = metadata.get(key, default)
            if not isinstance(tid, int) or not 0 <= tid < len(tokens):
                tid = default  # llama.cpp ignores an id past the vocabulary
            return tokens[tid] if tid is not None and 0 <= tid < len(tokens) else ""
        return cls(metadata.get("tokenizer.chat_template") or "",
                   piece("tokenizer.ggml.bos_token_id", bos_id),
                   piece("tokenizer.ggml.eos_token_id", eos_id),
                   add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos)),
                   add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", add_eos)))

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, *, prefill_assistant: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (OpenAI chat format) with `tools` offered.

        kwargs are the request's chat_template_kwargs (enable_thinking, reasoning_effort, ...).
        As in llama-server, a final assistant message is continued rather than closed
        (prefill_assistant=False turns that off), and the text starts without the BOS token
        when tokenization adds one. Raises ChatTemplateError for what llama-server refuses."""
        thinking = kwargs.get("enable_thinking", self.supports_thinking)
        if isinstance(thinking, str):
            raise ChatTemplateError(
                'invalid type for "enable_thinking" (expected boolean, got string)')
        thinking = thinking if isinstance(thinking, bool) else self.supports_thinking
        trim = "You have access to the following functions in JSONSchema format" in self.source
        parsed = [parse_message(m, trim) for m in messages]
        last = messages[-1] if messages else None
        if prefill_assistant and parsed and parsed[-1]["role"] == "assistant":
            if len(parsed) > 1 and parsed[-2]["role"] == "assistant":
                raise ChatTemplateError(
                    "Cannot have 2 or more assistant messages at the end of the list.")
            if parsed[-1].get("tool_calls"):
                raise ChatTemplateError(
                    "Cannot continue an assistant message that contains tool calls.")
            parsed, add_generation_prompt = parsed[:-1], False
        else:
            last = None
        ctx = self._context(self._prepare(parsed), parse_tools(tools), thinking, kwargs)
        prompt = self._apply(ctx, add_generation_prompt)
        prompt = adjust_prompt(self._family, prompt, add_generation_prompt)
        if last is not None:
            prompt += self._continuation(ctx, prompt, parse_message(last, trim))
        return prompt

    # -- llama.cpp's steps, in its order ------------------------------------------------------

    def _prepare(self, messages: list[dict]) -> list[dict]:
        return prepare_messages(messages, self.caps, self.source, self._family)

    def _context(self, messages: list[dict], tools: list[dict], thinking: bool,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        ctx: dict[str, Any] = {}
        if isinstance(kwargs.get("preserve_reasoning"), bool):
            ctx.update(preserve_flags(kwargs["preserve_reasoning"]))
        if isinstance(kwargs.get("reasoning_effort"), str) and kwargs["reasoning_effort"]:
            ctx["reasoning_effort"] = ctx["reasoning_strength"] = kwargs["reasoning_effort"]
        ctx.update(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                   enable_thinking=thinking)
        if tools:
            ctx["tools"] = tools
        now = time.localtime()
        ctx["datetime"] = time.strftime("%b %d %Y", now)
        ctx["date_string"] = time.strftime("%d %b %Y", now)
        ctx.update(kwargs)
        return ctx

    def _apply(self, ctx: dict[str, Any], add_generation_prompt: bool) -> str:
        """One render: llama.cpp's direct apply, BOS/EOS stripping included."""
        ctx = freeze(ctx)
        if add_generation_prompt:
            ctx["add_generation_prompt"] = True
        text = run_template(self._template, ctx)
        if self.add_bos and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        if self.add_eos and self.eos_token and text.endswith(self.eos_token):
            text = text[:-len(self.eos_token)]
        return text

    def _generation_prompt(self, ctx: dict[str, Any]) -> str:
        closed, opened = self._apply(ctx, False), self._apply(ctx, True)
        n = 0
        while n < min(len(closed), len(opened)) and closed[n] == opened[n]:
            n += 1
        return opened[n:]

    def _continuation(self, ctx: dict[str, Any], prompt: str, msg: dict) -> str:
        """What follows the rendered history when the last assistant message is continued:
        an opened assistant turn, the reasoning, and (unless the message stops inside its
        reasoning) the reasoning's end and the content."""
        content = msg["content"] if isinstance(msg["content"], str) else "\n\n".join(
            p["text"] for p in msg["content"] if p["type"] == "text")
        reasoning = msg.get("reasoning_content", "")
        if not (content or reasoning or msg.get("name") or msg.get("tool_call_id")):
            return ""  # llama.cpp has nothing to continue, and no generation prompt either
        whole = bool(content) or not reasoning
        family = self._family
        thinks_in_tags = "<think>" in self.source
        if family in ("functionary", "gigachat") or family == "qwen3_coder" and not thinks_in_tags:
            return FAMILY_TURNS[family] + content
        if family == "deepseek_v4" and not reasoning:
            return "<｜Assistant｜></think>" + (content if whole else "")
        if family in FAMILY_TURNS:
            opened, middle = FAMILY_TURNS[family], FAMILY_MIDDLES.get(family, "")
            if family == "qwen3_coder":  # the thinking variant (Qwen3.5, Nemotron 3, StepFun)
                opened, middle = opened + "<think>\n", "\n</think>\n\n"
            elif family == "minimax_m3":
                opened = self._generation_prompt(ctx) + opened
            elif family.startswith("gemma4"):
                opened = ("<|turn>model\n" if prompt.endswith("<turn|>\n") else "") + opened
            return opened + reasoning + (middle + content if whole else "")
        text = self._generation_prompt(ctx)
        start, end = self._think_tags
        if start:
            cut = text.find(start)
            text = (text[:cut] if cut >= 0 else text) + start + reasoning + (end if whole else "")
        return text + (content if whole else "")

    def _render_probe(self, messages: list[dict], gen: bool, thinking: bool,
                      tools: list[dict] | None = None) -> str | None:
        try:
            msgs = self._prepare([parse_message(m, False) for m in messages])
            return self._apply(self._context(msgs, parse_tools(tools), thinking, {}), gen)
        except ChatTemplateError:
            return None
