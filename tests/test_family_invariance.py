"""The determinism contract on the new families' tiny random-weight models: a Qwen3-MoE whose
rows route to different experts (kinetic/model/experts.py), an LFM2 hybrid whose short
convolutions read the inputs of the tokens before them from the paged cache
(kinetic/model/lfm2.py), a Qwen3.5-MoE whose delta-rule layers carry a recurrent state
per slot (kinetic/model/delta_net.py): cached prefixes resume from state snapshots, drafts
are replayed onto it once accepted, a draft model of its own kind restores its states after
proposing, and a Gemma 3 whose sliding-window layers hand back the rows every query has
passed (kinetic/engine/sliding_window.py). A row's logits are the same bits in every row bucket and beside
another sequence's rows, and greedy and seeded answers are the same alone, among others, at
--parallel 1 and 4, cold, cached and partly cached (a prefix whose convolution inputs come
from reused pages), with drafting on or off and another prefill chunking
(tests/test_invariance.py runs the same checks on SmolLM2).
"""

from __future__ import annotations

import numpy as np
import pytest

from kinetic.model.experts import route
from kinetic.model.loader import load_model
from tests.test_invariance import (OTHERS, PROMPT, check_never_depends_on_load,
                                   check_row_buckets, engines_over, requests)
from tests.tiny_models import write_tiny_model


FAMILIES = {
    "qwen3moe": dict(n_expert=8, n_expert_used=2, qtype="Q8_0", output_scale=2.0),
    "lfm2": dict(n_layer=4, attention_layers=(2,), qtype="Q8_0", output_scale=2.0),
    "qwen35moe": dict(n_layer=2, n_expert=8, n_expert_used=2, qtype="Q8_0", output_scale=2.0),
    # sliding-window layers over 8 positions whose passed rows are handed back
    # (kinetic/engine/sliding_window.py): every check resumes prefixes under that rule
    "gemma3": dict(n_layer=4, sliding_window=8, qtype="Q8_0", output_scale=2.0),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def setup(request, tmp_path_factory):
    arch = request.param
    path = write_tiny_model(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch,
                            context_length=1024, **FAMILIES[arch])
    yield from engines_over(load_model(str(path)))


def test_routing_is_per_row_most_probable_first(setup):
    """route(): rows with different logits choose different experts, each row's chosen
    weights renormalized to 1 and in order of probability."""
    import jax.numpy as jnp
    _, _, model = setup
    cfg = model.config
    if not cfg.n_expert:
        pytest.skip(f"{cfg.arch} has no experts: the routing check is the MoE model's")
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((16, cfg.n_expert)),
                         jnp.float32)
    chosen, weights = route(logits, cfg)
    assert len({tuple(sorted(r)) for r in np.asarray(chosen).tolist()}) > 4
    assert np.allclose(np.asarray(weights).sum(axis=1), 1.0, atol=1e-6)
    assert (np.diff(np.asarray(weights), axis=1) <= 0).all()   # most probable first


def test_a_row_has_the_same_bits_in_every_row_bucket(setup):
    tok, _, model = setup
    if model.config.kernel != "ffi":
        pytest.skip("row buckets are the ffi kernel's: XLA's dot is not batch-invariant")
    check_row_buckets(model, tok.encode(PROMPT, add_special=True)[:16],
                      (tok.encode(OTHERS[1]) * 2)[:16])


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_answer_never_depends_on_load(setup, kind):
    tok, engine, model = setup
    check_never_depends_on_load(tok, engine, model, requests(tok)[kind], kind)


def test_cache_bytes_per_token_are_what_the_runner_allocates(setup):
    """The memory check and the automatic --parallel count a convolution layer's float32
    input, not keys and values it does not have, and a delta-rule layer's state per sequence
    (its slots' windows and matrices, and three more), not per token."""
    from kinetic.engine.engine_config import kv_bytes_per_token, recurrent_bytes_per_sequence
    _, engine, model = setup
    runner = engine("p1", parallel=1).runner
    paged = [layer for layer in runner.cache if len(layer) == 2]
    held = sum(a.nbytes + b.nbytes for a, b in paged)
    per_token = held // (runner.config.num_pages * runner.config.page_size)
    assert kv_bytes_per_token(model.config, runner.config.kv_dtype) == per_token
    states = sum(layer[0].nbytes + layer[1].nbytes for layer in runner.cache if len(layer) == 3)
    # the slots' states, and the padding, scratch and zero states (delta_net.extra_states)
    assert states == recurrent_bytes_per_sequence(model.config) * (runner.config.num_slots + 3)
    assert (states > 0) == model.config.recurrent
