"""Thinking apart from the answer, Qwen3 style: the reasoning is what is inside <think>...</think>
at the start of a reply (or from the start up to </think> when the prompt left a <think> block
open), stripped of the whitespace around it as llama-server reports it; the content is the rest,
with the whitespace right after </think> dropped."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """True if the rendered prompt ends inside an open <think> block (it ends with "<think>" and
    whitespace), so the reply starts with reasoning."""
    return prompt_text.rstrip().endswith(OPEN)


def template_knows_thinking(template_source: str) -> bool:
    """True if the chat template writes <think> blocks (the model may reason in one)."""
    return OPEN in template_source


def partial_suffix(text: str, tag: str) -> int:
    """Where the longest suffix of `text` that is a proper prefix of `tag` starts (len(text) if
    none): the part that may still become the tag."""
    for i in range(max(0, len(text) - len(tag) + 1), len(text)):
        if tag.startswith(text[i:]):
            return i
    return len(text)


class ReasoningSplitter:
    """Splits a reply, as it is generated, into reasoning and content.

    feed() returns what can be sent now and holds back only what is undecided: a partial tag,
    whitespace that may turn out to end the reasoning, or the start of a reply that may still
    become "<think>". The pieces joined, plus finish(), equal the split of the whole reply.
    A reply that opens <think> (or starts open) and never closes it is all reasoning.
    """

    def __init__(self, started_open: bool):
        self.mode = "reasoning" if started_open else "start"
        self.buf = ""
        self.reasoning_started = False   # leading whitespace of the reasoning is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """Adds generated text; returns (reasoning, content) that is final now."""
        self.buf += text
        reasoning, content = [], []
        while self.buf:
            before = (self.mode, len(self.buf))
            if self.mode == "start":
                self._start()
            elif self.mode == "reasoning":
                reasoning.append(self._reasoning())
            elif self.mode == "after":
                self._after()
            else:
                content.append(self.buf)
                self.buf = ""
            if (self.mode, len(self.buf)) == before:
                break   # waiting for more text
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """At the end of the reply: the (reasoning, content) still held back."""
        rest, self.buf = self.buf, ""
        if self.mode == "reasoning":
            return (rest.rstrip() if self.reasoning_started else rest.strip()), ""
        if self.mode == "after":
            return "", rest.lstrip()
        return "", rest

    def _start(self) -> None:
        head = self.buf.lstrip()
        if head.startswith(OPEN):
            self.buf = head[len(OPEN):]
            self.mode = "reasoning"
        elif not OPEN.startswith(head):
            self.mode = "content"

    def _reasoning(self) -> str:
        if not self.reasoning_started:
            self.buf = self.buf.lstrip()
            self.reasoning_started = bool(self.buf) and not CLOSE.startswith(self.buf)
        end = self.buf.find(CLOSE)
        if end >= 0:
            out, self.buf = self.buf[:end].rstrip(), self.buf[end + len(CLOSE):]
            self.mode = "after"
            return out
        safe = partial_suffix(self.buf, CLOSE)
        safe = len(self.buf[:safe].rstrip())   # trailing whitespace may end the reasoning
        out, self.buf = self.buf[:safe], self.buf[safe:]
        return out

    def _after(self) -> None:
        self.buf = self.buf.lstrip()
        if self.buf:
            self.mode = "content"
