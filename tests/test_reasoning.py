"""The reasoning splitter: finished replies as a table, and the same replies streamed split at
every position and in random pieces, which must give the same reasoning and content."""

from __future__ import annotations

import random

import pytest

from kinetic.chat.reasoning import (ReasoningSplitter, prompt_opens_thinking,
                                    template_knows_thinking)

# (started_open, reply, reasoning, content)
TABLE = [
    (True, "Let me think.\nParis.\n</think>\n\nThe capital is Paris.", "Let me think.\nParis.",
     "The capital is Paris."),
    (True, "</think>\n\nHi!", "", "Hi!"),
    (True, "\n\n</think>\n\nHi!\n", "", "Hi!\n"),
    (True, "still thinking, cut off by max_tokens", "still thinking, cut off by max_tokens", ""),
    (True, "almost done </thi", "almost done </thi", ""),
    (True, "a < b and </ b> is not the tag</think>ok", "a < b and </ b> is not the tag", "ok"),
    (True, "x</think>  \n", "x", ""),
    (False, "<think>\nHmm, 2+2.\n</think>\n\n4", "Hmm, 2+2.", "4"),
    (False, "\n<think>é 日本</think>答え", "é 日本", "答え"),
    (False, "No thinking here.", "", "No thinking here."),
    (False, "  leading space kept", "", "  leading space kept"),
    (False, "Text then <think>not reasoning</think>", "",
     "Text then <think>not reasoning</think>"),
    (False, "<think>never closed", "never closed", ""),
    (False, "<thi", "", "<thi"),
    (False, "<think></think>", "", ""),
    (False, "<think>a</think>b</think>c", "a", "b</think>c"),
    (False, "", "", ""),
]


def run(started_open: bool, pieces: list[str]) -> tuple[list[tuple[str, str]], tuple[str, str]]:
    s = ReasoningSplitter(started_open)
    return [s.feed(p) for p in pieces], s.finish()


def joined(started_open, pieces):
    fed, (r_end, c_end) = run(started_open, pieces)
    return "".join(r for r, _ in fed) + r_end, "".join(c for _, c in fed) + c_end


@pytest.mark.parametrize("started_open,reply,reasoning,content", TABLE)
def test_finished(started_open, reply, reasoning, content):
    assert joined(started_open, [reply]) == (reasoning, content)


@pytest.mark.parametrize("started_open,reply,reasoning,content", TABLE)
def test_streamed_at_every_split(started_open, reply, reasoning, content):
    for i in range(len(reply) + 1):
        assert joined(started_open, [reply[:i], reply[i:]]) == (reasoning, content), i
    assert joined(started_open, list(reply)) == (reasoning, content)
    rng = random.Random(len(reply))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(reply) + 1), min(4, len(reply) + 1)))
        pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
        assert joined(started_open, pieces) == (reasoning, content), pieces


def test_streaming_sends_early():
    """Reasoning and content flow as written; only a partial tag and whitespace wait."""
    fed, _ = run(True, ["Let me", " think", ".\n</th", "ink>\n\nThe", " answer"])
    assert fed == [("Let me", ""), (" think", ""), (".", ""), ("", "The"), ("", " answer")]
    fed, _ = run(False, ["<", "think>", "a", "</think>", "b"])
    assert fed == [("", ""), ("", ""), ("a", ""), ("", ""), ("", "b")]
    fed, _ = run(False, ["Hello", " <think>"])
    assert fed == [("", "Hello"), ("", " <think>")]


@pytest.mark.parametrize("prompt,opens", [
    ("<|im_start|>assistant\n<think>\n", True),
    ("<|im_start|>assistant\n<think>", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
    ("<|im_start|>assistant\n", False),
    ("<|im_start|>user\nwhat is <think>?<|im_end|>\n<|im_start|>assistant\n", False),
])
def test_prompt_opens_thinking(prompt, opens):
    assert prompt_opens_thinking(prompt) is opens


@pytest.mark.parametrize("template,knows", [
    ("Qwen3.5-4B.jinja", True), ("Qwen-Qwen3-0.6B.jinja", True), ("LFM2.5-8B-A1B.jinja", True),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", False),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", False),
])
def test_template_knows_thinking(template, knows):
    with open(f"/work/shared/templates/{template}") as f:
        assert template_knows_thinking(f.read()) is knows
