"""Parity with llama.cpp on the three real models (tests/data/reference/, docs/parity.md).

llama.cpp's CPU dot products round activations to 8 bits and its KV cache is f16, so the
distributions are compared with tolerances; the thresholds sit under the lowest figures
measured with scripts/parity.py on every CPU kind, so that a regression fails here and a
different CPU does not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import loaded_real_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from parity import REFERENCE, measure  # noqa: E402

pytestmark = pytest.mark.real_model

# Regression floors, set under the lowest figure measured on each CPU kind CI runs on
# (docs/parity.md lists both): XLA's CPU dot rounds differently on AMD Zen (AVX2) and on
# Intel Xeon (AVX-512), so near-ties between llama.cpp's top two tokens flip with the CPU.
# Top-1 agreement (about 220 positions) keeps a margin of three positions under the lowest
# figure, greedy continuations (10 prompts) one prompt. The exact checks above them and the
# KL bound do not depend on the CPU. The targets (0.98 and 0.8) stay in
# docs/parity.md until the quantized kernel makes the arithmetic llama.cpp's.
MIN_TOP1 = {"smollm2": 0.955, "gemma3": 0.95, "qwen25coder": 0.975}
MIN_GREEDY16 = {"smollm2": 0.4, "gemma3": 0.6, "qwen25coder": 0.7}

@pytest.mark.parametrize("key", ["smollm2", "gemma3", "qwen25coder"])
def test_parity_with_llama_cpp(key):
    ref = json.loads((REFERENCE / f"{key}.json").read_text())
    figures = measure(loaded_real_model(key), ref)
    print(key, figures)
    n_tok, n_chat = len(ref["tokenize"]), len(ref["chat_templates"])
    assert figures["tokenize"] == f"{n_tok}/{n_tok}"
    assert figures["chat_prompts"] == f"{n_chat}/{n_chat}"
    n = len(ref["continuations"])
    assert figures["prompt_ids"] == f"{n}/{n}"
    assert figures["mean_kl"] <= 0.02
    assert figures["top1"] >= MIN_TOP1[key]
    assert figures["greedy16"] >= MIN_GREEDY16[key]
