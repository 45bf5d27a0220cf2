"""`--chat-template NAME`: kinetic's Jinja writing of llama-server's named chat formats gives
the prompt llama-server's /apply-template gave for the same conversations (recorded from
llama-server 11434.0.0 with --chat-template NAME)."""

from __future__ import annotations

import pytest

from kinetic.text.builtin_templates import BUILTIN
from kinetic.text.chat_template import ChatTemplate

LONG = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Who are you?"}]
SHORT = [{"role": "user", "content": "Hi"}]

LLAMA_SERVER = {
    "chatml": ("<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
               "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nWho are you?"
               "<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    "llama3": ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
               "<|start_header_id|>user<|end_header_id|>\n\nWho are you?<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n",
               "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
               "<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "command-r": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Be brief.<|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hello!<|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you?<|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
                  "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"
                  "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "gemma": ("<start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n<start_of_turn>model\n"
              "Hello!<end_of_turn>\n<start_of_turn>user\nWho are you?<end_of_turn>\n"
              "<start_of_turn>model\n",
              "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"),
    "phi3": ("<|system|>\n Be brief. <|end|>\n<|user|>\nHi there<|end|>\n<|assistant|>\nHello!"
             "<|end|>\n<|user|>\nWho are you?<|end|>\n<|assistant|>\n",
             "<|user|>\nHi<|end|>\n<|assistant|>\n"),
    "zephyr": ("<|system|>\n Be brief. <|endoftext|>\n<|user|>\nHi there<|endoftext|>\n"
               "<|assistant|>\nHello!<|endoftext|>\n<|user|>\nWho are you?<|endoftext|>\n"
               "<|assistant|>\n",
               "<|user|>\nHi<|endoftext|>\n<|assistant|>\n"),
    "mistral-v7": ("[SYSTEM_PROMPT]  Be brief. [/SYSTEM_PROMPT][INST] Hi there[/INST] Hello!</s>"
                   "[INST] Who are you?[/INST]",
                   "[INST] Hi[/INST]"),
    "vicuna": (" Be brief. \n\nUSER: Hi there\nASSISTANT: Hello!</s>\nUSER: Who are you?\n"
               "ASSISTANT:",
               "USER: Hi\nASSISTANT:"),
    "llama2": ("[INST]  Be brief. \nHi there [/INST]Hello!</s>[INST] Who are you? [/INST]",
               "[INST] Hi [/INST]"),
    "deepseek3": (" Be brief. \n\n<｜User｜>Hi there<｜Assistant｜>Hello!<｜end▁of▁sentence｜>"
                  "<｜User｜>Who are you?<｜Assistant｜>",
                  "<｜User｜>Hi<｜Assistant｜>"),
    "phi4": ("<|im_start|>system<|im_sep|> Be brief. <|im_end|><|im_start|>user<|im_sep|>"
             "Hi there<|im_end|><|im_start|>assistant<|im_sep|>Hello!<|im_end|>"
             "<|im_start|>user<|im_sep|>Who are you?<|im_end|><|im_start|>assistant<|im_sep|>",
             "<|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>"),
}


@pytest.mark.parametrize("name", sorted(LLAMA_SERVER))
def test_named_formats_render_as_llama_server_renders_them(name):
    template = ChatTemplate(BUILTIN.get(name, name))
    long, short = LLAMA_SERVER[name]
    assert template.render(LONG) == long
    assert template.render(SHORT) == short


def test_every_name_is_checked():
    assert set(BUILTIN) | {"chatml"} == set(LLAMA_SERVER)
