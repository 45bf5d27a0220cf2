"""Chat templates: every real template renders, and renders as llama-server does.

tests/data/templates/llama_server_prompts.json holds, for each of the 71 templates and a set of
conversations, the prompt llama.cpp's own chat-template code produced (or the error it raised);
its "about" field says how. The reference conversations of the three real models are checked
against what llama-server itself answered (tests/data/reference/).
"""

from __future__ import annotations

import json
import re
import time
from functools import lru_cache
from pathlib import Path

import pytest

from kinetic.text.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from tests.conftest import real_model_file

DATA = Path(__file__).parent / "data"
TEMPLATES = sorted((DATA / "templates").glob("*.jinja"))
EXPECTED = json.loads((DATA / "templates" / "llama_server_prompts.json").read_text("utf-8"))
SCENARIOS = EXPECTED["scenarios"]


@pytest.fixture(autouse=True)
def frozen_date(monkeypatch):
    """Templates print today's date; pin it to the day the expected prompts were rendered."""
    day = time.strptime(EXPECTED["rendered_on"] + " 12", "%Y-%m-%d %H")
    monkeypatch.setattr(time, "localtime", lambda *args: day)


@lru_cache(maxsize=None)
def template(name: str) -> ChatTemplate:
    source = (DATA / "templates" / name).read_text(encoding="utf-8")
    return ChatTemplate(source, EXPECTED["bos_token"], EXPECTED["eos_token"])


def render(name: str, scenario: str, **extra) -> str:
    case = SCENARIOS[scenario]
    return template(name).render(
        case["messages"], case.get("tools"), case.get("add_generation_prompt", True),
        prefill_assistant=case.get("prefill", True), **case.get("kwargs", {}), **extra)


def expected(name: str, scenario: str):
    return EXPECTED["templates"][name]["prompts"][scenario]


def check_scenario(name: str, scenario: str) -> str | None:
    """Render a scenario; if llama.cpp refused it, assert the same refusal and return None."""
    want = expected(name, scenario)
    if isinstance(want, dict):
        with pytest.raises(ChatTemplateError, match=re.escape(want["error"])):
            render(name, scenario)
        return None
    return render(name, scenario)


ids = [p.name for p in TEMPLATES]


def test_all_71_templates_are_here():
    assert len(TEMPLATES) == 71
    assert set(EXPECTED["templates"]) == set(ids)


# ---- the acceptance scenarios, one test per template file -----------------------------------


@pytest.mark.parametrize("name", ids)
def test_plain_conversation(name):
    """system, user, assistant, user."""
    out = check_scenario(name, "plain")
    assert out is not None
    for message in SCENARIOS["plain"]["messages"]:  # system text too: folded where unsupported
        assert message["content"] in out
    assert out == expected(name, "plain")


@pytest.mark.parametrize("name", ids)
def test_tool_conversation(name):
    """Tools offered, a call with JSON-string arguments, its result, then the model's answer
    (which llama-server continues, as the last message is the assistant's)."""
    out = check_scenario(name, "tools_answer")
    if out is None:
        return  # a template that refuses tool messages (Gemma 2), with llama.cpp's error
    messages = SCENARIOS["tools_answer"]["messages"]
    assert messages[1]["content"] in out  # the user's question
    assert out.endswith(messages[-1]["content"])  # the answer being continued
    if template(name).caps.supports_tool_calls:
        assert "get_weather" in out
        assert "Paris" in out.split(messages[1]["content"], 1)[1]  # the call's arguments
    assert out == expected(name, "tools_answer")


@pytest.mark.parametrize("name", ids)
def test_tools_then_follow_up(name):
    out = check_scenario(name, "tools_follow")
    if out is None:
        return
    assert "Thanks! And tomorrow?" in out
    if template(name).supports_tools:
        assert "get_weather" in out
    assert out == expected(name, "tools_follow")


@pytest.mark.parametrize("name", ids)
def test_thinking_on_and_off(name):
    tmpl = template(name)
    on, off = check_scenario(name, "think_on"), check_scenario(name, "think_off")
    assert on is not None and off is not None
    assert "And of Italy?" in on and "And of Italy?" in off
    assert (on, off) == (expected(name, "think_on"), expected(name, "think_off"))
    if tmpl.supports_thinking:
        # llama-server turns thinking on by default for these
        assert render(name, "plain") == on
    else:
        assert render(name, "plain") == off


@pytest.mark.parametrize("name", ids)
def test_every_scenario_matches_llama_server(name):
    """All recorded conversations (content parts, images, parallel calls, object arguments,
    reasoning in history, continuations, developer role, ...) byte for byte."""
    mismatches = []
    for scenario in SCENARIOS:
        want = expected(name, scenario)
        try:
            got = render(name, scenario)
        except ChatTemplateError as e:
            got = {"error": str(e)}
        if isinstance(want, dict) and isinstance(got, dict):
            if want["error"] not in got["error"]:
                mismatches.append(scenario)
        elif got != want:
            mismatches.append(scenario)
    assert mismatches == []


@pytest.mark.parametrize("name", ids)
def test_capabilities_match_llama_cpp(name):
    tmpl, want = template(name), EXPECTED["templates"][name]
    assert tmpl.supports_thinking == want["supports_thinking"]
    assert {key: getattr(tmpl.caps, key) for key in want["caps"]} == want["caps"]
    assert tmpl.supports_tools == want["caps"]["supports_tools"]


# ---- the three real models against llama-server's own answers -------------------------------

MODELS = ["smollm2", "qwen25coder", "gemma3"]  # kinetic.fetch keys


@pytest.mark.real_model
@pytest.mark.parametrize("key", MODELS)
def test_reference_prompts_from_llama_server(key):
    path = real_model_file(key)
    from kinetic.model.gguf_file import GGUFFile
    tmpl = ChatTemplate.from_metadata(GGUFFile(path).metadata)
    reference = json.loads((DATA / "reference" / f"{key}.json").read_text(encoding="utf-8"))
    assert reference["chat_templates"]
    for case in reference["chat_templates"]:
        got = tmpl.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert got == case["prompt"]
    if key == "gemma3":  # no template in the file: llama-server's ChatML fallback
        assert tmpl.source == CHATML_TEMPLATE


# ---- behaviour llama-server has, on small templates ------------------------------------------

ECHO = ("{% for m in messages %}"
        "[{{ m.role }}:{{ m.content if m.content is string else m.content|tojson }}]"
        "{% endfor %}{% if add_generation_prompt %}[gen]{% endif %}")


def metadata(template_source=None, **extra):
    tokens = ["<unk>", "<s>", "</s>", "▁hi"]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if template_source is not None:
        meta["tokenizer.chat_template"] = template_source
    meta.update(extra)
    return meta


def test_no_template_falls_back_to_chatml():
    tmpl = ChatTemplate.from_metadata(metadata())
    out = tmpl.render([{"role": "user", "content": "Hi"}])
    assert out == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_bos_token_is_left_to_the_tokenizer():
    source = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"
    msgs = [{"role": "user", "content": "Hi"}]
    # SentencePiece vocabularies add BOS when tokenizing, so llama-server drops it from the text
    assert ChatTemplate.from_metadata(metadata(source)).render(msgs) == "Hi</s>"
    kept = ChatTemplate.from_metadata(metadata(source, **{"tokenizer.ggml.add_bos_token": False}))
    assert kept.render(msgs) == "<s>Hi</s>"
    no_eos = ChatTemplate.from_metadata(metadata(source, **{"tokenizer.ggml.add_eos_token": True}))
    assert no_eos.render(msgs) == "Hi"


def test_content_parts_are_joined_for_string_templates():
    tmpl = ChatTemplate(ECHO)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert tmpl.render([{"role": "user", "content": parts}]) == "[user:one\ntwo][gen]"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    out = tmpl.render([{"role": "user", "content": [parts[0], image, parts[1]]}])
    assert out == "[user:one<__media__>two][gen]"  # no newline around the media marker


def test_typed_content_templates_get_parts():
    source = ("{% for m in messages %}{% for p in m.content %}<{{ p.type }}:{{ p.text }}>"
              "{% endfor %}{% endfor %}")
    tmpl = ChatTemplate(source)
    assert tmpl.caps.supports_typed_content and not tmpl.caps.supports_string_content
    assert tmpl.render([{"role": "user", "content": "plain"}]) == "<text:plain>"


def test_tool_call_arguments_parsed_when_the_template_reads_them():
    reads = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                         "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }}{% endfor %}"
                         "{% endfor %}{% endfor %}")
    as_text = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                           "{{ c.function.arguments }}{% endfor %}{% endfor %}")
    assert reads.caps.supports_object_arguments and not as_text.caps.supports_object_arguments
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "f", "arguments": '{"city": "Oslo"}'}}]}
    msgs = [{"role": "user", "content": "?"}, call, {"role": "user", "content": "ok"}]
    assert reads.render(msgs) == "city=Oslo"
    assert as_text.render(msgs) == '{"city": "Oslo"}'
    objects = [msgs[0], dict(call, tool_calls=[{"type": "function", "function": {
        "name": "f", "arguments": {"city": "Oslo", "n": 1}}}]), msgs[2]]
    assert as_text.render(objects) == '{"city":"Oslo","n":1}'  # as llama.cpp re-serialises it
    broken = {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
    bad = [msgs[0], dict(call, tool_calls=[broken]), msgs[2]]
    with pytest.raises(ChatTemplateError, match="Failed to parse tool call arguments"):
        reads.render(bad)


def test_system_message_folded_when_the_template_ignores_it():
    source = ("{% for m in messages %}{% if m.role != 'system' %}({{ m.role }}){{ m.content }}"
              "{% endif %}{% endfor %}")
    tmpl = ChatTemplate(source)
    assert not tmpl.caps.supports_system_role
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tmpl.render(msgs) == "(user)Be brief.\nHi"


def test_developer_role_becomes_system():
    msgs = [{"role": "developer", "content": "rules"}, {"role": "user", "content": "x"}]
    out = ChatTemplate(ECHO).render(msgs)
    assert out == "[system:rules][user:x][gen]"


def test_final_assistant_message_is_continued():
    tmpl = ChatTemplate.from_metadata(metadata())  # ChatML
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
    assert tmpl.render(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, I"
    closed = tmpl.render(msgs, prefill_assistant=False, add_generation_prompt=False)
    assert closed.endswith("<|im_start|>assistant\nHello, I<|im_end|>\n")
    with pytest.raises(ChatTemplateError, match="2 or more assistant messages"):
        tmpl.render(msgs + [{"role": "assistant", "content": "more"}])
    with pytest.raises(ChatTemplateError, match="contains tool calls"):
        tmpl.render(msgs[:1] + [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}])


def test_chat_template_kwargs_reach_the_template():
    source = "{{ enable_thinking }}|{{ custom }}|{{ reasoning_effort }}"
    tmpl = ChatTemplate(source)
    msgs = [{"role": "user", "content": "x"}]
    out = tmpl.render(msgs, enable_thinking=True, custom=[1, 2], reasoning_effort="low")
    assert out == "True|[1, 2]|low"
    with pytest.raises(ChatTemplateError, match="enable_thinking"):
        tmpl.render(msgs, enable_thinking="yes")


def test_globals_filters_and_string_methods():
    source = ("{{ strftime_now('%Y') }}|{{ date_string }}|{{ {'b': '<é>', 'a': [1]} | tojson }}|"
              "{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}|"
              "{{ [1, 2] | tojson(separators=(',', ':')) }}|"
              "{{ ' x,y '.strip().split(',') | join('+') }}|{{ 'abc'.startswith('a') }}|"
              "{% set ns = namespace(n=0) %}{% for k, v in {'p': 1, 'q': 2}.items() %}"
              "{% set ns.n = ns.n + v %}{% if loop.last %}{{ ns.n }}{% endif %}{% endfor %}|"
              "{% for i in range(3) %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}")
    out = ChatTemplate(source).render([{"role": "user", "content": "x"}])
    assert out.split("|") == [EXPECTED["rendered_on"][:4], "30 Nov 2026", '{"b": "<é>", "a": [1]}',
                              '{\n  "a": 2,\n  "b": 1\n}', "[1,2]", "x+y", "True", "3", "02"]


def test_raise_exception_gives_its_message():
    tmpl = ChatTemplate("{% if messages[0].role != 'user' %}"
                        "{{ raise_exception('Only user turns, please') }}{% endif %}ok")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="^Only user turns, please$"):
        tmpl.render([{"role": "system", "content": "x"}])


def test_real_template_refusal_is_its_own_message():
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        render("google-gemma-2-2b-it.jinja", "tools_follow")


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error on line 3"):
        ChatTemplate("{% for m in messages %}\n{{ m.content }}\n{% endfor %}{% endif %}")


def test_runtime_error_names_the_line():
    tmpl = ChatTemplate("line one\n{{ messages[0].content }}\n{{ 1 + messages[0].missing }}")
    with pytest.raises(ChatTemplateError, match="on line 3"):
        tmpl.render([{"role": "user", "content": "x"}])


def test_undefined_is_lenient_like_llama_cpp():
    tmpl = ChatTemplate("{{ nothing.deeper.still }}{{ 'a' + nothing }}"
                        "{{ 'b' + messages[0].absent }}")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "ab"


# ---- the sandbox --------------------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ namespace.__init__.__globals__['os'] }}",
    "{{ (1).__class__.__base__ }}",
])
def test_sandbox_blocks_python_internals(source):
    with pytest.raises(ChatTemplateError, match="forbidden operation"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("source", [
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
    "{{ messages.pop() }}",
    "{{ messages.clear() }}",
    "{% set m = messages[0] %}{{ m.update({'content': 'changed'}) }}",
    "{{ messages[0].pop('content') }}",
    "{{ tools.append(1) }}",
])
def test_sandbox_blocks_mutating_the_input(source):
    messages = [{"role": "user", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    with pytest.raises(ChatTemplateError, match="forbidden operation"):
        ChatTemplate(source).render(messages, tools)
    assert messages == [{"role": "user", "content": "x"}]
    assert tools == [{"type": "function", "function": {"name": "f"}}]


def test_template_made_lists_take_append_and_pop_as_in_llama_cpp():
    source = ("{% set q = [] %}{% set _ = q.append('a') %}{% set _ = q.append('b') %}"
              "{{ q.pop(0) }}{{ q | length }}")
    assert ChatTemplate(source).render([{"role": "user", "content": "x"}]) == "a1"
