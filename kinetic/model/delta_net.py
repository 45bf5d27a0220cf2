"""The gated delta rule (Qwen3.5's linear-attention layers) and its per-sequence state.

A delta-rule layer's output for a token reads a state that sums every token before it: a
recurrence, unlike attention's keys and values (one row per position, kept in pages) or a
short convolution's inputs (LFM2: a few rows back, kept in pages too). Its state per
sequence is a few of the layer's inputs back (the causal convolution's window) and, per
value head, a [key width, value width] matrix. The runner keeps one of each per slot
(kinetic/engine/runner.py: `RecurrentState`), beside the paged cache.

A step's rows update their slots' states one after the other, in row order, in one loop
whose body is one token's update: so a row's bits depend only on its own slot's state and
its own inputs, never on the other rows of the step or how many there are. Each row reads
one state and writes one (`Recur.read`, `Recur.write`, indices into the layer's state
arrays): its slot's committed state, the scratch state a draft chain runs in, or the zero
state (position 0: a new sequence). Only rows that are sure (prompt rows and a sequence's
newest token) write their slot's state; a draft row writes the scratch state (the next
draft of its chain reads it), and its inputs are kept (`pending`), so that the next step
first replays the drafts that were accepted onto the slot's state (`Recur.replay_*`),
through the same loop body, before its own rows.

The state arrays have num_slots + 3 entries: the slots', then PADDING (padding rows write
it, nobody reads it), SCRATCH (draft chains; a step's chains run one after the other) and
ZERO (never written).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from kinetic.kernels import ffi as native
from kinetic.kernels import pallas_delta, target
from kinetic.model.config import Config
from kinetic.model.layers import linear, linear_many, rms_norm



def extra_states(num_slots: int) -> tuple[int, int, int]:
    """(PADDING, SCRATCH, ZERO): the state indices past the slots' (module docstring)."""
    return num_slots, num_slots + 1, num_slots + 2


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Recur:
    """The recurrent layers' part of a step (runner.py fills it; all int32).

    read, write [T]: the state index the row starts from and the one its new state goes to
      (extra_states). slot [T]: the row's slot (PADDING for padding rows), whose pending
      places a draft row's inputs go to. pend [T]: where a draft row keeps its inputs
      (pending[slot, pend]); -1 for other rows (they write the extra place K).
      replay_slot, replay_idx [R]: the pending inputs to apply to their slots' states first,
      in order; n_replay [1]: how many of them are real.
    """

    read: jax.Array
    write: jax.Array
    slot: jax.Array
    pend: jax.Array
    replay_slot: jax.Array
    replay_idx: jax.Array
    n_replay: jax.Array


def state_shapes(cfg: Config, num_slots: int, max_pending: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of one delta-rule layer's (window, matrix, pending) arrays: num_slots + 3 states
    (extra_states), max_pending + 1 pending places per slot (and the padding one's)."""
    S, K = num_slots + 3, max_pending + 1
    return ((S, cfg.ssm_conv - 1, conv_channels(cfg)),
            (S, cfg.ssm_v_heads, cfg.ssm_state, cfg.ssm_state),
            (num_slots + 1, K, event_width(cfg)))


def conv_channels(cfg: Config) -> int:
    """The convolution's channels: q and k (key heads) and v (value heads)."""
    return cfg.ssm_state * (2 * cfg.ssm_k_heads + cfg.ssm_v_heads)


def event_width(cfg: Config) -> int:
    """One token's inputs to the recurrence: the convolution's input, its decay and beta."""
    return conv_channels(cfg) + 2 * cfg.ssm_v_heads


def _update(cfg: Config, taps: jax.Array, window: jax.Array, matrix: jax.Array,
            event: jax.Array):
    """One token through the recurrence: (new window, new matrix, output [H, dv])."""
    C, H, Hk, d = conv_channels(cfg), cfg.ssm_v_heads, cfg.ssm_k_heads, cfg.ssm_state
    mixed, g, beta = event[:C], event[C:C + H], event[C + H:]
    full = jnp.concatenate([window, mixed[None, :]], axis=0)   # [taps, C], the oldest first
    conv = None
    for j in range(cfg.ssm_conv):   # taps added oldest first, as llama.cpp's convolution
        term = full[j] * taps[:, j]
        conv = term if conv is None else conv + term
    conv = jax.nn.silu(conv)
    q = conv[:Hk * d].reshape(Hk, d)
    k = conv[Hk * d:2 * Hk * d].reshape(Hk, d)
    v = conv[2 * Hk * d:].reshape(H, d)
    eps = cfg.norm_eps
    q = q / jnp.maximum(jnp.sqrt(jnp.sum(q * q, axis=-1, keepdims=True)), eps)
    k = k / jnp.maximum(jnp.sqrt(jnp.sum(k * k, axis=-1, keepdims=True)), eps)
    # value head h reads key head h mod Hk (llama.cpp repeats the key heads whole)
    q = jnp.tile(q, (H // Hk, 1)) * (1.0 / float(d) ** 0.5)
    k = jnp.tile(k, (H // Hk, 1))
    matrix = matrix * jnp.exp(g)[:, None, None]                 # [H, dk, dv]
    remembered = jnp.sum(matrix * k[:, :, None], axis=1)        # [H, dv]
    delta = (v - remembered) * beta[:, None]
    matrix = matrix + k[:, :, None] * delta[:, None, :]
    out = jnp.sum(matrix * q[:, :, None], axis=1)               # [H, dv]
    return full[1:], matrix, out


def recurrence(cfg: Config, taps: jax.Array, state: tuple, events: jax.Array, recur: Recur):
    """Run the step's replays, then its rows' events [T, E], through the recurrence; returns
    (the rows' outputs [T, H, dv], the layer's new (window, matrix, pending) arrays). In C++
    (csrc/delta_rule.h) where recurrence_kernel says "native", else XLA's loop ("pallas":
    delta_net_layer runs the whole layer's middle in kernels/pallas_delta.py instead)."""
    if recurrence_kernel(cfg) == "native":   # in C++: in place, one pass a row
        rows, replay = stacked(recur)
        return native.delta_rule(taps, state, events, rows, replay, recur.n_replay,
                                 cfg.ssm_v_heads, cfg.ssm_k_heads, cfg.norm_eps)
    windows, matrices, pending = state
    T = events.shape[0]
    n_replay = recur.n_replay[0]
    K = pending.shape[1] - 1

    def body(i, carry):
        windows, matrices, pending, out = carry
        is_row = i >= n_replay
        r = jnp.maximum(i - n_replay, 0)
        ri = jnp.minimum(i, recur.replay_slot.shape[0] - 1)
        replayed = recur.replay_slot[ri]
        read = jnp.where(is_row, recur.read[r], replayed)
        write = jnp.where(is_row, recur.write[r], replayed)
        event = jnp.where(is_row, events[r], pending[replayed, recur.replay_idx[ri]])
        w1, m1, o = _update(cfg, taps, windows[read], matrices[read], event)
        windows = jax.lax.dynamic_update_index_in_dim(windows, w1, write, 0)
        matrices = jax.lax.dynamic_update_index_in_dim(matrices, m1, write, 0)
        # a draft row keeps its inputs; the others write their slot's extra place K
        slot = jnp.where(is_row, recur.slot[r], replayed)
        at = jnp.where(is_row & (recur.pend[r] >= 0), recur.pend[r], K)
        pending = pending.at[slot, at].set(event)
        out = out.at[jnp.where(is_row, r, T)].set(o)
        return windows, matrices, pending, out

    H, d = cfg.ssm_v_heads, cfg.ssm_state
    carry = (windows, matrices, pending, jnp.zeros((T + 1, H, d)))
    windows, matrices, pending, out = jax.lax.fori_loop(0, n_replay + T, body, carry)
    return out[:T], (windows, matrices, pending)


def stacked(recur: Recur) -> tuple[jax.Array, jax.Array]:
    """recur's rows [4, T] (read, write, slot, pend) and replays [2, R] (slot, idx), as the
    kernels take them (one XLA kernel each a step: every layer's are the same)."""
    return (jnp.stack([recur.read, recur.write, recur.slot, recur.pend]),
            jnp.stack([recur.replay_slot, recur.replay_idx]))


def recurrence_kernel(cfg: Config) -> str:
    """Which runs a step's recurrence: "native" (C++) where ffi.usable says (a CPU), "pallas"
    (kernels/pallas_delta.py: one launch a layer, the output's norm and gate in it) where
    the step is traced for a GPU and it runs the shape, unless KINETIC_GPU_DELTA=xla; else
    "xla" (recurrence's loop, about ten kernels a token). Decided at each trace."""
    if native.usable():
        return "native"
    choice = os.environ.get("KINETIC_GPU_DELTA", "pallas")
    if choice not in ("pallas", "xla"):
        raise ValueError(f"KINETIC_GPU_DELTA={choice!r}: pallas or xla")
    if (target.backend() == "gpu" and choice == "pallas" and pallas_delta.supported(
            cfg.ssm_v_heads, cfg.ssm_k_heads, cfg.ssm_state, cfg.ssm_conv)):
        return "pallas"
    return "xla"


def delta_net_layer(x: jax.Array, w: dict, state: tuple, recur: Recur, cfg: Config):
    """A gated delta-rule layer's output [T, D] for the normed x [T, D] (may be Pending:
    layers.linear's pending), and its new state."""
    T = x.shape[0]
    H, d = cfg.ssm_v_heads, cfg.ssm_state
    projs = [w["attn_qkv"], w["attn_gate"], w["ssm_beta"], w["ssm_alpha"]]
    if recurrence_kernel(cfg) == "pallas":
        # all of what follows in one launch, from the projections' partial sums, the
        # output's norm and gate too
        inputs = (*linear_many(x, projs, partials=True), w["ssm_dt.bias"], w["ssm_a"],
                  w["ssm_norm"])
        gated, state = pallas_delta.delta_rule(w["ssm_conv1d"], state, inputs,
                                               *stacked(recur), recur.n_replay, T, H,
                                               cfg.ssm_k_heads, cfg.norm_eps)
        return linear(gated, w["ssm_out"], pending=True), state
    mixed, z, beta, alpha = linear_many(x, projs)
    g = jax.nn.softplus(alpha + w["ssm_dt.bias"]) * w["ssm_a"]   # the decay's log, <= 0
    events = jnp.concatenate([mixed, g, jax.nn.sigmoid(beta)], axis=1)
    out, state = recurrence(cfg, w["ssm_conv1d"], state, events, recur)
    gated = rms_norm(out, w["ssm_norm"], cfg.norm_eps) * jax.nn.silu(z.reshape(T, H, d))
    return linear(gated.reshape(T, H * d), w["ssm_out"], pending=True), state
