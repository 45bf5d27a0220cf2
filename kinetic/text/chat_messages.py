"""OpenAI chat messages made into what a chat template reads, as llama-server makes them.

llama-server does not hand a request's messages to the template as they arrive. It first
parses each one as it stores it (content parts joined, or kept as parts around media markers;
tool-call arguments kept as JSON strings; only the fields it knows), then adapts them to what
probing found the template can read (`prepare_messages`).
"""

from __future__ import annotations

import json
from typing import Any

from kinetic.text.jinja_env import ChatTemplateError
from kinetic.text.template_caps import TemplateCaps
from kinetic.text.template_families import reshape

MEDIA_MARKER = "<__media__>"  # what llama-server puts where an image or audio part was
MESSAGE_STRINGS = ("reasoning_content", "name", "tool_call_id")  # strings, if given


def _dump_compact(value: Any) -> str:
    # how llama.cpp turns object arguments back into the string it stores
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _join_parts(parts: list[dict]) -> str:
    """llama.cpp's join of content parts: newline between texts, none around media markers."""
    text, after_media = "", False
    for part in parts:
        kind = part.get("type")
        if kind == "text":
            newline, after_media = not after_media and text != "", False
        elif kind == "media_marker":
            newline, after_media = False, True
        else:
            continue
        text += ("\n" if newline else "") + part.get("text", "")
    return text


def parse_message(m: Any, trim: bool) -> dict:
    """One OpenAI message as llama-server stores and re-emits it (its to_json_oaicompat)."""
    if not isinstance(m, dict) or "role" not in m:
        raise ChatTemplateError(f"each message needs a role: {m!r}")
    role = m["role"]
    if "content" not in m and not (role == "assistant" and "tool_calls" in m):
        raise ChatTemplateError(f"a {role} message needs content")
    content, parts = m.get("content"), []
    if isinstance(content, list):
        for p in content:
            kind = p.get("type") if isinstance(p, dict) else None
            if kind == "text":
                if not isinstance(p.get("text"), str):
                    raise ChatTemplateError("a text part's text must be a string")
                parts.append({"type": "text", "text": p["text"]})
            elif kind in ("image_url", "input_audio", "media_marker"):
                parts.append({"type": "media_marker", "text": MEDIA_MARKER})
            else:
                raise ChatTemplateError(f"unsupported content part type {kind!r}")
        content = ""
    elif content is not None and not isinstance(content, str):
        raise ChatTemplateError("message content must be a string or a list of parts")
    for key in MESSAGE_STRINGS:
        if m.get(key) is not None and not isinstance(m[key], str):
            raise ChatTemplateError(f"a message's {key} must be a string")
    strip = (lambda s: s.strip(" \t\n\r\v\f")) if trim else (lambda s: s)  # StepFun only
    content, reasoning = strip(content or ""), strip(m.get("reasoning_content") or "")
    out: dict[str, Any] = {"role": role}
    if content:
        out["content"] = content
    elif parts:
        parts = [dict(p, text=strip(p["text"])) if p["type"] == "text" else p for p in parts]
        has_media = any(p["type"] == "media_marker" for p in parts)
        out["content"] = _join_parts(parts) if has_media else parts
    else:
        out["content"] = ""
    for key, value in (("reasoning_content", reasoning), ("name", m.get("name")),
                       ("tool_call_id", m.get("tool_call_id"))):
        if value:
            out[key] = value
    calls = []
    if not isinstance(m.get("tool_calls") or [], list):
        raise ChatTemplateError("a message's tool_calls must be a list")
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(tc, dict) or tc.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ChatTemplateError(f"unsupported tool call: {tc!r}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = _dump_compact(args)
        call: dict[str, Any] = {"type": "function",
                                "function": {"name": fn["name"], "arguments": args}}
        if tc.get("id"):
            call["id"] = tc["id"]
        calls.append(call)
    if calls:
        out["tool_calls"] = calls
    return out


def parse_tools(tools: list[dict] | None) -> list[dict]:
    """Tools as llama-server re-emits them: name, description and parameters only."""
    out = []
    for tool in tools or []:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict) or "name" not in fn:
            raise ChatTemplateError(f"unsupported tool: {tool!r}")
        out.append({"type": "function", "function": {
            "name": fn["name"], "description": fn.get("description", ""),
            "parameters": fn.get("parameters", {})}})
    return out

def prepare_messages(messages: list[dict], caps: TemplateCaps, source: str,
                     family: str) -> list[dict]:
    """Parsed messages (see parse_message) normalised to what a template with `caps` reads:
    content as a string or as parts, developer as system, a system message folded into the
    next one, tool-call arguments as objects; then `family`'s own rewrites."""
    only_string = caps.supports_string_content and not caps.supports_typed_content
    only_typed = caps.supports_typed_content and not caps.supports_string_content
    out = []
    for m in messages:
        m = dict(m)
        if only_typed and isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        elif only_string and isinstance(m["content"], list):
            m["content"] = _join_parts(m["content"])
        if m["role"] == "developer" and "<|channel|>" not in source:
            m["role"] = "system"
        out.append(m)
    if not caps.supports_system_role and out and out[0]["role"] == "system":
        system = out.pop(0)
        if out:  # folded into the next message, as llama.cpp does
            if not isinstance(system["content"], str) or not isinstance(out[0]["content"], str):
                raise ChatTemplateError("cannot merge a system message made of parts")
            out[0] = dict(out[0], content=system["content"] + "\n" + out[0]["content"])
    if caps.supports_object_arguments:
        for m in out:
            if m.get("tool_calls"):
                m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=_parse_args(
                    c["function"]["arguments"]))) for c in m["tool_calls"]]
    return reshape(family, out)


def _parse_args(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError as e:
        raise ChatTemplateError(f"Failed to parse tool call arguments as JSON: {e}") from None
