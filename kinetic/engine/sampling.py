"""Drawing one token from one row of logits: greedy at temperature 0, otherwise a draw
keyed by (seed, position) so that the same request gives the same tokens wherever and
whenever it runs (DESIGN.md: no random stream consumed per call)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def draw_key(seed: int, position: int) -> jax.Array:
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), position)


@jax.jit
def _draw(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    return jax.random.categorical(key, logits / temperature)


def sample_token(logits: np.ndarray, temperature: float, seed: int, position: int) -> int:
    """The token at `position` (the index it will occupy in the sequence)."""
    if temperature <= 0:
        return int(np.argmax(logits))
    return int(_draw(jnp.asarray(logits, jnp.float32), jnp.float32(temperature),
                     draw_key(seed, position)))
