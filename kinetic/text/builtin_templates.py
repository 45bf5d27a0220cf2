"""Chat formats by name, for `--chat-template NAME` as llama-server takes it.

llama-server knows several chat formats by name and writes them in C++; kinetic writes each
one here as a Jinja template of its own (run by the same sandboxed engine as a model's
template), checked against what llama-server's /apply-template answers for the same
conversation (tests/test_builtin_templates.py). "chatml" is kinetic's fallback template
itself (text/chat_template.py). Names not here are refused with the list of these.
"""

from __future__ import annotations

def _turns(open_: str, close: str, gen: str, trim: bool) -> str:
    content = "{{ m.content | trim }}" if trim else "{{ m.content }}"
    return ("{% for m in messages %}" + open_ + content + close + "{% endfor %}"
            "{% if add_generation_prompt %}" + gen + "{% endif %}")


BUILTIN: dict[str, str] = {
    "llama3": _turns("<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n", "<|eot_id|>",
                     "<|start_header_id|>assistant<|end_header_id|>\n\n", trim=True),
    "command-r": (
        "{% set token = {'system': '<|SYSTEM_TOKEN|>', 'user': '<|USER_TOKEN|>', "
        "'assistant': '<|CHATBOT_TOKEN|>'} %}"
        + _turns("<|START_OF_TURN_TOKEN|>{{ token[m.role] }}", "<|END_OF_TURN_TOKEN|>",
                 "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", trim=True)),
    # Gemma has no system turn: the system text opens the next turn
    "gemma": (
        "{% set ns = namespace(system='') %}"
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{% set ns.system = ns.system + (m.content | trim) + "
        "'\n\n' %}"
        "{% else %}<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
        "{{ ns.system }}{{ m.content | trim }}<end_of_turn>\n{% set ns.system = '' %}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"),
    "phi3": _turns("<|{{ m.role }}|>\n", "<|end|>\n", "<|assistant|>\n", trim=False),
    "phi4": _turns("<|im_start|>{{ m.role }}<|im_sep|>", "<|im_end|>",
                   "<|im_start|>assistant<|im_sep|>", trim=False),
    "zephyr": _turns("<|{{ m.role }}|>\n", "<|endoftext|>\n", "<|assistant|>\n", trim=False),
    "mistral-v7": (
        "{% for m in messages %}"
        "{% if m.role == 'system' %}[SYSTEM_PROMPT] {{ m.content }}[/SYSTEM_PROMPT]"
        "{% elif m.role == 'user' %}[INST] {{ m.content }}[/INST]"
        "{% else %} {{ m.content }}</s>{% endif %}{% endfor %}"),
    "vicuna": (
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{{ m.content }}\n\n"
        "{% elif m.role == 'user' %}USER: {{ m.content }}\n"
        "{% else %}ASSISTANT: {{ m.content }}</s>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}ASSISTANT:{% endif %}"),
    # the system text opens the first [INST] block, on a line of its own
    "llama2": (
        "{% set ns = namespace(open=false) %}"
        "{% for m in messages %}"
        "{% if m.role == 'system' %}[INST] {{ m.content }}\n{% set ns.open = true %}"
        "{% elif m.role == 'user' %}{% if not ns.open %}[INST] {% endif %}"
        "{{ m.content }} [/INST]{% set ns.open = false %}"
        "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"),
    "deepseek3": (
        "{% for m in messages %}"
        "{% if m.role == 'system' %}{{ m.content }}\n\n"
        "{% elif m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% else %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
}
