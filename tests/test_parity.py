"""Parity with llama.cpp on the three real models (tests/data/reference/, docs/parity.md).

llama.cpp's CPU dot products round activations to 8 bits and its KV cache is f16, so the
distributions are compared with tolerances; the thresholds sit just under the figures
measured with scripts/parity.py, so that a regression fails here.
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

# The figures measured with scripts/parity.py (docs/parity.md) minus a small margin: top-1
# agreement per position, and the share of prompts whose first 16 greedy tokens equal
# llama.cpp's. The targets (0.98 and 0.8) are not all reached; docs/parity.md says
# where and why.
MIN_TOP1 = {"smollm2": 0.96, "gemma3": 0.97, "qwen25coder": 0.98}
MIN_GREEDY16 = {"smollm2": 0.4, "gemma3": 0.8, "qwen25coder": 0.7}


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
