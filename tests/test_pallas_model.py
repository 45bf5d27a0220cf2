"""Kernel "pallas" end to end on a tiny random-weight model, Pallas in interpret mode on CPU
(exact, slow; the GPU compiles the same kernels): its weights stay quantized as planes, its
logits are the dequantized weights' within float32 rounding, and an answer's bits never
depend on load (tests/test_invariance.py's checks, run over this kernel)."""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.kernels import describe
from kinetic.model.config import ModelConfigError
from kinetic.model.gguf_file import RawTensor
from kinetic.model.layers import PLANES
from kinetic.model.loader import load_model
from kinetic.model.weights import _Planer, kernel_choice
from tests.test_invariance import (OTHERS, PROMPT, check_never_depends_on_load,
                                   check_row_buckets, engines_over, requests)
from tests.test_model_forward import host_step
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("pallas") / "tiny.gguf", "llama",
                                qtype="Q8_0", context_length=1024, output_scale=2.0))


@pytest.fixture(scope="module")
def setup(path):
    yield from engines_over(load_model(path, kernel="pallas"))


def test_the_weights_stay_quantized_as_planes(path):
    model = load_model(path, kernel="pallas")
    assert kernel_choice("pallas") == "pallas" and model.config.kernel == "pallas"
    q = model.weights["blk"][0]["attn_q"]
    assert q.fmt == PLANES and q.data.q.dtype == np.int8 and q.shape == (64, 64)
    assert model.weights["token_embd"].fmt == PLANES
    assert describe("pallas")["name"] == "pallas" and "backend" in describe("pallas")
    with pytest.raises(ModelConfigError, match="'blk.0.odd'.*no IQ4_NL matmul"):
        _Planer().proj(RawTensor("blk.0.odd", 20, (1, 32), np.zeros(18, np.uint8)))


def test_logits_are_the_dequantized_weights_within_rounding(path):
    """The same step on the pallas kernel and on XLA's float32 dot over the dequantized
    weights (no activation rounding): the same next tokens, logits within float32
    rounding."""
    cfg = RunnerConfig(step_tokens=16, num_slots=1, page_size=16, num_pages=3, pages_per_slot=2)
    ids, pos, table = np.arange(3, 19), np.arange(16), np.array([[1, 2]], np.int32)

    def logits(model):
        return host_step(Runner(model, cfg), ids, pos, np.zeros(16), pos + 16, table)
    got = logits(load_model(path, kernel="pallas"))
    want = logits(load_model(path, kernel="xla", dtype="float32", act_quant=False))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_row_has_the_same_bits_in_every_row_bucket(setup):
    tok, _, model = setup
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:16],
                      (tok.encode(OTHERS[1]) * 2)[:16])


def test_answer_never_depends_on_load(setup):
    """Alone, beside other requests, on one slot, cached and partly cached, with drafts
    and without, chunked otherwise: the same greedy tokens and log-probabilities."""
    tok, engine, model = setup
    check_never_depends_on_load(tok, engine, model, requests(tok)["greedy"], "greedy")
