"""The paged forward of every architecture on tiny random models: against a dense numpy
reference written from the architectures' definitions, and bitwise independent of how the
tokens are chunked into steps and of which other sequences share a step."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.model.layers import StepInput
from kinetic.model.loader import load_model
from kinetic.model.weights import dequantize
from tests.tiny_models import write_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=ARCHS)
def tiny_file(request, tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp(request.param) / "m.gguf", request.param))


@pytest.fixture(scope="module", params=["ffi", "xla"])
def tiny(request, tiny_file):
    """The model through the C++ kernel (weights packed) and through XLA (dense float32,
    activations not rounded: the dense reference's own arithmetic)."""
    if request.param == "ffi":
        return load_model(tiny_file, kernel="ffi")
    return load_model(tiny_file, dtype="float32", act_quant=False, kernel="xla")


def runner_for(model, **kw):
    cfg = dict(step_tokens=8, num_slots=2, page_size=4, num_pages=33, pages_per_slot=16)
    cfg.update(kw)
    return Runner(model, RunnerConfig(**cfg))


def host_step(runner: Runner, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
              write_index: np.ndarray, page_table: np.ndarray) -> np.ndarray:
    """Runner.step_device, with the n rows' logits brought to the host: float32 [n, V]."""
    logits = runner.step_device(tokens, positions, slots, write_index, page_table)
    return np.asarray(logits[:len(tokens)])


def feed(runner, slot_tokens: dict[int, list[int]], chunk: int) -> dict[int, np.ndarray]:
    """Feed each slot's tokens, `chunk` per slot per step, sharing steps; logits per slot."""
    rc = runner.config
    table = np.zeros((rc.num_slots, rc.pages_per_slot), np.int32)
    for s in range(rc.num_slots):
        table[s] = 1 + s * rc.pages_per_slot + np.arange(rc.pages_per_slot)
    done = {s: 0 for s in slot_tokens}
    out = {s: [] for s in slot_tokens}
    while any(done[s] < len(t) for s, t in slot_tokens.items()):
        rows = []
        for s, toks in slot_tokens.items():
            for p in range(done[s], min(done[s] + chunk, len(toks))):
                rows.append((s, p, toks[p]))
        rows = rows[: rc.step_tokens]
        slots = np.array([r[0] for r in rows]); pos = np.array([r[1] for r in rows])
        toks = np.array([r[2] for r in rows])
        write = table[slots, pos // rc.page_size] * rc.page_size + pos % rc.page_size
        logits = host_step(runner, toks, pos, slots, write, table)
        for (s, p, _), row in zip(rows, logits):
            out[s].append(row)
            done[s] = p + 1
    return {s: np.stack(v) for s, v in out.items()}


# ---- a dense reference, written independently of kinetic/model --------------------------

def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, base, neox, dim):
    half = dim // 2
    inv = base ** (-np.arange(half) * 2.0 / dim)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    y = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:dim]
        y[..., :half], y[..., half:dim] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., 0:dim:2], x[..., 1:dim:2]
        y[..., 0:dim:2], y[..., 1:dim:2] = a * c - b * s, a * s + b * c
    return y


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def file_weights(model) -> dict:
    """Every tensor of the model's file dequantized, named as in the weight tree
    ({"blk": [per layer], ...}); projections transposed to [K, N]; a tied output is the
    embedding."""
    W: dict = {"blk": [{} for _ in range(model.config.n_layer)]}
    for full, raw in model.file.tensors.items():
        name = full.removesuffix(".weight")
        value = dequantize(raw).astype(np.float64)
        value = value.T if value.ndim == 2 and name != "token_embd" else value
        if name.startswith("blk."):
            _, i, name = name.split(".", 2)
            W["blk"][int(i)][name] = value
        else:
            W[name] = value
    W.setdefault("output", W["token_embd"].T)
    return W


def dense_reference(model, tokens):
    cfg, W = model.config, file_weights(model)
    mat = lambda p: p
    T, arch = len(tokens), cfg.arch
    pos = np.arange(T, dtype=np.float64)
    x = W["token_embd"][tokens].astype(np.float64) * cfg.embed_scale
    for i, w in enumerate(W["blk"]):
        h = _rms(x, w["attn_norm"], cfg.norm_eps)
        q = h @ mat(w["attn_q"]) + w.get("attn_q.bias", 0)
        k = h @ mat(w["attn_k"]) + w.get("attn_k.bias", 0)
        v = h @ mat(w["attn_v"]) + w.get("attn_v.bias", 0)
        q = q.reshape(T, cfg.n_head, cfg.head_dim)
        k = k.reshape(T, cfg.n_kv_head, cfg.head_dim)
        v = v.reshape(T, cfg.n_kv_head, cfg.head_dim)
        if "attn_q_norm" in w:
            q, k = _rms(q, w["attn_q_norm"], cfg.norm_eps), _rms(k, w["attn_k_norm"], cfg.norm_eps)
        sliding = cfg.sliding_layers[i]
        base = cfg.rope_base_local if sliding else cfg.rope_base
        q = _rope(q, pos, base, cfg.rope_neox, cfg.rope_dim)
        k = _rope(k, pos, base, cfg.rope_neox, cfg.rope_dim)
        g = cfg.n_head // cfg.n_kv_head
        k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
        s = np.einsum("thq,lhq->htl", q, k) * cfg.q_scale
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        mask = ki <= qi
        if sliding:
            mask &= ki > qi - cfg.sliding_window
        s = np.where(mask[None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True)); p /= p.sum(-1, keepdims=True)
        a = np.einsum("htl,lhq->thq", p, v).reshape(T, -1) @ mat(w["attn_output"])
        x = x + (_rms(a, w["post_attention_norm"], cfg.norm_eps) if arch == "gemma3" else a)
        h = _rms(x, w["ffn_norm"], cfg.norm_eps)
        act = _gelu if arch == "gemma3" else (lambda z: z / (1 + np.exp(-z)))
        f = (act(h @ mat(w["ffn_gate"])) * (h @ mat(w["ffn_up"]))) @ mat(w["ffn_down"])
        x = x + (_rms(f, w["post_ffw_norm"], cfg.norm_eps) if arch == "gemma3" else f)
    return _rms(x, W["output_norm"], cfg.norm_eps) @ mat(W["output"])


def test_config_and_shapes(tiny):
    cfg = tiny.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (2, 64, 4, 2, 16)
    assert tiny.weights["output"].shape == (64, cfg.vocab_size)  # (inputs, outputs)
    assert tiny.weights["blk"][0]["attn_q"].shape == (64, 64)
    if cfg.kernel == "ffi":  # every projection is an offset into the one file buffer
        data = tiny.weights["blk"][0]["attn_q"].data
        assert all(tiny.weights["blk"][i][n].data is data
                   for i in range(2) for n in ("attn_q", "ffn_down"))
        if cfg.tied_output:
            assert tiny.weights["output"] is tiny.weights["token_embd"]
    assert cfg.tied_output == (cfg.arch == "gemma3")
    if cfg.arch == "gemma3":
        assert cfg.sliding_layers == (True, False) and cfg.sliding_window == 8
        assert cfg.embed_scale == pytest.approx(8.0)


def test_matches_dense_reference(tiny):
    tokens = list(np.random.default_rng(1).integers(0, tiny.config.vocab_size, 21))
    # a float32 cache: the reference's own arithmetic (each cache type has its test below)
    got = feed(runner_for(tiny, kv_dtype="float32"), {0: tokens}, chunk=8)[0]
    want = dense_reference(tiny, np.array(tokens))
    if tiny.config.kernel == "xla":
        np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
        assert (got.argmax(-1) == want.argmax(-1)).all()
    else:  # activations rounded to int8 blocks as llama.cpp does: about 1% per projection
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, atol=0.05 * scale)
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_chunking_and_neighbours_do_not_change_bits(tiny):
    rng = np.random.default_rng(2)
    a = [int(t) for t in rng.integers(0, tiny.config.vocab_size, 19)]
    b = [int(t) for t in rng.integers(0, tiny.config.vocab_size, 11)]
    alone = feed(runner_for(tiny), {0: a}, chunk=8)[0]
    one_by_one = feed(runner_for(tiny), {0: a}, chunk=1)[0]
    np.testing.assert_array_equal(alone, one_by_one)
    shared = feed(runner_for(tiny), {1: b, 0: a}, chunk=3)  # other slot, other rows
    np.testing.assert_array_equal(shared[0], alone)
    np.testing.assert_array_equal(shared[1], feed(runner_for(tiny), {1: b}, chunk=5)[1])


def test_real_sizes_by_eval_shape(tiny):
    """The forward at a real model's sizes, shapes only: nothing is allocated."""
    cfg = tiny.config.replace(n_layer=24, d_model=896, n_head=14, n_kv_head=2, head_dim=64,
                              v_head_dim=64, d_ffn=4864, vocab_size=151936,
                              sliding_layers=(False,) * 24)
    T, S, P, page = 16, 4, 8, 16
    from kinetic.model.layers import Proj
    file = jax.ShapeDtypeStruct((600 << 20,), jnp.uint8)  # a packed model's one file buffer
    if tiny.config.kernel == "ffi":  # Q8_0 blocks at some offset of the file
        proj = lambda k, n: Proj(file, fmt=8, offset=4096, n=n, k=k)
    else:
        proj = lambda k, n: Proj(jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    names = {"attn_q": (896, 896), "attn_k": (896, 128), "attn_v": (896, 128),
             "attn_output": (896, 896), "ffn_gate": (896, 4864), "ffn_up": (896, 4864),
             "ffn_down": (4864, 896)}
    layer = {n: proj(*s) for n, s in names.items()}
    for n in ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm"):
        layer[n] = jax.ShapeDtypeStruct((896,), jnp.float32)
    layer.update({"attn_q_norm": jax.ShapeDtypeStruct((64,), jnp.float32),
                  "attn_k_norm": jax.ShapeDtypeStruct((64,), jnp.float32)})
    embd = (proj(896, 151936) if tiny.config.kernel == "ffi"
            else jax.ShapeDtypeStruct((151936, 896), jnp.float32))
    weights = {"token_embd": embd, "output_norm": jax.ShapeDtypeStruct((896,), jnp.float32),
               "output": proj(896, 151936), "blk": [layer] * 24}
    kv = jax.ShapeDtypeStruct((S * P + 1, page, 2, 64), jnp.float32)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    step = StepInput(i32(T), i32(T), i32(T), i32(T), i32(S, P))
    logits, cache = jax.eval_shape(lambda w, c, s: tiny.arch.forward(w, cfg, c, s),
                                   weights, [(kv, kv)] * 24, step)
    assert logits.shape == (T, 151936) and logits.dtype == jnp.float32
    assert len(cache) == 24 and cache[0][0].shape == kv.shape


# ---- the KV cache's types ---------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_heads_file(tmp_path_factory):
    """A llama whose heads are 64 wide: a q8_0 cache holds two blocks a head and rotates it
    (layers.rotation_sizes)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("wide") / "m.gguf", "llama",
                                d_model=128, n_head=2, n_kv_head=1, head_dim=64))


@pytest.mark.parametrize("kernel", ["ffi", "xla"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16", "q8_0"])
def test_every_cache_type_follows_the_reference_and_keeps_each_rows_bits(wide_heads_file,
                                                                         kernel, kv_dtype):
    """Each cache type (-ctk f32, f16, bf16, q8_0) stays close to the dense float64
    reference, and a row's logits are the same bits whether its prompt runs in chunks of 8
    or one token a step, alone or beside another slot's rows."""
    model = (load_model(wide_heads_file, kernel="ffi") if kernel == "ffi" else
             load_model(wide_heads_file, dtype="float32", act_quant=False, kernel="xla"))
    rng = np.random.default_rng(5)
    a = [int(t) for t in rng.integers(0, model.config.vocab_size, 19)]
    b = [int(t) for t in rng.integers(0, model.config.vocab_size, 11)]
    alone = feed(runner_for(model, kv_dtype=kv_dtype), {0: a}, chunk=8)[0]
    want = dense_reference(model, np.array(a))
    scale = np.abs(want).max()
    # the cache's rounding (q8_0: 1/254 of each block's largest value) on top of the
    # kernel's activation rounding
    np.testing.assert_allclose(alone, want, atol=(0.06 if kernel == "ffi" else 0.02) * scale)
    np.testing.assert_array_equal(feed(runner_for(model, kv_dtype=kv_dtype), {0: a}, chunk=1)[0],
                                  alone)
    shared = feed(runner_for(model, kv_dtype=kv_dtype), {1: b, 0: a}, chunk=3)
    np.testing.assert_array_equal(shared[0], alone)


def test_hadamard_is_the_orthonormal_sylvester_matrix_and_its_own_inverse():
    """layers.hadamard (C++ on CPU, csrc/hadamard.h; XLA's butterflies elsewhere) is the
    numpy reference's arithmetic bit for bit, through the FFI, the C ABI and XLA alike, and
    within float32 rounding of the orthonormal Sylvester matrix, its own inverse."""
    import kinetic.kernels as kk
    from kinetic.kernels import KernelError, ffi
    from kinetic.kernels import reference as R
    from kinetic.model import layers
    from kinetic.model.layers import hadamard
    rng = np.random.default_rng(7)
    for n in (64, 128, 256):
        x = (rng.standard_normal((7, 3, 2 * n)) * np.float32(10.0) **
             rng.integers(-3, 3, (7, 3, 2 * n))).astype(np.float32)
        want = R.hadamard(x, n).view(np.uint32)
        assert (kk.hadamard_host(x, n).view(np.uint32) == want).all()
        assert (np.asarray(jax.jit(lambda a: ffi.hadamard(a, n))(x)).view(np.uint32) == want).all()
        xla = jax.jit(lambda a: layers.hadamard(a, n))
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(layers, "_native_rows", lambda: False)   # the butterflies as XLA ops
            assert (np.asarray(xla.lower(x).compile()(x)).view(np.uint32) == want).all()
    for bad_n, width in ((48, 96), (64, 96)):
        with pytest.raises(KernelError, match="rotation's block"):
            kk.hadamard_host(np.zeros((2, width), np.float32), bad_n)
    rng = np.random.default_rng(6)
    for n in (64, 128, 256):
        H = np.ones((1, 1))
        while H.shape[0] < n:
            H = np.block([[H, H], [H, -H]])
        H /= np.sqrt(n)
        x = rng.standard_normal((5, 3, 2 * n)).astype(np.float32)
        got = np.asarray(hadamard(jnp.asarray(x), n))
        want = (x.reshape(-1, n).astype(np.float64) @ H.T).reshape(x.shape)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hadamard(jnp.asarray(got), n)), x, atol=1e-5)
        # elementwise: a row's bits are its own, alone or among others
        np.testing.assert_array_equal(np.asarray(hadamard(jnp.asarray(x[2:3]), n)), got[2:3])


def test_rotation_sizes_follow_llama_cpp():
    """A quantized cache rotates keys in blocks of the largest power of two dividing the head
    width (from 64), values in blocks of 64; heads not a multiple of 64 wide, and float
    caches, are not rotated (llama.cpp's attn_rot_k / attn_rot_v)."""
    from kinetic.model.layers import rotation_sizes
    q8 = (jnp.zeros((1, 1, 1, 68), jnp.uint8),) * 2
    f16 = (jnp.zeros((1, 1, 1, 64), jnp.float16),) * 2
    assert rotation_sizes(q8, 64, 64) == (64, 64)
    assert rotation_sizes(q8, 128, 128) == (128, 64)
    assert rotation_sizes(q8, 256, 256) == (256, 64)
    assert rotation_sizes(q8, 192, 192) == (64, 64)
    assert rotation_sizes(q8, 96, 32) == (0, 0)
    assert rotation_sizes(f16, 128, 128) == (0, 0)
