"""What a chat reply holds besides its text: reasoning and tool calls.

A reply is generated as plain text. `reasoning.ReasoningSplitter` first takes the thinking
(<think>...</think>) off the front; what remains goes through the `ToolCallStream` of the
template's call format (`tool_calls.tool_format`), which sends the text before any call as it
comes and the calls whole at the end. When the request forces a call, the same format's
`grammar()` holds the generation to calls of the allowed tools, so what it generates parses.
"""

from kinetic.chat.reasoning import (ReasoningSplitter, prompt_opens_thinking,
                                    template_knows_thinking)
from kinetic.chat.tool_calls import ParsedReply, ToolCall, ToolCallStream, ToolFormat, tool_format

__all__ = ["ParsedReply", "ReasoningSplitter", "ToolCall", "ToolCallStream", "ToolFormat",
           "prompt_opens_thinking", "template_knows_thinking", "tool_format"]
