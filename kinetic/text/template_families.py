"""Model families that llama.cpp's chat code handles apart from its generic template path.

llama.cpp recognises some templates by the text in them (gpt-oss's channels, Ministral's
[TOOL_CALLS], DeepSeek V4's DSML, Gemma 4's tool-call syntax, ...) and gives each family its own
handler: a source patch or two at load, messages reshaped before rendering, the prompt touched
up after it, fixed strings for continuing an assistant turn, and thinking declared on. This
module holds those differences; `ChatTemplate` applies them.
"""

from __future__ import annotations

import json
from typing import Any

# Conditions in two real templates that raise on conversations llama-server accepts; llama.cpp
# replaces them with `if false`, and so do we. (marker, trigger, condition)
_SOURCE_PATCHES = [
    ("<|channel|>", "in message.content or",
     "{%- if \"<|channel|>analysis<|message|>\" in message.content or "
     "\"<|channel|>final<|message|>\" in message.content %}"),
    ("[TOOL_CALLS]", "if (message['content'] is none or",
     "{%- if (message['content'] is none or message['content'] == '' or "
     "message['content']|length == 0) and (message['tool_calls'] is not defined or "
     "message['tool_calls'] is none or message['tool_calls']|length == 0) %}"),
]


def patch_source(source: str) -> str:
    """`source` with those conditions replaced by `if false`, as llama.cpp loads it."""
    for marker, trigger, condition in _SOURCE_PATCHES:
        if marker in source and trigger in source:
            source = source.replace(condition, "{%- if false %}")
    return source


def template_family(src: str) -> str:
    """Which of llama.cpp's dedicated handlers takes this template ("" for its generic one);
    the first match wins, in llama.cpp's order."""
    def has(*needles: str) -> bool:
        return all(n in src for n in needles)
    rules = [
        ("ministral", has("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]") and "[CALL_ID]" not in src),
        ("llm_jp", has("chat_format=llm-jp-harmony-v1")),
        ("gpt_oss", has("<|channel|>")),
        ("muse", has("<atem:function_calls>", "<|eom|>")),
        ("functionary", has(">>>all", ">>>${recipient}")),
        ("kimi_k2", has("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
        ("kimi_k3", has("<|open|>", "<|close|>", "<|end_of_msg|>")),
        ("ling3", has("<role>ASSISTANT</role>", "<arg_key>")),
        ("cohere2moe", has("<|START_TEXT|>", "<|START_ACTION|>")),
        ("lfm2", has("<|tool_list_start|>", "<|tool_list_end|>") or has("List of tools: [")),
        ("gigachat", has("<|role_sep|>", "<|message_sep|>") and "<|function_call|>" not in src),
        ("minimax_m3", has("]<]minimax[>[", "<tool_call>", "<invoke name=")),
        ("deepseek_v4" if "function_calls" not in src else "deepseek_v3_2",
         has("dsml_token", "DSML") and ("function_calls" in src or "tool_calls" in src)),
        ("gemma4" if "{#- OpenAI Chat Completions:" in src else "gemma4_old",
         has("'<|tool_call>call:'")),
        ("minicpm5", has("Tool usage guidelines:", '<function name="', '<param name="')),
        ("qwen3_coder", has("<tool_call>", "<function=", "<parameter=")
         and "'<tool_call><function=' ~ tool_call.name ~ '>'" not in src),
    ]
    return next((name for name, hit in rules if hit), "")


# How llama.cpp's dedicated handlers open a continued assistant turn (then the reasoning), and
# what they put between the reasoning and the content.
FAMILY_TURNS = {
    "qwen3_coder": "<|im_start|>assistant\n", "gigachat": "assistant<|role_sep|>\n",
    "functionary": "<|start_header_id|>assistant<|end_header_id|>\n\n>>>all\n",
    "cohere2moe": "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|><|START_THINKING|>",
    "kimi_k2": "<|im_assistant|>assistant<|im_middle|><think>",
    "kimi_k3": '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>',
    "minimax_m3": "<mm:think>", "deepseek_v3_2": "<｜Assistant｜><think>",
    "deepseek_v4": "<｜Assistant｜><think>", "gemma4": "<|channel>thought\n",
    "gemma4_old": "<|channel>thought\n", "ling3": "<role>ASSISTANT</role>\n<think>",
    "gpt_oss": "<|start|>assistant<|channel|>analysis<|message|>",
    "llm_jp": "<|start|>assistant<|channel|>analysis<|message|>", "ministral": "[THINK]",
    "muse": "<|start|>assistant to=self<|message|>", "minicpm5": "<|im_start|>assistant\n<think>\n",
    "lfm2": "<|im_start|>assistant\n<think>"}
FAMILY_MIDDLES = {
    "cohere2moe": "<|END_THINKING|><|START_TEXT|>", "kimi_k2": "</think>",
    "kimi_k3": "<|close|>think<|sep|><|open|>response<|sep|>", "minimax_m3": "</mm:think>",
    "deepseek_v3_2": "</think>", "deepseek_v4": "</think>", "gemma4": "<channel|>",
    "gemma4_old": "<channel|>", "ling3": "</think>",
    "gpt_oss": "<|end|><|start|>assistant<|channel|>final<|message|>",
    "llm_jp": "<|end|><|start|>assistant<|channel|>final<|message|>", "ministral": "[/THINK]",
    "muse": "<|eom|><|start|>assistant to=user<|message|>", "minicpm5": "\n</think>\n\n",
    "lfm2": "</think>"}


# the dedicated handlers that declare thinking support whatever the template says
THINKING_FAMILIES = {"ministral", "llm_jp", "gpt_oss", "muse", "kimi_k2", "kimi_k3", "ling3",
                      "cohere2moe", "lfm2", "minimax_m3", "deepseek_v4", "deepseek_v3_2", "gemma4",
                      "gemma4_old", "minicpm5"}


def reshape(family: str, messages: list[dict]) -> list[dict]:
    """The message rewrites of llama.cpp's dedicated handlers."""
    out = []
    for m in messages:
        m = dict(m)
        reasoning = m.get("reasoning_content")
        if family == "ministral" and m["role"] in ("system", "assistant"):
            blocks = []
            if isinstance(reasoning, str):
                blocks.append({"type": "thinking", "thinking": reasoning})
            content = m.get("content")
            if isinstance(content, str):
                blocks.append({"type": "text", "text": content})
            else:
                blocks += list(content or [])
            m["content"] = blocks
            m.pop("reasoning_content", None)
        elif family in ("llm_jp", "gpt_oss", "lfm2") and isinstance(reasoning, str):
            m["thinking"] = reasoning
            if family != "lfm2" and m.get("tool_calls"):
                m.pop("content", None)
        out.append(m)
    if family == "deepseek_v4":
        return _sort_tool_results(out)
    if family == "gemma4_old":
        return _gemma4_tool_responses(out)
    return out


def _sort_tool_results(messages: list[dict]) -> list[dict]:
    """DeepSeek V4 lists a run of tool results in the order of the calls they answer."""
    order: dict[str, int] = {}
    i = 0
    while i < len(messages):
        role = messages[i]["role"]
        if role == "assistant" and messages[i].get("tool_calls"):
            order = {c["id"]: n for n, c in enumerate(messages[i]["tool_calls"]) if c.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        while end < len(messages) and messages[end]["role"] in ("user", "tool"):
            end += 1
        slots = [k for k in range(i, end) if messages[k]["role"] == "tool"]
        if len(slots) > 1 and order:
            ranked = sorted((messages[k] for k in slots),
                            key=lambda m: order.get(m.get("tool_call_id", ""), 0))
            for k, m in zip(slots, ranked):
                messages[k] = m
        i = end
    return messages


def _gemma4_tool_responses(messages: list[dict]) -> list[dict]:
    """Older Gemma 4 templates want tool results inside the assistant turn that called them."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m["role"] != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        i += 1
        while i < len(messages) and messages[i]["role"] == "tool":
            result = messages[i].get("content")
            if isinstance(result, str):
                try:
                    result = json.loads(result)
                except ValueError:
                    pass
            name = calls[len(responses)]["function"]["name"] if len(responses) < len(calls) else ""
            name = name or messages[i].get("tool_call_id", "")
            responses.append({"name": name, "response": result})
            i += 1
        turn: dict[str, Any] = {"role": "assistant", "tool_calls": calls}
        if responses:
            turn["tool_responses"] = responses
        after = messages[i] if i < len(messages) else {}
        answer = after.get("role") == "assistant" and not after.get("tool_calls")
        if answer and after.get("content"):
            turn["content"] = messages[i]["content"]
            i += 1
        if isinstance(m.get("reasoning_content"), str):
            turn["reasoning_content"] = m["reasoning_content"]
        out.append(turn)
    return out


def adjust_prompt(family: str, prompt: str, add_generation_prompt: bool) -> str:
    """The rendered prompt as llama.cpp's dedicated handler leaves it."""
    if family in ("gpt_oss", "llm_jp") and not add_generation_prompt and "<|return|>" in prompt:
        head, _, tail = prompt.rpartition("<|return|>")
        prompt = head + "<|end|>" + tail  # gpt-oss ends a past final answer with <|end|>
    if family.startswith("gemma4") and add_generation_prompt and prompt.endswith("<turn|>\n"):
        prompt += "<|turn>model\n"  # Gemma 4 omits it after a tool response; llama.cpp adds it
    return prompt
