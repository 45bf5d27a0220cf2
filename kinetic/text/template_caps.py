"""What a chat template can do, found by probing it as llama.cpp does.

`probe_caps` renders small conversations made of probe values (see probe_values) in a sandbox
whose filters, tests and attribute lookups report to them, then reads which values the template
touched and how: whether it reads content as a string or as parts, shows a system message,
describes tools, reads tool-call arguments as objects, and so on. `probe_thinking` renders real
conversations through the template to find whether it thinks and the tags around reasoning.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kinetic.text.jinja_env import Sandbox, compile_template, json_ready
from kinetic.text.probe_values import ProbeDict, ProbeList, ProbeStr, mark, peek, track
from kinetic.text.template_families import THINKING_FAMILIES

# renders (messages, add_generation_prompt, enable_thinking, tools) as a real request would be
# rendered; None where the template refuses it
RenderProbe = Callable[[list[dict], bool, bool, list[dict] | None], str | None]


@dataclass(frozen=True)
class TemplateCaps:
    """What a template does with its input, found by probing it as llama.cpp does."""

    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_system_role: bool = True
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_parallel_tool_calls: bool = True
    supports_object_arguments: bool = False
    supports_preserve_reasoning: bool = False
    supports_reasoning_effort: bool = False


class _ProbeSandbox(Sandbox):
    """The sandbox with every filter, test and attribute lookup reporting to the probe values."""

    def __init__(self) -> None:
        super().__init__()
        for table, prefix in ((self.filters, ""), (self.tests, "test_is_")):
            for name, fn in list(table.items()):
                table[name] = self._watch(fn, prefix + name, deep=name in ("tojson", "string"))
        iterable, sequence = self.tests["iterable"], self.tests["sequence"]
        self.tests["iterable"] = lambda v: isinstance(v, str) or iterable(v)
        self.tests["sequence"] = lambda v: isinstance(v, str) or sequence(v)

    @staticmethod
    def _watch(fn: Any, op: str, deep: bool) -> Any:
        skip = 1 if getattr(fn, "jinja_pass_arg", None) else 0

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if len(args) > skip and isinstance(args[skip], (ProbeStr, ProbeDict, ProbeList)):
                mark(args[skip], deep)
                args[skip].ops.add(op)
            if deep and len(args) > skip:  # a plain copy: serialising must not count as access
                args = args[:skip] + (json_ready(args[skip]),) + args[skip + 1:]
            return fn(*args, **kwargs)
        return watched

    def getattr(self, obj: Any, attribute: str) -> Any:
        if isinstance(obj, ProbeStr):
            obj._use(attribute)
        return super().getattr(obj, attribute)


_PROBE_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description", "parameters": {
        "type": "object",
        "properties": {"arg": {"type": "string", "description": "Arg description"}},
        "required": ["arg"]}}}]


def _probe_conversation(arguments: Any, n_calls: int) -> list[dict]:
    calls = [{"id": f"call0000{i + 1}", "type": "function",
              "function": {"name": "tool1", "arguments": arguments}} for i in range(n_calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def probe_caps(source: str) -> TemplateCaps:
    """llama.cpp's capability checks: render probe conversations, see what was touched."""
    template = compile_template(_ProbeSandbox(), source)

    def run(messages: list, tools: list | None = None, **extra: Any) -> tuple:
        msgs, tls = track(messages), track(tools or [])
        ctx = {"messages": msgs, "tools": tls, "bos_token": "", "eos_token": "",
               "add_generation_prompt": True, **extra}
        try:
            return True, msgs, tls, template.render(ctx)
        except Exception:  # a probe the template rejects tells something too
            return False, msgs, tls, ""

    caps: dict[str, bool] = {}
    ok, msgs, _, out = run([{"role": "user", "content": "STRING_MARKER"}])
    content = peek(msgs, 0, "content")
    as_array = bool(content.ops & {"selectattr", "array_access"})
    caps["supports_typed_content"] = as_array
    caps["supports_string_content"] = ok and not (as_array and "STRING_MARKER" not in out)
    if "test_is_string" in content.ops:
        ok, msgs, _, _ = run([{"role": "user", "content": []}])
        if ok and peek(msgs, 0, "content").ops & {"selectattr", "array_access"}:
            caps["supports_typed_content"] = True

    _, msgs, _, _ = run([{"role": "system", "content": "System message"},
                         {"role": "user", "content": "User message"}])
    caps["supports_system_role"] = peek(msgs, 0, "content").used

    tools_ok = calls_ok = True
    ok, msgs, tls, _ = run(_probe_conversation({"arg": "value"}, 1), _PROBE_TOOLS)
    if ok:
        tools_ok = peek(tls, 0, "function", "name").used
        calls_ok = peek(msgs, 1, "tool_calls").used
        caps["supports_object_arguments"] = calls_ok and peek(
            msgs, 1, "tool_calls", 0, "function", "arguments", "arg").used
    if not caps.get("supports_object_arguments"):
        ok, msgs, tls, _ = run(_probe_conversation('{"arg": "value"}', 1), _PROBE_TOOLS)
        tools_ok = ok and peek(tls, 0, "function", "name").used
        calls_ok = ok and peek(msgs, 1, "tool_calls").used
    caps["supports_tools"], caps["supports_tool_calls"] = tools_ok, calls_ok

    args = {"arg": "value"} if caps.get("supports_object_arguments") else '{"arg": "value"}'
    ok, msgs, _, _ = run(_probe_conversation(args, 2), _PROBE_TOOLS)
    caps["supports_parallel_tool_calls"] = ok and peek(msgs, 1, "tool_calls", 1, "function").used

    placeholder = "<REASONING_CONTENT_PLACEHOLDER>"
    user = {"role": "user", "content": "User message"}
    answer = {"role": "assistant", "content": "Assistant message"}
    history = [user, dict(answer, reasoning_content=placeholder), user,
               dict(answer, reasoning_content="Reasoning content"), user]
    _, _, _, out = run(history, enable_thinking=True, **preserve_flags(True))
    caps["supports_preserve_reasoning"] = placeholder in out

    effort = ProbeStr("low")
    run([{"role": "user", "content": "User message"}], enable_thinking=True,
        reasoning_effort=effort, reasoning_strength=effort)
    caps["supports_reasoning_effort"] = effort.used
    return TemplateCaps(**caps)


def preserve_flags(enabled: bool) -> dict[str, bool]:
    """The variables different templates read for keeping past reasoning in the prompt."""
    return {"preserve_thinking": enabled, "clear_thinking": not enabled,
            "truncate_history_thinking": not enabled, "drop_thinking": not enabled}


# ---------------------------------------------------------------------------------------------
# Reasoning delimiters

_MARKER = r"(?:<[^>]*>|\[[^\]]*\])"  # a special-token-like tag: <...> or [...]


def probe_thinking(source: str, family: str, caps: TemplateCaps,
                   render_probe: RenderProbe) -> tuple[bool, tuple[str, str]]:
    """Whether the template thinks (llama-server then turns enable_thinking on by default)
    and the reasoning delimiters, whitespace included, that continuations use. Like
    llama.cpp: where the template shows past reasoning, what surrounds it; otherwise what
    enable_thinking adds to the generation prompt; otherwise known older formats."""
    if family:
        thinks = family in THINKING_FAMILIES or family == "qwen3_coder" and "<think>" in source
        return thinks, ("", "")
    user = {"role": "user", "content": "U_USER_MSG Hello END_U"}
    answer = {"role": "assistant", "content": "A_ASST_MSG I can help END_A"}
    thought = "REASON_PART I am thinking END_R"
    start = end = ""
    shown = render_probe([user, dict(answer, reasoning_content=thought)], False, True)
    plain = render_probe([user, answer], False, True)
    if shown is not None and plain is not None and thought in shown:
        found = re.search(f"({_MARKER}\\s*){re.escape(thought)}(\\s*{_MARKER}\\s*)", shown)
        if found:
            start, end = found.group(1), found.group(2)
        else:
            found = re.search(f"{re.escape(thought)}\\s*({_MARKER}\\s*)", shown)
            end = found.group(1) if found else ""
    off, on = render_probe([user], True, False), render_probe([user], True, True)
    if off is not None and on is not None and off != on:
        start, end = _tags_from_switch(off, on, start, end)
    if caps.supports_tool_calls:
        start, end = _tags_from_tool_turn(render_probe, user, thought) or (start, end)
    src = source
    old_qwen = ("content.split('</think>')" in src and "reasoning_content" not in src
                and "<SPECIAL_12>" not in src)
    granite = "Write your thoughts between <think></think> and write your response" in src
    if not start and not end and (old_qwen or granite):
        start, end = "<think>", "</think>"  # older Qwen / DeepSeek-R1 and Granite 3.3 formats
    if all(t in src for t in ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
                              "<TOOL_RESPONSE>")):
        start, end = "<think>\n", "</think>"  # Nemotron Nano v2
    if "laguna_glm_thinking" in src:
        start, end = start.strip(), end.strip()
    return bool(start or end), (start, end)


def _tags_from_tool_turn(render_probe: RenderProbe, user: dict,
                         thought: str) -> tuple[str, str] | None:
    """Delimiters of templates that show reasoning only next to tool calls."""
    params = {"type": "object",
              "properties": {"a": {"type": "string"}, "b": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "FFF_FIRST_FUN", "parameters": params}}]
    call = {"type": "function", "id": "call00001",
            "function": {"name": "FFF_FIRST_FUN", "arguments": {"a": "VVVV", "b": "XXXX"}}}
    thinking = {"role": "assistant", "reasoning_content": thought}
    plain = render_probe([user, dict(thinking, content="A_ASST_MSG I can help END_A")],
                         False, True, tools)
    shown = render_probe([user, dict(thinking, content=None, tool_calls=[call])],
                         False, True, tools)
    if plain is None or shown is None or thought in plain or thought not in shown:
        return None
    found = re.search(f"({_MARKER}\\s*){re.escape(thought)}\\s*({_MARKER}\\s*)", shown)
    if found:
        return found.group(1), found.group(2)
    found = re.search(f"{re.escape(thought)}\\s*({_MARKER}\\s*)?", shown)
    return "", found.group(1) or ""


def _tags_from_switch(off: str, on: str, start: str, end: str) -> tuple[str, str]:
    """Reasoning delimiters from what enable_thinking changes in a generation prompt."""
    n = 0
    while n < min(len(off), len(on)) and off[n] == on[n]:
        n += 1
    m = 0
    while m < min(len(off), len(on)) - n and off[-1 - m] == on[-1 - m]:
        m += 1
    only_off, only_on = off[n:len(off) - m], on[n:len(on) - m]
    if not only_off.strip() and only_on:  # thinking opens a block
        if only_on.strip() and on.endswith(only_on.strip()) and not start:
            start = only_on
    elif not only_on.strip() and only_off:  # no thinking closes an empty block
        if only_off.strip() and off.endswith(only_off.strip()) and not end:
            tags = [t for t in re.split(f"({_MARKER})", off) if t.strip()]
            if len(tags) >= 2 and tags[-1] == only_off.strip() and re.fullmatch(_MARKER, tags[-2]):
                start = tags[-2]
            end = only_off
    elif only_off.strip() and only_on.strip():  # the rest changed too: look at the tails
        for base, longer in ((on, off), (off, on)):
            anchor = base[-64:]
            pos = longer.rfind(anchor)
            if pos < 0 or pos + len(anchor) >= len(longer):
                continue
            tail = longer[pos + len(anchor):].strip()
            extra = [t for t in re.split(f"({_MARKER})", tail) if t.strip()]
            if len(extra) == 2 and all(re.fullmatch(_MARKER, t) for t in extra):
                start, end = start or extra[0], end or extra[1]
                break
    return start, end
