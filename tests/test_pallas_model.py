"""Kernel "pallas" end to end on a tiny random-weight model, Pallas in interpret mode on CPU
(exact, slow; the GPU compiles the same kernels): its weights stay quantized as planes, its
logits are the dequantized weights' (activations rounded as llama.cpp's q8_0) within
float32 rounding, and an answer's bits never
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
    weights, its activations rounded as llama.cpp's q8_0 rounds them (act_quant: the
    pallas kernel's integer dots see the same values): the same next tokens, logits
    within float32 rounding."""
    cfg = RunnerConfig(step_tokens=16, num_slots=1, page_size=16, num_pages=3, pages_per_slot=2)
    ids, pos, table = np.arange(3, 19), np.arange(16), np.array([[1, 2]], np.int32)

    def logits(model):
        return host_step(Runner(model, cfg), ids, pos, np.zeros(16), pos + 16, table)
    got = logits(load_model(path, kernel="pallas"))
    want = logits(load_model(path, kernel="xla", dtype="float32", act_quant=True))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_row_has_the_same_bits_in_every_row_bucket(setup):
    tok, _, model = setup
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:16],
                      (tok.encode(OTHERS[1]) * 2)[:16])


FAMILIES = ["mistral3", "qwen2", "qwen3", "gemma3", "lfm2", "qwen35", "qwen3moe", "lfm2moe",
            "qwen35moe"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_family_has_a_rows_bits_in_every_row_bucket(arch, tmp_path):
    """The other families' tiny models on the pallas kernel (llama's is above): dense,
    sliding-window and soft-capped, mixture-of-experts (experts' planes), short-convolution
    and Gated DeltaNet layers; 6 prompt tokens alone, 3 and 6 to a step and beside another
    sequence, cached and uncached, the same bits."""
    from kinetic.text.tokenizer import Tokenizer
    model = load_model(str(write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype="Q8_0",
                                            context_length=256)), kernel="pallas")
    assert model.config.kernel == "pallas"
    tok = Tokenizer.from_metadata(model.file.metadata)
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:6],
                      (tok.encode(OTHERS[1]) * 2)[:6], step=8)


def test_answer_never_depends_on_load(setup):
    """Alone, beside other requests, on one slot, cached and partly cached, with drafts
    and without, chunked otherwise: the same greedy tokens and log-probabilities."""
    tok, engine, model = setup
    check_never_depends_on_load(tok, engine, model, requests(tok)["greedy"], "greedy")


@pytest.mark.real_model
def test_parity_with_the_ffi_kernel_on_smollm2():
    """SmolLM2-135M (Q4_1) on the pallas kernel against the ffi kernel, one 16-row step per
    prompt: the float order differs (and the ffi kernel rounds activations as llama.cpp
    does), so within tolerance: top-1 agreement at least 0.95, mean KL at most 0.02 (measured
    on an AMD EPYC: 1.0 and 0.0042 over the 29 positions)."""
    from kinetic.text.tokenizer import Tokenizer
    from tests.conftest import real_model_file
    path = real_model_file("smollm2")
    pallas, ffi = load_model(path, kernel="pallas"), load_model(path, kernel="ffi")
    tok = Tokenizer.from_metadata(ffi.file.metadata)
    cfg = RunnerConfig(step_tokens=16, num_slots=1, page_size=16, num_pages=3, pages_per_slot=2)
    table = np.array([[1, 2]], np.int32)
    agree, kl = [], []
    for prompt in ("The capital of France is Paris, and the capital of Italy is",
                   "def fibonacci(n):\n    if n < 2:\n        return n\n    return"):
        ids = np.asarray(tok.encode(prompt, add_special=True)[:16])
        pos = np.arange(len(ids))
        a, b = (host_step(Runner(m, cfg), ids, pos, np.zeros(len(ids)), pos + 16, table)
                .astype(np.float64) for m in (pallas, ffi))
        la = a - a.max(-1, keepdims=True)
        la -= np.log(np.exp(la).sum(-1, keepdims=True))
        lb = b - b.max(-1, keepdims=True)
        lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
        agree += list(a.argmax(-1) == b.argmax(-1))
        kl += list((np.exp(lb) * (lb - la)).sum(-1))
    print(f"top1 {np.mean(agree):.3f} over {len(agree)}, mean KL {np.mean(kl):.4f}")
    assert np.mean(agree) >= 0.95 and np.mean(kl) <= 0.02, (np.mean(agree), np.mean(kl))


def test_a_receipt_made_on_the_pallas_kernel_verifies(path):
    """The receipt records the kernel and backend, and verifies on the same model and on a
    verification engine made from the file with the receipt's settings; one made on a GPU
    is refused here in one sentence naming the device it needs."""
    import kinetic
    m = kinetic.load(path, n_ctx=256, kernel="pallas", speculative=False)
    try:
        r = m.receipt("Once upon a time", max_tokens=6, temperature=0.7, seed=3)
        assert (r["engine"]["kernel"], r["engine"]["backend"]) == ("pallas", "cpu")
        assert r["engine"]["weights"] == "gguf"
        assert kinetic.verify_receipt(r, model=m).ok
        assert kinetic.verify_receipt(r, model=path).ok
        on_gpu = dict(r, engine=dict(r["engine"], backend="gpu", device="NVIDIA H200"))
        on_gpu.pop("signature", None)
        found = kinetic.verify_receipt(on_gpu, model=m)
        assert found.status == "unusable" and not found.ok
        assert "made on a GPU (NVIDIA H200, kernel pallas)" in found.message
        assert "needs that kind of device, and this is cpu" in found.message
    finally:
        m.close()


@pytest.mark.parametrize("pooling", ["mean", "rank"])
def test_embeddings_and_ranking_on_the_pallas_kernel(tmp_path, pooling):
    """An encoder (a tiny BERT, f16 weights) embeds and ranks on the pallas kernel as on the
    ffi kernel, within float32 rounding (the ffi kernel rounds activations to f16 for f16
    weights, as llama.cpp does)."""
    import kinetic
    from tests.embedding_models import write_bert
    path = str(write_bert(tmp_path / "bert.gguf", pooling=pooling, dtype="f16",
                          classifier=pooling == "rank"))
    texts = ["hello world", "a second, longer sentence here"]
    got, want = (kinetic.load(path, kernel=k) for k in ("pallas", "ffi"))
    if pooling == "rank":
        a, b = (np.asarray(m.rank("a query", texts)) for m in (got, want))
        assert np.abs(a - b).max() <= 1e-2 * max(1.0, np.abs(b).max())
    else:
        a, b = (np.asarray(m.embed(texts)) for m in (got, want))
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        assert (cos > 0.9999).all(), cos


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "lfm2", "qwen35",
                                  "qwen3moe", "qwen35moe"])
def test_a_gpus_fused_kernels_keep_the_bits(arch, tmp_path, monkeypatch):
    """On a GPU each residual add and the norm after it are one launch (layers.add_norm:
    pallas_norm.add_rms_norm, reading the projection's partial sums, layers.Pending), a
    dense layer's rotary and cache writes another (layers.rope_write: pallas_rope, with
    Qwen3's and Gemma 3's heads' norms), the add and norm before q, k and v are made
    inside their kernel (layers.Normed), and Gemma 3's norm after a projection, its add and
    the next norm are one launch (layers.post_add_norm), or inside the q+k+v kernel too
    (Normed.post). Run here with them on as on a GPU
    (the norms made Pallas', interpreted): a step's logits are the bytes of the same step
    with the add and the Pallas norm apart and the norms, rotary and writes apart (Gemma
    3's within rounding: its add may be an FMA), for attention (llama's, qwen2's with q, k
    and v biases, qwen3's, gemma3's and lfm2's with head norms), short-convolution and
    Gated DeltaNet mixers, SwiGLU feed-forwards and mixtures (Qwen3-MoE's and Qwen3.5-MoE's:
    the add and norm in the router's launch, which writes the normed rows for the experts
    and the shared expert); and a row's bytes are its own at 1 and 6 rows a step fused,
    and at 3 apart (three row buckets: 1, 8 and 4)."""
    from kinetic.kernels import pallas_norm, pallas_rope
    from kinetic.model import layers, qwen35
    from tests.test_model_forward import feed
    model = load_model(str(write_tiny_model(tmp_path / f"{arch}.gguf", arch, qtype="Q4_0",
                                            context_length=256)), kernel="pallas")
    monkeypatch.setattr(layers, "pallas_norms", lambda: True)
    made = []
    real = pallas_norm.add_rms_norm
    # (a projection's partial sums have its tile's rows, 16 or more; an array its own)
    monkeypatch.setattr(pallas_norm, "add_rms_norm",
                        lambda *a, **k: made.append(a[1].shape[1] > a[0].shape[0])
                        or real(*a, **k))
    ropes = []
    real_rope = pallas_rope.rope_write
    monkeypatch.setattr(pallas_rope, "rope_write",
                        lambda *a, **k: ropes.append(1) or real_rope(*a, **k))
    inside = []   # the norms made inside the projections' kernel (layers.Normed)
    real_took = layers.Normed.took
    monkeypatch.setattr(layers.Normed, "took", lambda self, h, *normed: inside.append(
        h is not None) or real_took(self, h, *normed))
    tokens = list(range(3, 9))

    def logits(chunk):   # add_norm as set
        runner = traced_runner(model, RunnerConfig(step_tokens=8, num_slots=1, page_size=16,
                                                   num_pages=4, pages_per_slot=2))
        return np.concatenate(feed(runner, {0: tokens}, chunk)[0])

    fused = [logits(chunk) for chunk in (1, 6)]
    # (Gemma 3's adds come after norms of their own: no add_norm there; Qwen3-MoE's are
    # all inside its projections' launches, its mixture's in the router's)
    assert any(made) == (arch not in ("gemma3", "qwen3moe", "qwen35moe")), \
        "no projection's partial sums reached add_norm"
    assert ropes   # (Qwen3.5's gated q and partial rotary too)
    # every family's mixer's norms inside its projections' kernel (q+k+v's, a short
    # convolution's in_proj, a delta rule's projections; in each trace the first layer's
    # adding nothing, the others' a residual; Gemma 3's normalized first, Normed.post). Their feed-forwards' norms are add_norm's here: a
    # CPU's step runs gate and up apart (layers.swiglu), the fused swiglu with its norm is
    # tests/test_pallas_matmul.py's.
    if arch in ("llama", "qwen2", "qwen3", "gemma3", "lfm2"):   # (lfm2's short convolution's
        assert inside and inside.count(True) == inside.count(False)   # in_proj too)
    elif arch == "qwen3moe":   # the mixture's too, in its router's launch (experts.moe_ffn)
        assert inside and inside.count(True) == 3 * inside.count(False)
    elif arch == "qwen35":   # its 4 mixers (delta rule's projections, gated attention's)
        assert inside and inside.count(True) == 3 * inside.count(False)
    else:   # qwen35moe: its mixers' and its mixtures' (the shared expert reads the rows
        assert inside and inside.count(True) == 7 * inside.count(False)   # its router made)
    assert all(f.tobytes() == fused[0].tobytes() for f in fused)

    def apart(x, y, w, eps):
        x = x + layers.value(y)
        return x, pallas_norm.rms_norm(x, w, eps)
    def post_apart(x, y, w_post, w, eps):
        x = x + pallas_norm.rms_norm(layers.value(y), w_post, eps)
        return x, pallas_norm.rms_norm(x, w, eps)
    monkeypatch.setattr(layers, "add_norm", apart)
    monkeypatch.setattr(layers, "rope_write", lambda *a, **k: None)
    monkeypatch.setattr(qwen35, "rope_write", lambda *a, **k: None)
    monkeypatch.setattr(layers, "norms_in_matmul", lambda rows: False)
    monkeypatch.setattr(layers, "post_add_norm", post_apart)   # (gemma3's: add_and_norm's)
    ropes.clear()
    got = logits(3)
    assert not ropes
    if arch == "gemma3":   # (its add after the norm may be an FMA: within rounding)
        np.testing.assert_allclose(got, fused[0], rtol=1e-4, atol=1e-4)
    else:
        assert got.tobytes() == fused[0].tobytes()


def test_a_gpus_attention_in_lanes_keeps_a_rows_bits(monkeypatch, tmp_path):
    """A GPU's default attention (pallas_attention._split_attention: a row's keys in lanes,
    merged in order), here 2 lanes of pages of 4 keys: a tiny llama's logits the same bits
    fed one row a step, 5 and all 12 at once, and beside another sequence; within float32
    rounding of one program walking all of a row's keys (another grouping of the sums)."""
    from kinetic.kernels import pallas_attention as pa
    from tests.test_model_forward import feed
    model = load_model(str(write_tiny_model(tmp_path / "llama.gguf", "llama", qtype="Q8_0",
                                            context_length=256)), kernel="pallas")
    monkeypatch.setattr(pa, "SPLIT_LANES", 2)
    lanes = []   # the lanes of each _split_attention traced
    real = pa._split_attention
    monkeypatch.setattr(pa, "_split_attention", lambda *a: lanes.append(a[13]) or real(*a))
    tokens, other = list(range(3, 15)), list(range(40, 52))

    def logits(chunk, split, both=False):   # KINETIC_GPU_ATTENTION read at each trace
        monkeypatch.setenv("KINETIC_GPU_ATTENTION", split)
        runner = traced_runner(model, RunnerConfig(step_tokens=16, num_slots=2, page_size=4,
                                                   num_pages=9, pages_per_slot=4))
        return feed(runner, {0: tokens, **({1: other} if both else {})}, chunk)[0]

    runs = [logits(1, "split"), logits(5, "split"), logits(12, "split"),
            logits(6, "split", both=True)]
    assert lanes and set(lanes) == {2}
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)
    lanes.clear()
    whole = logits(12, "whole")
    assert not lanes
    np.testing.assert_allclose(whole, runs[0], rtol=1e-4, atol=1e-5)


def traced_runner(model, config: RunnerConfig) -> Runner:
    """A Runner whose step is jitted here, so traced afresh with what a test has set (not a
    compiled step other tests keep, nor kinetic's compile cache)."""
    import functools

    import jax

    from kinetic.engine import runner as runner_module
    runner = Runner(model, config)
    runner._step = jax.jit(functools.partial(runner_module._forward, model.arch.forward,
                                             model.config),
                           donate_argnums=(2,), static_argnums=(4, 5))
    return runner
