"""Tool calls in a reply, in the call format of the model's chat template.

    fmt = tool_format(template_source)      # once per template
    stream = fmt.streamer(tools)            # per reply
    send(stream.feed(piece))                # content, as generated; calls are held back
    reply = stream.finish()                 # the rest of the content, and the calls, whole
    fmt.grammar(tools, parallel, think)     # tool_choice "required" or a named function

Which template writes which format (`tool_format`):

    <tool_call> with <function=...> and <parameter=...>   qwen3_xml    Qwen3.5, Qwen3-Coder,
                                                                        Nemotron 3, StepFun 3.5
    [TOOL_CALLS] and [ARGS]                                mistral      Mistral Small 3.2,
                                                                        Devstral, Ministral 3
    [TOOL_CALLS] alone                                     mistral_nemo Mistral Nemo
    <|tool_call_start|>, LFM2's tool list                  lfm2         LFM2, LFM2.5
    <tool_call> with a JSON object                         hermes       Qwen3, Qwen2.5, QwQ,
                                                                        Hermes 2/3, Granite 4, ...
    anything else                                          llama3       Llama 3.x and others
"""

from __future__ import annotations

from kinetic.chat.call_format import ParsedReply, ToolCall, ToolCallStream, ToolFormat
from kinetic.chat.json_calls import Hermes, Lfm2, Llama3, Mistral, MistralNemo
from kinetic.chat.xml_calls import QwenXml

__all__ = ["ParsedReply", "ToolCall", "ToolCallStream", "ToolFormat", "tool_format",
           "FORMATS"]

FORMATS = {f.name: f for f in (QwenXml(), Hermes(), Lfm2(), Mistral(), MistralNemo(), Llama3())}


def tool_format(template_source: str) -> ToolFormat:
    """The call format a chat template uses, detected from its text; Llama 3's bare JSON object
    for templates that write none of the known formats."""
    def has(*needles: str) -> bool:
        return all(n in template_source for n in needles)
    if has("<tool_call>", "<function=", "<parameter="):
        return FORMATS["qwen3_xml"]
    if has("[TOOL_CALLS]"):
        return FORMATS["mistral" if has("[ARGS]") else "mistral_nemo"]
    if has("<|tool_call_start|>") or has("<|tool_list_start|>") or has("List of tools: ["):
        return FORMATS["lfm2"]
    if (has("<tool_call>") and (has('{"name"') or has('{\\"name\\"'))
            and not has("<tool_calls>")):   # Apriel's <tool_calls>[...] is another format
        return FORMATS["hermes"]
    return FORMATS["llama3"]
