"""Embeddings answers write their float32 vectors through kinetic.kernels.json_floats (C++)
and core.JSONText: the text must be what json.dumps writes for the same values, character
for character, and only a JSONText may be copied into an answer as it is."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kinetic import kernels
from kinetic.api.core import JSONText, dumps

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernel is not built")


def reference(v: np.ndarray) -> str:
    return json.dumps(np.asarray(v, np.float32).tolist(), separators=(",", ":"))


def test_every_kind_of_float32_is_written_as_json_dumps_writes_it():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64).astype(np.uint32)
    anything = bits.view(np.float32)
    anything = anything[np.isfinite(anything)]   # every exponent, subnormals included
    edges = np.array([0.0, -0.0, 1.0, -1.0, 0.1, 1e-4, 9.999e-5, 1e-5, 1e15, 1e16, 1.5e16,
                      123456.0, 65504.0, 3.4028235e38, -3.4028235e38, 1.4e-45, 1.17549435e-38,
                      2.0 ** 24, 2.0 ** 24 + 2], np.float32)
    unit = rng.standard_normal(384).astype(np.float32)
    unit /= np.linalg.norm(unit)   # what an embeddings answer holds
    for v in (anything, edges, unit, unit * np.float32(1e-3), np.zeros(0, np.float32)):
        assert kernels.json_floats(v) == reference(v)


def test_a_value_that_json_cannot_hold_leaves_the_writing_to_json_dumps():
    for bad in (np.nan, np.inf, -np.inf):
        assert kernels.json_floats(np.array([0.5, bad], np.float32)) is None


def test_dumps_copies_json_text_in_place_and_nothing_else():
    v = np.array([0.25, -1e-7, 3.0], np.float32)
    answer = {"data": [{"embedding": JSONText(kernels.json_floats(v)), "index": 0},
                       {"embedding": [JSONText(kernels.json_floats(v[:1]))], "index": 1}],
              "model": "m \x00 \u00e9"}
    want = {"data": [{"embedding": v.tolist(), "index": 0},
                     {"embedding": [v[:1].tolist()], "index": 1}], "model": "m \x00 \u00e9"}
    assert dumps(answer) == json.dumps(want, ensure_ascii=False, separators=(",", ":"))
    # a string that looks like a stand-in stays a string
    text = dumps({"a": JSONText("[1.0]"), "b": "\x00" + "0" * 16 + ":0"})
    assert json.loads(text) == {"a": [1.0], "b": "\x00" + "0" * 16 + ":0"}
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        dumps({"a": {1}})
