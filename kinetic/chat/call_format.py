"""The shared shape of every tool-call format, and the streamer.

A format finds where its calls begin (a start marker such as "<tool_call>" or "[TOOL_CALLS]", or,
for bare-JSON formats, a reply that starts with "{"), parses the calls from there, and builds the
grammar that forces them. The text before the calls is content (its trailing whitespace dropped);
text after the last call is content too (after a blank line). A calls section that does not parse,
or a start marker after the calls, makes the whole reply content: parsing never raises.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kinetic.chat.reasoning import partial_suffix
from kinetic.grammar import Grammar
from kinetic.grammar.ir import GrammarBuilder, Ref, alt, chars, lit, opt, seq, star


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # the arguments as JSON object text, e.g. '{"city": "Paris"}'


@dataclass(frozen=True)
class ParsedReply:
    content: str            # the text that is not calls ("" if none)
    calls: tuple[ToolCall, ...]


class Malformed(ValueError):
    """A calls section that does not parse (caught inside parse)."""


class ToolFormat:
    """One family's call format. Subclasses set the class attributes and implement
    `_parse_section` and `_call`."""

    name: str = ""
    markers: tuple[str, ...] = ()   # special-token texts the engine must render as text
    start: str = ""                 # the text that opens the calls
    list_open, list_sep, list_close = "", "\n", ""   # how the grammar writes several calls

    def parse(self, text: str, tools: list[dict] | None = None) -> ParsedReply:
        """The content and calls of a finished reply (reasoning already split off). `tools`
        (the request's tools), when given, types the values of the XML formats."""
        at = self._calls_start(text)
        if at is None:
            return ParsedReply(text, ())
        try:
            calls, end = self._parse_section(text, at, _schemas(tools))
        except (ValueError, TypeError, RecursionError):   # Malformed is a ValueError
            return ParsedReply(text, ())
        after = text[end:]
        if not calls or (self.start and self.start in after):
            return ParsedReply(text, ())
        content = "\n\n".join(p for p in (text[:at].rstrip(), after.strip()) if p)
        return ParsedReply(content, tuple(calls))

    def streamer(self, tools: list[dict] | None = None) -> "ToolCallStream":
        """A streamer of one reply in this format."""
        return ToolCallStream(self, tools)

    def grammar(self, tools: list[dict], parallel: bool, think: str) -> Grammar:
        """The grammar of a reply that is only calls to `tools` (one, or with `parallel` one or
        more), each name and arguments following the tool's JSON Schema. think: "none"; "open"
        (the prompt left <think> open: thinking text, "</think>" and whitespace come first);
        "optional" (a whole "<think>...</think>" block may come first). Raises UnsupportedSchema
        for a schema the grammar cannot enforce, ValueError for no tools or an unknown think."""
        if not tools:
            raise ValueError("a forced tool call needs at least one tool")
        b = GrammarBuilder()
        calls = []
        for i, tool in enumerate(tools):
            fn = tool["function"]
            calls.append(self._call(b, fn["name"], _parameters(fn), f"tool{i}-"))
        b.define("tc-call", alt(*calls))
        call = Ref("tc-call")
        body = seq(call, star(seq(lit(self.list_sep), call))) if parallel else call
        b.define("root", seq(think_prefix(b, think), lit(self.list_open), body,
                             lit(self.list_close)))
        grammar = b.build("root")
        grammar.source = {"type": "tool_call", "format": self.name, "tools": tools,
                          "parallel": parallel, "think": think}
        return grammar

    # --- what each format provides ---

    def _parse_section(self, text: str, at: int, schemas: dict) -> tuple[list[ToolCall], int]:
        """The calls of the section starting at `at`, and where the section ends. Raises
        Malformed (or ValueError) if it does not parse."""
        raise NotImplementedError

    def _call(self, b: GrammarBuilder, name: str, params: dict, prefix: str):
        """The grammar expression of one call of tool `name`."""
        raise NotImplementedError

    # --- where calls begin ---

    def _calls_start(self, text: str) -> int | None:
        at = text.find(self.start)
        return None if at < 0 else at

    def hold_from(self, text: str, sent: int) -> int:
        """How much of a reply in progress is content for sure: up to the first start marker,
        or a suffix that may still become one, less the whitespace before it. `text[:sent]` is
        known to hold no marker, so the search starts there."""
        at = text.find(self.start, sent)
        if at < 0:
            at = partial_suffix(text, self.start)
        while at > sent and text[at - 1].isspace():
            at -= 1
        return at


class ToolCallStream:
    """Splits a reply, as it is generated, into content sent at once and calls sent whole.

    feed() returns the content that is final now: text before the calls flows as written; only
    what may be the start of the calls is held back (a partial marker and the whitespace before
    it, everything from the marker on). finish() parses the whole reply: its content is what
    was not sent yet (the held-back text itself if the calls turn out malformed), so the pieces
    joined always equal the finished parse's content.
    """

    def __init__(self, fmt: ToolFormat, tools: list[dict] | None = None):
        self.fmt = fmt
        self.tools = tools
        self.text = ""
        self.sent = 0

    def feed(self, text: str) -> str:
        """Adds generated text; returns the content that can be sent now."""
        self.text += text
        safe = self.fmt.hold_from(self.text, self.sent)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self) -> ParsedReply:
        """The content not sent yet and all the calls."""
        reply = self.fmt.parse(self.text, self.tools)
        if not reply.content.startswith(self.text[:self.sent]):
            # sent text is never retracted: keep it as content, and the rest with it
            return ParsedReply(self.text[self.sent:], ())
        return ParsedReply(reply.content[self.sent:], reply.calls)


# --- shared pieces of the formats ---

def call_from_object(obj, arg_keys=("arguments", "parameters")) -> ToolCall:
    """A call from {"name": ..., "arguments" (or "parameters"): {...}}; other keys than these,
    "type" and "id" make it malformed (a JSON answer is not a call)."""
    if not isinstance(obj, dict) or not set(obj) <= {"name", "type", "id", *arg_keys}:
        raise Malformed("not a call object")
    name = obj.get("name")
    keys = [k for k in arg_keys if k in obj]
    if not isinstance(name, str) or not name or len(keys) != 1:
        raise Malformed("a call needs a name and arguments")
    args = obj[keys[0]]
    if isinstance(args, str):
        args = loads(args)
    if not isinstance(args, dict):
        raise Malformed("arguments are not an object")
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _no_constant(name: str):
    raise Malformed(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)   # NaN and Infinity are not JSON


def loads(text: str):
    """Strict JSON (no NaN or Infinity)."""
    return _DECODER.decode(text)


def decode_json(text: str, at: int):
    """The JSON value at `at` (after whitespace) and where it ends."""
    return _DECODER.raw_decode(text, skip_ws(text, at))


def skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def expect(text: str, at: int, word: str) -> int:
    """The position after `word` at `at`; Malformed if it is not there."""
    if not text.startswith(word, at):
        raise Malformed(f"expected {word!r}")
    return at + len(word)


def json_name(name: str) -> str:
    return json.dumps(name, ensure_ascii=False)


def _parameters(fn: dict) -> dict:
    """A tool's parameters schema; arguments are always an object."""
    params = fn.get("parameters")
    if not isinstance(params, dict) or not params:
        return {"type": "object"}
    return params if "type" in params else {"type": "object", **params}


def _schemas(tools: list[dict] | None) -> dict:
    """name -> parameters schema of the request's tools."""
    return {t["function"]["name"]: _parameters(t["function"]) for t in tools or ()
            if isinstance(t, dict) and isinstance(t.get("function"), dict)}


# --- grammar pieces ---

def text_until(b: GrammarBuilder, stop: str, name: str) -> Ref:
    """A rule for any text that does not contain `stop`, followed by `stop` (whose first
    character must not occur again in it): the matching automaton, one rule per matched
    prefix length."""
    assert stop[0] not in stop[1:]
    if name not in b.exprs:
        c0 = ord(stop[0])
        restart = seq(lit(stop[0]), Ref(f"{name}-1"))
        b.define(name, alt(seq(chars([(c0, c0)], negate=True), Ref(name)), restart))
        for k in range(1, len(stop)):
            ck = ord(stop[k])
            matched = seq(lit(stop[k]), *([Ref(f"{name}-{k + 1}")] if k + 1 < len(stop) else []))
            other = seq(chars([(ck, ck), (c0, c0)], negate=True), Ref(name))
            b.define(f"{name}-{k}", alt(matched, restart, other))
    return Ref(name)


def think_prefix(b: GrammarBuilder, think: str):
    """What may come before the calls: nothing, the end of an open <think> block, or an optional
    whole block; whitespace after </think>."""
    if think == "none":
        return seq()
    ws = star(alt(lit(" "), lit("\n"), lit("\t"), lit("\r")))
    end = seq(text_until(b, "</think>", "think-text"), ws)
    if think == "open":
        return end
    if think == "optional":
        return opt(seq(lit("<think>"), end))
    raise ValueError(f"think must be none, open or optional, not {think!r}")
