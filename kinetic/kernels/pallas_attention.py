"""Paged attention as a Pallas kernel: the attention of the GPU kernel "pallas" (issue 38).

    out = paged_attention(q, k_cache, v_cache, page_table, slots, positions, scale,
                          window=0, softcap=0.0, ends=None)          [T, H, Qv] float32

over kinetic's paged KV cache (kinetic/engine/runner.py: per layer k and v pages
[num_pages, page_size, n_kv_head, head_dim], each slot's pages in its row of page_table).
One program per (row, kv head), its query heads padded to `group_rows`, walks that row's
own visible keys, page by page of its slot in order, with an online softmax (running
maximum, sum and weighted values in float32, one dot per page of the same shape): a row's
arithmetic depends only on its own query, position and slot's keys, never on T, on the
other rows, or on the page table's width. On a GPU (`split_lanes`) a row's pages are
dealt to 8 lanes instead (page i to lane i mod 8), a program per (row, kv head, lane), and
a second kernel merges the lanes in order (`_split_attention`): the same property, more
programs for a decode step's few rows. Its bits are not the XLA path's
(layers.paged_attention kernel "xla" normalises once over all keys), so it is checked
against that within float32 rounding, and bitwise against itself alone and in
larger steps (tests/test_pallas_attention.py, Pallas in interpret mode on CPU).

Masking follows layers.paged_attention: a row sees keys up to its `ends` entry (its position
unless an image's rows attend both ways), and with a window only keys after position -
window; the query meets the cache in the cache's storage type, as llama.cpp's f16 cache
makes it.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    page_table: jax.Array, slots: jax.Array, positions: jax.Array,
                    scale: float, window: int = 0, softcap: float = 0.0,
                    ends: jax.Array | None = None, gate: jax.Array | None = None,
                    interpret: bool | None = None, split: int | None = None) -> jax.Array:
    """q [T, H, Q] against each row's slot's keys (module docstring) -> [T, H, Qv]. gate
    (Qwen3.5's gated attention): the q projection's partial sums [C, >= T, >= 2 H Qv], each
    head's q then its output gate (pallas_rope's q_gated); each head's output is then
    multiplied by sigmoid(its gate), the partial sums added in order (layers.Pending.value's
    order) in the program that writes it, where XLA had a kernel of its own. split: a row's
    keys in that many lanes (page i in lane i % split), a program each, the lanes then
    merged in order (`_split_attention`); 0: one program walks them all; None:
    `split_lanes(interpret)`."""
    interpret = pallas_backend.interpreted(interpret)
    positions = jnp.asarray(positions, jnp.int32)
    ends = positions if ends is None else jnp.asarray(ends, jnp.int32)
    T, H, Q = q.shape
    K = k_cache.shape[2]
    G, GP = H // K, group_rows(H // K)
    q = q.astype(k_cache.dtype)   # (as float32 in the kernel: exact; a GPU's rope_write
                                  # gives q in this type, so no XLA kernel converts it)
    in_place = not interpret
    if not in_place:   # (interpreted: each kv head's query rows padded to a block of GP)
        q = jnp.pad(q.reshape(T, K, G, Q),
                    ((0, 0), (0, 0), (0, GP - G), (0, 0))).reshape(T, K * GP, Q)
    if gate is not None and q.shape[-1] != v_cache.shape[-1]:
        raise ValueError("an output gate needs a value head as wide as a query head")
    gate = None if gate is None else jnp.asarray(gate, jnp.float32)
    args = (q, k_cache, v_cache, jnp.asarray(page_table, jnp.int32),
            jnp.asarray(slots, jnp.int32), positions, ends, float(scale), int(window),
            float(softcap), bool(interpret), in_place, G)
    lanes = split_lanes(interpret) if split is None else split
    out = (_attention(*args, gate) if not lanes
           else _split_attention(*args, lanes, gate))
    return out if in_place else out.reshape(T, K, GP, -1)[:, :, :G].reshape(T, H, -1)


def group_rows(G: int) -> int:
    """The query rows a program holds for a kv head's G query heads: G padded with zero rows
    to a power of 2, at least 16 (Triton's blocks are powers of 2 and its dots at least 16
    on a side). Fixed by the model's shape, so a row's arithmetic is too."""
    return max(16, 1 << (G - 1).bit_length())


def launch(width: int) -> tuple[int, int]:
    """(warps, pipeline stages) of a program over heads `width` wide. Up to 128: 4 warps, 2
    stages (the next page's keys and values fetched while this one's are used). Wider (256:
    Gemma 3's, Qwen3.5's attention), 8 warps and 1 stage: at sm_90a, 16 query rows of 256
    with 2 stages spilled 4520 bytes (32 registers, PyPI's Triton 3.9.0), with 1 stage none
    (151 registers at 4 warps, 80 at 8; bench/triton_sm90.py). Speed only: a row's
    arithmetic is the same code for every row count either way."""
    return (4, 2) if width <= 128 else (8, 1)


SPLIT_LANES = 8   # a GPU's programs a row and kv head: page i of a row's keys in lane i % 8


def split_lanes(interpret: bool) -> int:
    """Programs a row and kv head take on a GPU (`_split_attention`), 0 for one program over
    all of a row's keys (`_attention`). KINETIC_GPU_ATTENTION: `split` (the default) or
    `whole`; interpreted (a CPU), `whole` unless the variable says `split`. Decided at each
    trace. A decode step's row has a kv head's keys walked by one program otherwise: at
    Qwen2.5-1.5B's shape 2 programs a layer, 33 pages in a chain at position 512, on a GPU
    of 132 multiprocessors."""
    text = os.environ.get("KINETIC_GPU_ATTENTION")
    if text not in (None, "split", "whole"):
        raise ValueError(f"KINETIC_GPU_ATTENTION={text!r}: split or whole")
    return SPLIT_LANES if (text or ("whole" if interpret else "split")) == "split" else 0


def _whole(shape) -> pl.BlockSpec:
    """A pallas_call operand every program reads whole, whatever its grid."""
    return pl.BlockSpec(shape, lambda *ids: (0,) * len(shape))


def _query(q_ref, t, kh, heads, G, Q, scale, in_place):
    """A program's query rows [G, Q] in float32, scaled (rows past its heads zeros)."""
    if in_place:
        live = lax.broadcasted_iota(jnp.int32, (G, Q), 0) < heads
        return pltriton.load(q_ref.at[t, pl.ds(kh * heads, G), pl.ds(0, Q)], mask=live,
                             other=0.0).astype(jnp.float32) * scale
    return q_ref[0].astype(jnp.float32) * scale


def _pages(qs, k_ref, v_ref, table_ref, slot, kh, first, end, lo, n, page_size, softcap,
           stride=1):
    """(running maximum [G], sum [G], weighted values [G, Qv]) of the online softmax over
    the slot's pages lo, lo + stride, ... (n of them) in order, keys first .. end visible."""
    G, Qv = qs.shape[0], v_ref.shape[-1]

    def page(k, carry):
        m, total, acc = carry
        i = lo + k * stride
        at = table_ref[slot, i]
        keys = k_ref[at, :, kh, :].astype(jnp.float32)          # [page_size, Q]
        vals = v_ref[at, :, kh, :].astype(jnp.float32)          # [page_size, Qv]
        s = lax.dot_general(qs, keys, (((1,), (1,)), ((), ())),
                            precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)  # [G, page_size]
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
        key = i * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        s = jnp.where((key <= end) & (key >= first), s, -jnp.inf)
        new_m = jnp.maximum(m, jnp.max(s, axis=1))
        safe = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
        p = jnp.exp(s - safe[:, None])
        keep = jnp.exp(m - safe)
        total = total * keep + jnp.sum(p, axis=1)
        acc = acc * keep[:, None] + lax.dot_general(
            p, vals, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32)
        return new_m, total, acc

    return lax.fori_loop(0, n, page, (jnp.full((G,), -jnp.inf, jnp.float32),
                                        jnp.zeros((G,), jnp.float32),
                                        jnp.zeros((G, Qv), jnp.float32)))


def _finish(out, gate_ref, o_ref, t, kh, heads, G, Q, Qv, in_place):
    """Store a program's output rows [G, Qv], each head's multiplied by sigmoid(its gate)
    first where there is a gate (a row of the block each)."""
    if gate_ref is not None:
        row = lax.broadcasted_iota(jnp.int32, (G, Qv), 0)
        gates = jnp.zeros((G, Qv), jnp.float32)
        for g in range(heads):
            at = pl.ds((kh * heads + g) * 2 * Q + Q, Qv)   # (Q == Qv here)
            gates = jnp.where(row == g, pallas_backend.load_sum(gate_ref, (t, at))[None],
                              gates)
        out = out * jax.nn.sigmoid(gates)
    if in_place:
        pltriton.store(o_ref.at[t, pl.ds(kh * heads, G), pl.ds(0, Qv)], out,
                       mask=lax.broadcasted_iota(jnp.int32, (G, Qv), 0) < heads)
    else:
        o_ref[0] = out


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10, 11, 12, 13))
def _split_attention(q, k_cache, v_cache, table, slots, positions, ends, scale, window,
                     softcap, interpret, in_place, heads, lanes, gate=None):
    """_attention's result with a row's keys in `lanes` lanes (flash decoding): page i of
    the row's visible keys goes to lane i % lanes, a program per (row, kv head, lane) makes
    its lane's running maximum, sum and weighted values over its pages in order (empty
    where the row has none), and a program per (row, kv head) merges the lanes in order,
    first to last. The lanes are fixed by page index, so a row's arithmetic depends on its
    own position and keys alone, never on T, the other rows or the page table's width: the
    same bits for a row at every row count, decode or prompt
    (tests/test_pallas_attention.py), not _attention's (the sums are grouped by lane). Two
    launches; the lanes' partial results are T x K x lanes x G x (Qv + 2) float32, whatever
    the context (chunks of a fixed length would grow them with it)."""
    T, _, Q = q.shape
    _, page_size, K, Qv = v_cache.shape
    G = group_rows(heads)
    L = lanes

    def part(q_ref, k_ref, v_ref, table_ref, slot_ref, pos_ref, end_ref, m_ref, l_ref,
             a_ref):
        t, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        slot, pos, end = slot_ref[t], pos_ref[t], end_ref[t]
        qs = _query(q_ref, t, kh, heads, G, Q, scale, in_place)
        first = jnp.maximum(pos - window + 1, 0) if window else 0
        p0, p1 = first // page_size, end // page_size + 1     # the row's pages
        lo = p0 + (j - p0 % L + L) % L                         # its first in lane j
        n = jnp.maximum(p1 - lo + L - 1, 0) // L
        m, total, acc = _pages(qs, k_ref, v_ref, table_ref, slot, kh, first, end, lo, n,
                               page_size, softcap, stride=L)
        m_ref[0, 0, 0] = m
        l_ref[0, 0, 0] = total
        a_ref[0, 0, 0] = acc

    def mine(shape):   # a (row, kv head, lane)'s block of a [T, K, L, ...] array
        return pl.BlockSpec((1, 1, 1, *shape), lambda t, kh, j: (t, kh, j) + (0,) * len(shape))

    m, total, acc = pl.pallas_call(
        part,
        out_shape=(jax.ShapeDtypeStruct((T, K, L, G), jnp.float32),
                   jax.ShapeDtypeStruct((T, K, L, G), jnp.float32),
                   jax.ShapeDtypeStruct((T, K, L, G, Qv), jnp.float32)),
        grid=(T, K, L),
        in_specs=[_whole(q.shape) if in_place else pl.BlockSpec(
                      (1, G, Q), lambda t, kh, j: (t, kh, 0)),
                  _whole(k_cache.shape), _whole(v_cache.shape), _whole(table.shape),
                  _whole(slots.shape), _whole(positions.shape), _whole(ends.shape)],
        out_specs=(mine((G,)), mine((G,)), mine((G, Qv))),
        **pallas_backend.options(interpret, *launch(max(Q, Qv))),
    )(q, k_cache, v_cache, table, slots, positions, ends)

    def merge(m_ref, l_ref, a_ref, *refs):
        gate_ref, o_ref = refs if gate is not None else (None, *refs)
        t, kh = pl.program_id(0), pl.program_id(1)

        def one(j, carry):   # in order; an empty lane (-inf, 0, 0) changes nothing
            mm, ll, aa = carry
            m_j = m_ref[t, kh, pl.ds(j, 1)][0]
            l_j = l_ref[t, kh, pl.ds(j, 1)][0]
            a_j = a_ref[t, kh, pl.ds(j, 1)][0]
            new = jnp.maximum(mm, m_j)
            safe = jnp.where(jnp.isfinite(new), new, 0.0)
            old, this = jnp.exp(mm - safe), jnp.exp(m_j - safe)
            return new, ll * old + l_j * this, aa * old[:, None] + a_j * this[:, None]

        # (a loop, not unrolled: one body whose arithmetic the compiler treats alike in
        # every program and every caller's kernel)
        mm, ll, aa = lax.fori_loop(0, L, one, (jnp.full((G,), -jnp.inf, jnp.float32),
                                              jnp.zeros((G,), jnp.float32),
                                              jnp.zeros((G, Qv), jnp.float32)))
        _finish(aa / jnp.maximum(ll, 1e-30)[:, None], gate_ref, o_ref, t, kh, heads, G, Q,
                Qv, in_place)

    rows = q.shape[1] if in_place else K * G
    return pl.pallas_call(
        merge,
        out_shape=jax.ShapeDtypeStruct((T, rows, Qv), jnp.float32),
        grid=(T, K),
        in_specs=[_whole(m.shape), _whole(total.shape), _whole(acc.shape)]
                 + ([] if gate is None else [_whole(gate.shape)]),
        out_specs=(_whole((T, rows, Qv)) if in_place
                   else pl.BlockSpec((1, G, Qv), lambda t, kh: (t, kh, 0))),
        **pallas_backend.options(interpret, *launch(Qv)),
    )(m, total, acc, *([] if gate is None else [gate]))


@functools.partial(jax.jit, static_argnums=(7, 8, 9, 10, 11, 12))
def _attention(q, k_cache, v_cache, table, slots, positions, ends, scale, window, softcap,
               interpret, in_place, heads, gate=None):
    """heads: a kv head's query heads. in_place: q [T, H, Q] is read and the output
    [T, H, Qv] written where they are, a program's GP rows from its kv head's first, the
    rows past its heads masked off (a GPU's way: no padded copy of q, no slice of the
    output, kernels of their own, around each layer's attention); else q is [T, K * GP, Q],
    each kv head's rows padded (interpreted: a masked load there pads the array it reads).
    The same values reach the same arithmetic either way (tests/test_pallas_attention.py).
    gate: paged_attention's (q's projection's partial sums), or None."""
    T, _, Q = q.shape
    _, page_size, K, Qv = v_cache.shape
    G = group_rows(heads)                       # query rows per kv head, padded

    def kernel(q_ref, k_ref, v_ref, table_ref, slot_ref, pos_ref, end_ref, *refs):
        gate_ref, o_ref = refs if gate is not None else (None, *refs)
        t, kh = pl.program_id(0), pl.program_id(1)
        slot, pos, end = slot_ref[t], pos_ref[t], end_ref[t]
        qs = _query(q_ref, t, kh, heads, G, Q, scale, in_place)
        first = jnp.maximum(pos - window + 1, 0) if window else 0   # first visible key
        lo = first // page_size
        m, total, acc = _pages(qs, k_ref, v_ref, table_ref, slot, kh, first, end, lo,
                               end // page_size + 1 - lo, page_size, softcap)
        _finish(acc / jnp.maximum(total, 1e-30)[:, None], gate_ref, o_ref, t, kh, heads, G,
                Q, Qv, in_place)

    rows = q.shape[1] if in_place else K * G
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((T, rows, Qv), jnp.float32),
        grid=(T, K),
        in_specs=[_whole(q.shape) if in_place else pl.BlockSpec((1, G, Q),
                                                                lambda t, kh: (t, kh, 0)),
                  _whole(k_cache.shape), _whole(v_cache.shape), _whole(table.shape),
                  _whole(slots.shape), _whole(positions.shape), _whole(ends.shape)]
                 + ([] if gate is None else [_whole(gate.shape)]),
        out_specs=(_whole((T, rows, Qv)) if in_place
                   else pl.BlockSpec((1, G, Qv), lambda t, kh: (t, kh, 0))),
        **pallas_backend.options(interpret, *launch(max(Q, Qv))),
    )(q, k_cache, v_cache, table, slots, positions, ends, *([] if gate is None else [gate]))
    return out
