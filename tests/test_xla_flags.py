"""kinetic turns XLA's CPU fusion emitters off for memory (kinetic/__init__.py): that must
change no bit of what a model computes or a sampler draws, only the memory compiling takes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kinetic
from tests.tiny_models import write_tiny_model

_RUN = """
import hashlib, os, sys
import jax, jax.numpy as jnp, numpy as np
import kinetic
from kinetic.engine import sampler
from kinetic.engine.sampling_params import SamplingParams
print(os.environ["XLA_FLAGS"])
m = kinetic.load(sys.argv[1], n_ctx=64)
ids = m.tokenize("The quick brown fox jumps over the lazy dog")
print(hashlib.sha256(np.asarray(m.logits(ids)).tobytes()).hexdigest())
print(repr("".join(m.generate("Once upon a time", max_tokens=12, temperature=0.9, seed=7))))
B, V = 4, 5000
logits = jnp.asarray(np.random.default_rng(1).standard_normal((B, V)).astype(np.float32) * 4)
rows = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=0, top_p=0.9),
        SamplingParams(temperature=0.8, mirostat=2), SamplingParams(temperature=0.0)]
params = sampler.make_row_params(rows, [1, 2, 3, 4], [5, 6, 7, 8], n_ctx=64)
ids_, vals = sampler.pack_pairs([], B, 8)
args = (logits, params, jnp.full((B, 16), -1, jnp.int32), sampler.Sparse(ids_, vals),
        jnp.asarray(sampler.full_mask(B, V)))
print(np.asarray(sampler.sample(*args)[0]).tolist())
print(hashlib.sha256(np.asarray(sampler.distribution(*args)).tobytes()).hexdigest())
"""


def _run(model, flags: str | None) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if flags is not None:
        env["XLA_FLAGS"] = flags
    done = subprocess.run([sys.executable, "-c", _RUN, str(model)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_import_sets_the_flag_and_keeps_a_given_one():
    assert f"{kinetic.XLA_FLAG}=" in os.environ["XLA_FLAGS"]
    code = "import os, kinetic; print(os.environ['XLA_FLAGS'])"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}, timeout=120)
    assert done.stdout.split() == ["--xla_cpu_enable_fast_math=false",
                                   "--xla_cpu_use_fusion_emitters=false"]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=true"},
                          timeout=120)
    assert done.stdout.split() == ["--xla_cpu_use_fusion_emitters=true"]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_fusion_emitters_change_no_bit(tmp_path, arch):
    model = write_tiny_model(tmp_path / f"{arch}.gguf", arch)
    off, on = _run(model, None), _run(model, "--xla_cpu_use_fusion_emitters=true")
    assert off[0] == "--xla_cpu_use_fusion_emitters=false"
    assert on[0] == "--xla_cpu_use_fusion_emitters=true"
    assert off[1:] == on[1:]
    assert len(off) == 5
