"""The pallas kernels lower through Triton for CUDA, checked on a CPU: JAX lowers a
pallas_call for a GPU without one (`lower(lowering_platforms=("cuda",))`), and Triton's
lowering refuses what a GPU would (arrays whose sizes are not powers of 2, concatenates,
unsigned dots), so a kernel that passes here reaches the GPU's compiler. What the compiler
and the GPU then do is the device check's (scripts/device_check.sh)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kinetic.engine.runner import Runner, RunnerConfig
from kinetic.kernels import pallas_attention as pa
from kinetic.kernels import target
from kinetic.kernels import pallas_matmul as pm
from kinetic.model import layers
from kinetic.model.loader import load_model
from tests.test_pallas_matmul import FORMATS, random_blocks
from tests.tiny_models import write_tiny_model

TRITON = "__gpu$xla.gpu.triton"


def cuda_text(f, *args) -> str:
    """StableHLO of f(*args) lowered for CUDA, its pallas calls through Triton."""
    with target.for_gpu():
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("qtype", FORMATS)
def test_every_matmul_format_lowers_through_triton(qtype):
    N, K = 48, 768        # bn 16 and K in three 256-element blocks
    w = pm.repack(random_blocks(qtype, N, K), qtype, (N, K))
    text = cuda_text(lambda x, w: pm.matmul(x, w), jnp.zeros((3, K)), w)
    assert text.count(TRITON) == 1
    # a block format rounds x with IEEE division and product (pallas_matmul.rounded), not
    # Triton's approximate division or a fused multiply-add
    integer = qtype not in (T.F32, T.F16, T.BF16)
    assert ("div.rn.f32" in text and "mul.rn.f32" in text) == integer


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q6_K, T.BF16])
def test_the_variants_and_split_k_lower_through_triton(qtype):
    """A 64-row call (four 16-row dots a program) of a weight whose K is split in two, and
    a 1-row call; x read in place, unpadded (no pad of x before the kernel)."""
    N, K = 32, 1024
    assert pm.tiling(N, K).chunks == 2
    w = pm.repack(random_blocks(qtype, N, K), qtype, (N, K))
    for M in (64, 1):
        text = cuda_text(lambda x, w: pm.matmul(x, w), jnp.zeros((M, K)), w)
        assert text.count(TRITON) == 1
        # (a padded copy of x is a scatter, a pad or an update slice: a kernel of its own)
        assert not {"stablehlo.scatter", "stablehlo.pad",
                    "stablehlo.dynamic_update_slice"} & set(re.findall(r"stablehlo\.\w+", text))


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [
    (9, 3, 64, jnp.float32),      # SmolLM2-135M: 3 query heads a kv head, padded to 16
    (14, 2, 64, jnp.float16),     # Qwen2.5-0.5B: 7
    (12, 2, 128, jnp.bfloat16),   # Qwen2.5-1.5B: 6
    (4, 4, 256, jnp.float32)])    # one query head a kv head
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (512, 50.0)])
@pytest.mark.parametrize("split", [None, 0])
def test_paged_attention_lowers_through_triton(heads, kv_heads, head_dim, dtype, window,
                                               softcap, split):
    """A GPU's default (None: a row's keys in lanes, then their merge, two kernels) and
    one program over all of a row's keys (0)."""
    pages = jnp.zeros((40, 16, kv_heads, head_dim), dtype)
    rows = jnp.zeros((5,), jnp.int32)

    def f(q, k, v, table, slots, positions):
        return pa.paged_attention(q, k, v, table, slots, positions, 0.125, window, softcap,
                                  split=split)
    text = cuda_text(f, jnp.zeros((5, heads, head_dim)), pages, pages,
                     jnp.zeros((4, 8), jnp.int32), rows, rows)
    assert text.count(TRITON) == (1 if split == 0 else 2)


@pytest.mark.parametrize("width", [576, 896, 1536, 64, 128])
def test_the_norm_lowers_through_triton_on_a_gpu_unless_told_xla(width, monkeypatch):
    """layers.rms_norm traced for a GPU is the Pallas kernel, at widths that are not powers
    of 2 too (padded inside); KINETIC_GPU_NORM=xla gives XLA's reduction instead."""
    def norm(x, w):
        return layers.rms_norm(x, w, 1e-6)
    args = jnp.zeros((5, width)), jnp.zeros(width)
    text = cuda_text(norm, *args)
    assert text.count(TRITON) == 1
    # x, w and y where they are: no padded copy (a scatter, a pad or a slice of its own)
    assert not {"stablehlo.scatter", "stablehlo.pad", "stablehlo.dynamic_update_slice",
                "stablehlo.slice"} & set(re.findall(r"stablehlo\.\w+", text))
    monkeypatch.setenv("KINETIC_GPU_NORM", "xla")
    assert cuda_text(norm, *args).count(TRITON) == 0


def test_berts_layer_norm_lowers_through_triton_on_a_gpu():
    from kinetic.model import bert
    args = jnp.zeros((5, 384)), jnp.zeros(384), jnp.zeros(384)
    assert cuda_text(lambda x, w, b: bert.layer_norm(x, w, b, 1e-12), *args).count(TRITON) == 1


def test_padding_query_heads_keeps_a_groups_arithmetic():
    assert [pa.group_rows(g) for g in (1, 3, 7, 16, 17)] == [16, 16, 16, 16, 32]


@pytest.mark.parametrize("arch,qtype", [
    ("llama", "Q4_0"), ("llama", "Q5_1"), ("llama", "F16"), ("qwen3", "Q4_0"),
    ("gemma3", "Q8_0"), ("qwen3moe", "Q4_0"), ("lfm2moe", "Q4_0"), ("qwen35moe", "Q4_1")])
def test_a_whole_model_step_lowers_for_cuda(tmp_path, arch, qtype):
    """A tiny model's step on kernel "pallas", traced as the runner runs it, lowers for
    CUDA with every pallas call of its jaxpr (the projections and each layer's attention)
    a Triton kernel, none interpreted (an interpreted one lowers to plain loops), the norms
    among them (kernels/pallas_norm.py), and no C++ FFI call left (rotary angles in XLA, as
    on a GPU), and no pad (the kernels read and write in place): dense, sliding-window and
    soft-capped, mixture-of-experts (no conditional: no branch per expert), short-convolution
    and Gated DeltaNet families (no loop: the delta rule's recurrence one kernel)."""
    path = write_tiny_model(tmp_path / "tiny.gguf", arch, qtype=qtype, context_length=256)
    runner = Runner(load_model(str(path), kernel="pallas"),
                    RunnerConfig(step_tokens=4, num_slots=1, page_size=16, num_pages=4,
                                 pages_per_slot=2))
    seen = {}

    def lower(*args):
        with target.for_gpu():
            traced = jitted.trace(*args)
            seen["jaxpr"] = str(traced.jaxpr)
            seen["launches"] = launches(traced.jaxpr.jaxpr)
            seen["text"] = traced.lower(lowering_platforms=("cuda",)).as_text()
        raise _Lowered

    jitted, runner._step = runner._step, lower
    with pytest.raises(_Lowered):
        runner.step_device(np.array([1, 2]), np.array([0, 1]), np.zeros(2, np.int64),
                           np.array([16, 17]), np.array([[1, 2]], np.int32))
    kernels = seen["jaxpr"].count("pallas_call[")
    print("KERNELS", arch, kernels)
    calls = re.findall(r"custom_call @([\w$.]+)", seen["text"])
    assert kernels >= 5 and calls.count(TRITON) == kernels
    assert set(calls) == {TRITON}
    assert "name=_rms" in seen["jaxpr"]   # pallas_norm._rms (the final norm at least)
    # the kernels read and write in place on a GPU: no padded copy around any of them
    assert "stablehlo.pad " not in seen["text"]
    # a mixture's experts are one launch a projection (matmul_experts), no branch each
    assert "stablehlo.case" not in seen["text"]
    # a Gated DeltaNet layer's recurrence is one kernel (pallas_delta), not XLA's loop
    assert "stablehlo.while" not in seen["text"]
    if arch in ("llama", "qwen3"):   # a layer: q+k+v (the add and the norm before them
        # inside: layers.Normed), rotary and the cache writes (pallas_rope; Qwen3's heads'
        # norms in it too), attention (a row's keys in lanes, then their merge), o,
        # gate+up (add and norm inside), down; then the final norm and the output
        assert seen["launches"] == 7 * 2 + 2   # (2 layers)


def test_the_decode_loops_body_reads_its_step_without_a_dynamic_slice(tmp_path):
    """Runner.decode_steps' loop (a tiny qwen35: Gated DeltaNet and attention) traced for
    a GPU: its body takes step i's positions and write indices by a masked sum, with no
    dynamic slice at the loop's index, which XLA's GPU compiler makes a copy run on its
    own between the body's CUDA graphs (bench/gpu_compile.py's "thunks outside a graph").
    Its tokens are those of steps run one by one: tests/test_invariance.py."""
    path = write_tiny_model(tmp_path / "tiny.gguf", "qwen35", qtype="Q4_0",
                            context_length=256)
    runner = Runner(load_model(str(path), kernel="pallas"),
                    RunnerConfig(step_tokens=4, num_slots=2, page_size=16, num_pages=8,
                                 pages_per_slot=2, decode_steps=3))
    seen = {}

    def trace(*args):
        with target.for_gpu():
            seen["jaxpr"] = jitted.trace(*args).jaxpr
        raise _Lowered

    jitted, runner._decode = runner._decode, trace
    N, slots = 3, np.array([0, 1])
    with pytest.raises(_Lowered):
        runner.decode_steps(np.array([5, 6]), np.zeros((N, 2), int) + np.arange(N)[:, None],
                            slots, 16 + 16 * slots + np.arange(N)[:, None],
                            np.array([[1, 2], [3, 4]]), (None, None))
    bodies = loops(seen["jaxpr"].jaxpr)
    assert len(bodies) == 1
    assert "dynamic_slice" not in str(bodies[0])


def loops(jaxpr) -> list:
    """The bodies of a jaxpr's outermost loops (a fori_loop of static bounds is a scan),
    inside the jitted functions it calls too, not the loops inside a kernel."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("while", "scan", "pallas_call"):
            found += {"while": [eqn.params.get("body_jaxpr")],
                      "scan": [eqn.params.get("jaxpr")]}.get(eqn.primitive.name, [])
            continue
        for sub in inner_jaxprs(eqn):
            found += loops(sub)
    return found


def launches(jaxpr) -> int:
    """The pallas_calls a jaxpr runs, each time it runs one (inside the jitted functions it
    calls, each call counted)."""
    return sum(1 if eqn.primitive.name == "pallas_call"
               else sum(launches(sub) for sub in inner_jaxprs(eqn)) for eqn in jaxpr.eqns)


def inner_jaxprs(eqn) -> list:
    """The jaxprs an equation calls (a jitted function's, a loop's body, a branch)."""
    from jax.extend import core
    found = []
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else [value]:
            if isinstance(sub, core.ClosedJaxpr):
                found.append(sub.jaxpr)
            elif isinstance(sub, core.Jaxpr):
                found.append(sub)
    return found


class _Lowered(Exception):
    pass


def test_a_layers_projections_that_read_one_x_are_one_kernel():
    """q, k and v (three formats here), and gate and up, each one Triton kernel
    (layers.linear_many: pallas_matmul.matmul_many), the down projection another."""
    K = 256

    def proj(qtype, n, seed):
        return layers.Proj(pm.repack(random_blocks(qtype, n, K, seed), qtype, (n, K)),
                           layers.PLANES)
    q, k, v = proj(T.Q4_K, 64, 1), proj(T.Q4_K, 32, 2), proj(T.Q6_K, 32, 3)
    x = jnp.zeros((5, K))
    text = cuda_text(lambda x, q, k, v: layers.linear_many(x, [q, k, v]), x, q, k, v)
    assert text.count(TRITON) == 1
    gate, up = proj(T.Q4_0, 128, 4), proj(T.Q4_0, 128, 5)
    down = layers.Proj(pm.repack(random_blocks(T.Q4_0, K, 128, 6), T.Q4_0, (K, 128)),
                       layers.PLANES)
    text = cuda_text(lambda x, g, u, d: layers.swiglu(x, g, u, d), x, gate, up, down)
    assert text.count(TRITON) == 2
    # silu(gate) * up is made inside the down projection's kernel (pallas_matmul.swiglu),
    # not by XLA between the two (a kernel of its own on a GPU)
    assert "stablehlo.logistic" not in text and "stablehlo.multiply" not in text


def test_a_one_row_steps_cache_write_is_an_update_in_place():
    """layers.write_kv of one row (a decode step's) is a dynamic update slice, which XLA
    fuses with the computation of the row written (rotary, the cache's type) into one
    in-place kernel, where a scatter of one row became a select and an update, two kernels
    a cache (bench/gpu_compile.py); more rows stay a scatter. The same cache either way."""
    cache = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 2, 8)), jnp.float16)
    new = jnp.asarray(np.random.default_rng(1).standard_normal((3, 2, 8)), jnp.float32)
    index = jnp.asarray([37, 5, 60], jnp.int32)
    for rows in (1, 3):
        got = layers.write_kv(cache, new[:rows], index[:rows])
        flat = np.asarray(cache).reshape(64, 2, 8).copy()
        flat[np.asarray(index[:rows])] = np.asarray(new[:rows]).astype(np.float16)
        assert np.asarray(got).tobytes() == flat.reshape(cache.shape).tobytes(), rows
        ops = set(re.findall(r"stablehlo\.\w+", cuda_text(
            layers.write_kv, cache, new[:rows], index[:rows])))
        assert ("stablehlo.scatter" in ops) == (rows > 1)
        assert ("stablehlo.dynamic_update_slice" in ops) == (rows == 1)


def test_the_decode_loops_greedy_draw_is_a_triton_kernel_on_a_gpu():
    """sample_device.greedy_tokens without a mask (Runner.decode_steps' draw) traced for a
    GPU: the blocks' maxima in one Triton kernel (kernels/pallas_greedy.py) around one
    scatter of the bias and one reduction, where sampler.greedy's XLA passes were about
    eight kernels; traced for a CPU it stays XLA's (no pallas call)."""
    from kinetic.engine import sample_device, sampler
    logits = jnp.zeros((4, 20000), jnp.float32)
    bias = sampler.Sparse(jnp.full((4, 8), -1, jnp.int32), jnp.zeros((4, 8), jnp.float32))

    def draw(x, b):
        return sample_device.greedy_tokens(x, b, None, exact=False)
    text = cuda_text(draw, logits, bias)
    assert re.findall(r"custom_call @([\w$.]+)", text) == [TRITON]
    assert "pallas_call" not in str(jax.make_jaxpr(draw)(logits, bias))
