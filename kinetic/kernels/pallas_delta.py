"""Qwen3.5's gated delta rule as one Pallas kernel (model/delta_net.py's layer on a GPU).

    gated, (windows, matrices, pending) = delta_rule(taps, state, inputs, rows, replay,
                                                     n_replay, T, heads, key_heads, eps)

The recurrence of kinetic/kernels/csrc/delta_rule.h (the CPU's) and delta_net.py's XLA loop,
whose body XLA ran as about ten kernels a token (a prompt's tokens each paid them, one after
the other, in every delta-rule layer, plus a loop whose trip count the host read back), with
what delta_net_layer does around it: each row's decay (softplus(alpha + dt_bias) * a, its
log) and beta (sigmoid) made from the projections, and each head's output RMS-normed and
gated by silu(z). The step's replays and rows all go through one launch a layer, where XLA
had two more kernels and a norm's around the loop.

One program a key head. It owns that head's q and k channels of the convolution, and every
value head that reads it (value head h reads key head h mod Hk): their v channels, their
decays and betas, their state matrices. So no program reads what another writes, and the
tokens need no order between programs, only inside each: a program takes the step's
replays, then its rows, in order, each reading one state (its `read`) and writing one (its
`write`), the states updated in place (the inputs alias the outputs). A barrier
(`pallas_backend.barrier`, the program's threads) sits between a token's loads of a state
and its stores to it (read and written in place) and after its last stores (the next token
may read what it wrote); one pipeline stage, so that no later token's load starts early.

Per token, on each of the program's channel blocks (q's and k's d wide, v's a block of
columns wide): the causal convolution, taps added oldest first (the window's rows, then the
token's own input), silu; the window moved on and the token's inputs kept (`pending`); q
and k L2-normed (q scaled by 1 / sqrt(d)); then per value head, its matrix [d, d] a block
of columns at a time (the columns' updates are independent): decay, what it remembers for
k (a sum over the matrix's rows), the delta rule's update, the output read through q; the
head's output then normalized (pallas_norm.rms_scale) and gated. The sums are reductions
over a block of a fixed shape (d, or the column block), their order Triton's (XLA's,
interpreted): the same code for every token, whatever the step's other rows, so a row's bits
depend only on its own state and inputs, as on the CPU; they are not the C++ kernel's
(sequential sums), only its values within float32 rounding (tests/test_pallas_delta.py).
A replay's output goes to its step's first row, which writes over it.
Interpreted wherever JAX's backend is not a GPU (kernels/pallas_backend.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kinetic.kernels import pallas_backend, pallas_norm

COLUMNS = 32   # a matrix's columns a block holds (at most d): [d, 32] floats at a time
               # (bench/triton_sm90.py at sm_90a, 16 key heads of 128, one row: 168
               # registers for one value head a program, 215 for two, none spilled; 112
               # bytes spilled for three; 64 columns spilled at one)


def supported(heads: int, key_heads: int, width: int, taps: int) -> bool:
    """Whether this kernel runs that shape: a head's width a power of 2 (Triton's blocks),
    value heads a multiple of the key heads, a window of at least one input."""
    return (width >= 1 and width & (width - 1) == 0 and key_heads >= 1
            and heads % key_heads == 0 and taps >= 2)


def delta_rule(taps: jax.Array, state: tuple, inputs: tuple, rows: jax.Array,
               replay: jax.Array, n_replay: jax.Array, T: int, heads: int, key_heads: int,
               eps: float, interpret: bool | None = None) -> tuple[jax.Array, tuple]:
    """A delta-rule layer's step (module docstring): taps [C, taps]; state (windows [S, taps
    - 1, C], matrices [S, H, d, d], pending [P, K1, C + 2H]); inputs (mixed, z, beta, alpha
    as the projections' partial sums [chunks, >= T, >= N] (layers.linear_many's partials:
    N is C, H d, H and H; beta and alpha before their activations), then dt_bias [H], a [H],
    norm [d]); rows int32 [4, T] (read, write, slot, pend), replay int32 [2, R] (slot,
    idx), n_replay int32 [1] (delta_net.stacked). Returns (the T rows' gated outputs [T, H
    d], the new state), each state array updated in place."""
    windows, matrices, pending = state
    d = matrices.shape[-1]
    if not supported(heads, key_heads, d, taps.shape[1]):
        raise ValueError(f"pallas delta_rule: {heads} value heads on {key_heads} key heads of "
                         f"width {d} with {taps.shape[1]} taps is not a shape it runs")
    f32, i32 = jnp.float32, jnp.int32
    return _delta_rule(taps.astype(f32), tuple(jnp.asarray(x, f32) for x in inputs),
                       rows.astype(i32), replay.astype(i32), n_replay.astype(i32).reshape(1),
                       windows.astype(f32), matrices.astype(f32), pending.astype(f32), int(T),
                       heads, key_heads, float(eps), pallas_backend.interpreted(interpret))


@functools.partial(jax.jit, static_argnums=(8, 9, 10, 11, 12))
def _delta_rule(taps, inputs, rows, replay, n_replay, windows, matrices, pending, T: int,
                H: int, Hk: int, eps: float, interpret: bool):
    C, n_taps = taps.shape
    W, d = n_taps - 1, matrices.shape[-1]
    P, K1 = pending.shape[:2]
    R, S = replay.shape[1], windows.shape[0]
    G = H // Hk                          # the value heads a key head serves
    bc = min(d, COLUMNS)
    scale = float(1.0 / float(d) ** 0.5)

    def kernel(taps_ref, mixed_ref, z_ref, beta_ref, alpha_ref, dt_ref, a_ref, norm_ref,
               rows_ref, replay_ref, n_ref, _w, _m, _p, out_ref, win_ref, mat_ref, pend_ref):
        hk = pl.program_id(0)
        heads_of = [hk + m * Hk for m in range(G)]
        # the program's channel blocks: its key head's q and k (d wide), then each of its
        # value heads' v in blocks of bc (one per block of its matrix's columns)
        blocks = [(hk * d, d), ((Hk + hk) * d, d)] + [
            (2 * Hk * d + h * d + c, bc) for h in heads_of for c in range(0, d, bc)]
        n = n_ref[0]
        norm = norm_ref[pl.ds(0, d)]

        def token(i, carry):
            is_row = i >= n
            r = jnp.clip(i - n, 0, T - 1)
            ri = jnp.minimum(i, R - 1)
            r_slot = jnp.clip(replay_ref[0, ri], 0, min(S, P) - 1)
            r_idx = jnp.clip(replay_ref[1, ri], 0, K1 - 1)
            src = jnp.where(is_row, rows_ref[0, r], r_slot)
            dst = jnp.where(is_row, rows_ref[1, r], r_slot)
            at_slot = jnp.where(is_row, rows_ref[2, r], r_slot)
            pend = rows_ref[3, r]
            at = jnp.where(is_row & (pend >= 0), pend, K1 - 1)

            def kept(at_c):   # a replay's inputs at at_c (an index or a pl.ds)
                return pend_ref[r_slot, r_idx, at_c]

            def made(ref, at_c):   # a row's projection at at_c, its partial sums added
                return pallas_backend.load_sum(ref, (r, at_c))

            # the token's inputs: a row's from the projections (its decay's log and its
            # beta made here, as delta_net.py makes them), a replay's as they were kept
            mixed = [jnp.where(is_row, made(mixed_ref, pl.ds(c0, size)), kept(pl.ds(c0, size)))
                     for c0, size in blocks]
            g = [jnp.where(is_row, jax.nn.softplus(made(alpha_ref, h) + dt_ref[h]) * a_ref[h],
                           kept(C + h)) for h in heads_of]
            beta = [jnp.where(is_row, jax.nn.sigmoid(made(beta_ref, h)), kept(C + H + h))
                    for h in heads_of]
            window = [[win_ref[src, j, pl.ds(c0, size)] for j in range(W)]
                      for c0, size in blocks]
            conv = []
            for b, (c0, size) in enumerate(blocks):   # taps added oldest first, as in C++
                full = window[b] + [mixed[b]]
                tap = [taps_ref[pl.ds(c0, size), j] for j in range(n_taps)]
                acc = full[0] * tap[0]
                for j in range(1, n_taps):
                    acc = acc + full[j] * tap[j]
                conv.append(acc * (1.0 / (1.0 + jnp.exp(-acc))))   # silu
            # every thread has read the window (in place where src == dst): it moves on by
            # one input, and the event is kept (a draft's, for its replay)
            pallas_backend.barrier(interpret)
            for b, (c0, size) in enumerate(blocks):
                for j in range(W - 1):
                    win_ref[dst, j, pl.ds(c0, size)] = window[b][j + 1]
                win_ref[dst, W - 1, pl.ds(c0, size)] = mixed[b]
                pend_ref[at_slot, at, pl.ds(c0, size)] = mixed[b]
            for m, h in enumerate(heads_of):
                pend_ref[at_slot, at, C + h] = g[m]
                pend_ref[at_slot, at, C + H + h] = beta[m]
            q, k = (x / jnp.maximum(jnp.sqrt(jnp.sum(x * x)), eps) for x in conv[:2])
            qc, kc = (q * scale)[:, None], k[:, None]
            v = iter(conv[2:])
            for m, h in enumerate(heads_of):
                decay = jnp.exp(g[m])
                for c in range(0, d, bc):
                    mat = mat_ref[src, h, :, pl.ds(c, bc)] * decay         # [d, bc]
                    remembered = jnp.sum(mat * kc, axis=0)                 # [bc]
                    delta = (next(v) - remembered) * beta[m]
                    mat = mat + kc * delta[None, :]
                    out_ref[r, pl.ds(h * d + c, bc)] = jnp.sum(mat * qc, axis=0)
                    # every thread has read it (in place where src == dst)
                    pallas_backend.barrier(interpret)
                    mat_ref[dst, h, :, pl.ds(c, bc)] = mat
                # the head's output whole: its RMS norm, gated by silu(z) (a replay's
                # goes nowhere: its row's place is written again by the row itself)
                pallas_backend.barrier(interpret)
                o = out_ref[r, pl.ds(h * d, d)]
                gate = jax.nn.silu(made(z_ref, pl.ds(h * d, d)))
                o = o * pallas_norm.rms_scale(jnp.sum(o * o), d, eps) * norm * gate
                pallas_backend.barrier(interpret)
                out_ref[r, pl.ds(h * d, d)] = o
            pallas_backend.barrier(interpret)   # this token's writes, before the next reads
            return carry

        lax.fori_loop(0, n + T, token, 0)

    def whole(a):
        return pl.BlockSpec(a.shape, lambda p, n=a.ndim: (0,) * n)

    ins = (taps, *inputs, rows, replay, n_replay, windows, matrices, pending)
    outs = (jax.ShapeDtypeStruct((T, H * d), jnp.float32), windows, matrices, pending)
    first = len(ins) - 3
    out, windows, matrices, pending = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in outs],
        grid=(Hk,),
        in_specs=[whole(a) for a in ins],
        out_specs=[whole(a) for a in outs],
        input_output_aliases={first: 1, first + 1: 2, first + 2: 3},
        # one stage: no load of a later token's is started before this token's stores
        **pallas_backend.options(interpret, num_warps=4, num_stages=1),
    )(*ins)
    return out, (windows, matrices, pending)
