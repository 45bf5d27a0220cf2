"""The pallas kernel's quantized matmul (kinetic/kernels/pallas_matmul.py), run by Pallas in
interpret mode on CPU: the dequantized tiles are the file's values bitwise, x is rounded as
llama.cpp's q8_0 rounds it, the product is the kernel's arithmetic in numpy and float64's
within that rounding, and a row's bits do not depend on the rows beside it."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from kinetic.kernels import pallas_matmul as pm
from kinetic.kernels import reference
from kinetic.model.quants import dequantize_bytes
from tests.tiny_models import random_blocks

FORMATS = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
           T.F32, T.F16, T.BF16]


@pytest.mark.parametrize("qtype", FORMATS)
def test_the_tiles_are_the_files_values_bitwise(qtype):
    N, K = 24, 512
    data = random_blocks(qtype, N, K)
    w = pm.repack(data, qtype, (N, K))
    assert w.shape == (N, K)
    got = np.asarray(pm.dequantize_tile(w.spec, w.q, *w.planes))[:N]
    assert got.tobytes() == dequantize_bytes(data, qtype, (N, K)).tobytes()
    if qtype in pm.HALF_SCALES:   # the file's half-float scales kept as they are: a Q4_0
        assert w.d.dtype == np.float16   # weight's planes are the file's bytes, no more
        planes = sum(a.nbytes for a in (w.q, *w.planes))
        rows = w.q.shape[0]              # (24 rows padded to 32)
        assert qtype != T.Q4_0 or planes == data.nbytes * rows // N == rows * K * 18 // 32
    elif w.d is not None:
        assert w.d.dtype == np.float32   # a K-quant's d * sub-block scale


def test_x_is_rounded_as_llama_cpps_q8_0():
    """quantize_x (in the kernel) gives each block of 32 the values layers.quantize_q8_0
    (the xla kernel's activations, the KV cache's q8_0) gives it, bitwise, ties to even;
    and the C++ kernel's numpy reference (reference.quantize_acts) the same integers and
    scales."""
    import jax.numpy as jnp

    from kinetic.model import layers
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((40, 32)) * rng.uniform(0.01, 100, (40, 1))).astype(np.float32)
    x[0] = 0.0                                             # a block of zeros: d 0, q 0
    x[1] = np.arange(32) - 15.5                            # max 16.5: many near-ties
    x[2, :] = 0.0
    x[2, 0], x[2, 1:4] = 127.0, [0.5, 1.5, -2.5]          # d 1: exact ties, to even
    q, d = pm.quantize_x(jnp.asarray(x))
    q, d = np.asarray(q), np.asarray(d)
    assert q.dtype == np.int8 and list(q[2, :4]) == [127, 0, 2, -2] and not q[0].any()
    want = np.asarray(layers.dequantize_q8_0(layers.quantize_q8_0(jnp.asarray(x))))
    assert (q * d).astype(np.float32).tobytes() == want.tobytes()
    acts = reference.quantize_acts("q8_0", x)
    assert np.array_equal(acts.q, q) and acts.d.tobytes() == d[:, :1].tobytes()


@pytest.mark.parametrize("qtype", FORMATS)
def test_the_product_is_its_arithmetic_and_float64s_within_rounding(qtype):
    """A block format's product is the kernel's arithmetic (x quantized per 32 as
    llama.cpp's q8_0, exact integer dots, then scaled: pallas_matmul.reference_arithmetic)
    to float32 rounding, and within x's quantization of float64's x @ W: each block of 32
    of x moves by at most half its d (max |x| / 127 / 2) per element. A float weight's
    is float64's within float32 rounding."""
    N, K = 64, 768   # three chunks of 256
    w = pm.repack(random_blocks(qtype, N, K, 1), qtype, (N, K))
    x = np.random.default_rng(2).standard_normal((5, K)).astype(np.float32)
    got = np.asarray(pm.matmul(x, w))
    dense = np.abs(np.asarray(pm.dequantize_tile(w.spec, w.q, *w.planes), np.float64)[:N])
    scale = np.abs(x).astype(np.float64) @ dense.T
    assert got.shape == (5, N) and got.dtype == np.float32
    mine = pm.reference_arithmetic(x, w)
    assert (np.abs(got - mine) <= 4e-6 * scale + 1e-30).all()
    quantization = 0.0
    if w.kind != "float":   # x's rounding: half a step of its block's d, per element
        dx = reference.quantize_acts("q8_0", x).d
        quantization = np.repeat(dx.astype(np.float64) / 2, 32, axis=1) @ dense.T
    assert (np.abs(got - pm.reference(x, w)) <= quantization * 1.0001 + 4e-6 * scale).all()


@pytest.mark.parametrize("qtype,K", [(q, 256) for q in FORMATS]
                         + [(q, 1024) for q in (T.Q4_0, T.Q6_K, T.BF16)])
def test_a_rows_bits_do_not_depend_on_its_batch(qtype, K):
    """Row r alone, and inside 2-, 7-, 64- and 100-row calls at different places: the same
    bits, from the decode variant (one 16-row dot a program) and the prompt variant (four,
    from 64 rows); at K 1024 the weight's K is split into two chunks (tiling)."""
    N = 32
    assert pm.tiling(N, K).chunks == max(1, K // 512)
    assert [pm.variant(M) for M in (1, 2, 7, 63, 64, 100)] == [1, 1, 1, 1, 4, 4]
    w = pm.repack(random_blocks(qtype, N, K, 3), qtype, (N, K))
    rows = np.random.default_rng(4).standard_normal((100, K)).astype(np.float32)
    alone = np.stack([np.asarray(pm.matmul(rows[r:r + 1], w))[0] for r in (0, 5, 17, 63)])
    for M in (2, 7, 64, 100):
        for at, r in enumerate((0, 5, 17, 63)):
            batch = np.roll(rows, -r, axis=0)[:M].copy()
            batch = np.roll(batch, at % M, axis=0)   # row r at place at % M
            got = np.asarray(pm.matmul(batch, w))[at % M]
            assert got.tobytes() == alone[at].tobytes(), (M, r)


@pytest.mark.parametrize("qtype,K", [(T.Q4_K, 256), (T.Q8_0, 1024), (T.F16, 256)])
def test_reading_x_in_place_gives_the_padded_blocks_bits(qtype, K):
    """A GPU reads x where it is, unpadded, rows past M masked off (in_place); interpreted,
    each program gets a padded block. Both run here, interpreted: every byte the same, at
    M of 1, 7, 16, 64 and 100 (the decode and the prompt variant, a split K at 1024)."""
    N = 32
    w = pm.repack(random_blocks(qtype, N, K, 7), qtype, (N, K))
    x = np.random.default_rng(8).standard_normal((100, K)).astype(np.float32)
    t = pm.tiling(w.q.shape[0], K)
    for M in (1, 7, 16, 64, 100):
        got = [np.asarray(pm._matmul(x[:M], (w.q,), (w.planes,), (w.spec,), True, (t,),
                                     pm.variant(M), in_place)[0])
               for in_place in (False, True)]
        assert got[0].shape == (M, N) and got[0].tobytes() == got[1].tobytes(), M


@pytest.mark.parametrize("N,K", [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960),
                                 (151936, 1536), (896, 4864), (576, 576), (48, 768)])
def test_a_weights_tiling_is_whole_tiles_and_chunks(N, K):
    """Real shapes (Qwen2.5-1.5B's, 0.5B's, SmolLM2's): bk 32, bn 32 (16 where 32 does not
    divide N), K in the fewest equal chunks of whole bk blocks, at least CHUNK elements
    each, that give a decode step PROGRAMS programs, else the most such chunks."""
    t = pm.tiling(N, K)
    assert t.bk == 32 and t.bn == (32 if N % 32 == 0 else 16)
    blocks = K // t.bk
    splits = [c for c in range(1, blocks + 1)
              if blocks % c == 0 and (c == 1 or K // c >= pm.CHUNK)]
    assert t.chunks in splits
    programs = [N // t.bn * c for c in splits]
    if programs[-1] < pm.PROGRAMS:
        assert t.chunks == splits[-1]
    else:
        assert t.chunks == splits[[p >= pm.PROGRAMS for p in programs].index(True)]
    assert N // t.bn * t.chunks >= pm.PROGRAMS or (N, K) in {(256, 1536), (576, 576),
                                                             (48, 768)}


def test_a_type_the_kernel_lacks_fails_naming_it():
    with pytest.raises(ValueError, match="no IQ4_NL matmul"):
        pm.repack(np.zeros(18, np.uint8), T.IQ4_NL, (1, 32))
    with pytest.raises(ValueError, match="bytes do not hold"):
        pm.repack(np.zeros(10, np.uint8), T.Q8_0, (1, 32))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.F16])
def test_rows_past_a_multiple_of_16_are_padded_and_dropped(qtype):
    """A [40, K] weight (a vocabulary of 32001 is not a multiple of 16 either): its planes
    are padded with zero rows to 48, and the product has its 40 columns, each as within
    rounding of float64 as any other."""
    N, K = 40, 256
    data = random_blocks(qtype, N, K, 5)
    w = pm.repack(data, qtype, (N, K))
    assert w.shape == (N, K) and w.q.shape[0] == 48
    assert not np.asarray(w.q[N:]).any()
    x = np.random.default_rng(6).standard_normal((3, K)).astype(np.float32)
    got = np.asarray(pm.matmul(x, w))
    assert got.shape == (3, N)
    dense = dequantize_bytes(data, qtype, (N, K)).astype(np.float64)
    if qtype == T.F16:
        want = x.astype(np.float64) @ dense.T
    else:   # x as the kernel quantizes it (reference_arithmetic)
        acts = reference.quantize_acts("q8_0", x)
        q, d = acts.q.astype(np.int64), acts.d
        want = (q.reshape(3, -1, 32) * d[..., None].astype(np.float64)).reshape(3, K) @ dense.T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("in_place", [False, True])
def test_weights_in_one_launch_give_each_weights_own_bits(in_place):
    """matmul_many: a q, k and v of three formats, shapes and tilings (K whole or split in
    two; bn 16 or 32; a weight of 40 rows, padded) in one kernel, each product the same
    bytes as its own call's, from the decode and the prompt variant, with x read in place
    (a GPU's way) and in padded blocks (interpreted). The first weight's 3 programs put
    the others' chunks at odd program ids."""
    K = 1024
    shapes = [(T.Q4_K, 48, pm.Tiling(16, 32, 1)), (T.Q8_0, 64, pm.Tiling(32, 32, 2)),
              (T.F16, 40, pm.Tiling(16, 32, 2))]
    ws = [pm.repack(random_blocks(q, n, K, 9 + i), q, (n, K))
          for i, (q, n, _) in enumerate(shapes)]
    tiles = tuple(t for *_, t in shapes)
    x = np.random.default_rng(10).standard_normal((70, K)).astype(np.float32)
    for M in (1, 7, 70):
        alone = [np.asarray(pm.matmul(x[:M], w, tiles=t)) for w, t in zip(ws, tiles)]
        got = pm._matmul(x[:M], tuple(w.q for w in ws), tuple(w.planes for w in ws),
                         tuple(w.spec for w in ws), True, tiles, pm.variant(M), in_place)
        for y, w, want in zip(got, ws, alone):
            assert np.asarray(y)[:, :w.shape[0]].tobytes() == want.tobytes(), M
    ys = pm.matmul_many(x[:3], ws)    # at the weights' own tilings
    assert [y.shape for y in ys] == [(3, 48), (3, 64), (3, 40)]
    for y, w in zip(ys, ws):
        assert np.asarray(y).tobytes() == np.asarray(pm.matmul(x[:3], w)).tobytes()


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("gate_type,down_type", [(T.Q4_0, T.Q6_K), (T.Q4_K, T.F16)])
def test_swiglu_in_two_launches_is_its_parts_bits(gate_type, down_type, in_place):
    """pallas_matmul.swiglu: gate and up in one launch, their partial sums read by the down
    projection's programs, which make silu(gate) * up themselves: the same bytes as the
    three matmuls with jax.nn.silu between, at the decode and the prompt variant, with x
    read in place (a GPU's way) and in padded blocks (interpreted). K is split in two for
    both halves (so each of gate and up is two partial sums) and for down."""
    D = F = 1024
    gate, up = (pm.repack(random_blocks(gate_type, F, D, s), gate_type, (F, D)) for s in (1, 2))
    down = pm.repack(random_blocks(down_type, D, F, 3), down_type, (D, F))
    assert pm.tiling(F, D).chunks == pm.tiling(D, F).chunks == 2
    x = np.random.default_rng(4).standard_normal((70, D)).astype(np.float32)
    for M in (1, 7, 70):
        want = np.asarray(pm.matmul(jax.nn.silu(pm.matmul(x[:M], gate))
                                    * pm.matmul(x[:M], up), down))
        shape = (in_place, None, 1, pm.dot_rows(M))
        halves = pm._matmul(x[:M], (gate.q, up.q), (gate.planes, up.planes),
                            (gate.spec, up.spec), True, (pm.tiling(F, D),) * 2,
                            pm.variant(M), *shape, 0, True)
        (got,) = pm._matmul(tuple(halves), (down.q,), (down.planes,), (down.spec,), True,
                            (pm.tiling(D, F),), pm.variant(M), *shape, M)
        assert np.asarray(got)[:, :D].tobytes() == want.tobytes(), M
        assert np.asarray(pm.swiglu(x[:M], gate, up, down)).tobytes() == want.tobytes(), M
        # its partial sums (a residual's add_norm reads them), added in order: the same
        parts = np.asarray(pm.swiglu(x[:M], gate, up, down, partials=True))
        assert parts.shape[0] == 2 and (parts[0] + parts[1])[:M, :D].tobytes() == want.tobytes()


@pytest.mark.parametrize("qtype,N", [(T.Q4_0, 64), (T.Q4_K, 40), (T.Q6_K, 32)])
def test_experts_pairs_get_each_experts_own_bits(qtype, N, monkeypatch):
    """matmul_experts: every (row, chosen expert) pair's product in one launch is the bytes
    of that row alone times that expert alone (matmul of Planes.expert), whether its
    expert was chosen once, by more than a block of 16 pairs (the first expert: 20 rows) or
    not at all; the pairs sorted into blocks by expert, and each its own block (a decode
    step's few pairs: PAIR_BLOCKS); K split in two chunks; 40 rows a weight: each expert
    padded to 48 and stacked."""
    E, K = 5, 1024
    raw = np.concatenate([random_blocks(qtype, N, K, 20 + e) for e in range(E)])
    w = pm.repack_experts(raw, qtype, (E, N, K))
    assert (w.experts, w.shape, w.q.shape[0]) == (E, (N, K), E * -(-N // 16) * 16)
    rng = np.random.default_rng(11)
    ids = np.stack([rng.permutation([0, 1, 2, 4])[:2] for _ in range(23)]).astype(np.int32)
    ids[:20, 0] = 0         # expert 0 chosen by 20 rows, expert 3 by none
    x = rng.standard_normal((23, K)).astype(np.float32)
    alone = [[np.asarray(pm.matmul(x[r:r + 1], w.expert(int(ids[r, s]))))[0]
              for s in range(2)] for r in range(23)]
    for each_alone in (False, True):
        monkeypatch.setattr(pm, "PAIR_BLOCKS", 64 if each_alone else 0)
        assert (pm.pair_blocks(ids, E).rows is None) == each_alone
        got = np.asarray(pm.matmul_experts(x, ids, [w])[0])
        assert got.shape == (23, 2, N)
        for r in range(23):
            for s in range(2):
                assert got[r, s].tobytes() == alone[r][s].tobytes(), (r, s, each_alone)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.F16])
def test_experts_swiglu_is_each_experts_own_swiglu(qtype, monkeypatch):
    """swiglu_experts: every pair's down(silu(gate) * up) in two launches (the product made
    inside down's programs) is the bytes of swiglu of that row alone with that expert's
    three weights alone, the pairs in blocks by expert and each its own block; and the
    decode-sized call (3 rows of 2 pairs) needs no sort and no gather."""
    E, D, F = 4, 512, 64
    rng = np.random.default_rng(5)

    def stacked(N, K, seed):
        if qtype == T.F16:
            raw = rng.standard_normal((E * N, K)).astype(np.float16) * 0.1
        else:
            raw = np.concatenate([random_blocks(qtype, N, K, seed + e) for e in range(E)])
        return pm.repack_experts(raw, qtype, (E, N, K))
    gate, up, down = stacked(F, D, 1), stacked(F, D, 9), stacked(D, F, 17)
    ids = np.array([[1, 3], [1, 0], [2, 1]] * 4, np.int32)      # 12 rows, 24 pairs
    x = rng.standard_normal((12, D)).astype(np.float32)
    alone = [[np.asarray(pm.swiglu(x[r:r + 1], *(w.expert(int(ids[r, s]))
                                                   for w in (gate, up, down))))[0]
              for s in range(2)] for r in range(12)]
    for each_alone in (False, True):
        monkeypatch.setattr(pm, "PAIR_BLOCKS", 64 if each_alone else 0)
        got = np.asarray(pm.swiglu_experts(x, ids, gate, up, down))
        assert got.shape == (12, 2, D)
        for r in range(12):
            for s in range(2):
                assert got[r, s].tobytes() == alone[r][s].tobytes(), (r, s, each_alone)
    monkeypatch.setattr(pm, "PAIR_BLOCKS", 32)
    text = jax.jit(lambda x, ids: pm.swiglu_experts(x, ids, gate, up, down)).lower(
        x[:3], ids[:3]).as_text()
    assert pm.pair_blocks(ids[:3], E).rows is None and "stablehlo.sort" not in text


@pytest.mark.parametrize("qtype,K", [(T.Q4_0, 1024), (T.Q6_K, 256), (T.F16, 256)])
def test_a_smaller_decode_dot_gives_a_row_the_same_bits(qtype, K, monkeypatch):
    """dot_rows with DECODE_ROWS below 16: a decode call's dots of fewer rows (its M's next
    power of 2, at least DECODE_ROWS) give each row the bits of the 16-row dots, at 1 to
    8 rows, x in place and in padded blocks. A block format's dots are exact integers:
    from one-row dots up, anywhere. A float weight's (F16): on a GPU from one row up (the
    device check runs this file compiled); interpreted from two, as XLA's CPU dot
    computes a one-row product another way (a matrix-vector product), with other bits,
    which says nothing of a GPU's."""
    import jax
    interpreted = jax.default_backend() != "gpu"
    smallest = 2 if interpreted and qtype == T.F16 else 1
    N = 32
    w = pm.repack(random_blocks(qtype, N, K, 12), qtype, (N, K))
    t = pm.tiling(N, K)
    x = np.random.default_rng(13).standard_normal((8, K)).astype(np.float32)
    for M in (1, 2, 3, 5, 8):
        want = np.asarray(pm.matmul(x[:M], w))
        for least in (1, 2, 4, 8):
            monkeypatch.setattr(pm, "DECODE_ROWS", least)
            rows = pm.dot_rows(M)
            assert rows == max(least, 1 << (M - 1).bit_length()) and rows >= M
            if rows < smallest:
                continue
            for in_place in (False, True):
                got = pm._matmul(x[:M], (w.q,), (w.planes,), (w.spec,), interpreted, (t,),
                                 1, in_place, None, 1, rows)[0]
                assert np.asarray(got).tobytes() == want.tobytes(), (M, rows, in_place)
            monkeypatch.setattr(pm, "DECODE_ROWS", 16)
    assert pm.dot_rows(1) == pm.dot_rows(16) == 16 and pm.dot_rows(100) == 16
    monkeypatch.setenv("KINETIC_PALLAS_DECODE_ROWS", "2")
    assert [pm.dot_rows(M) for M in (1, 3, 9, 16)] == [2, 4, 16, 16]
    monkeypatch.setenv("KINETIC_PALLAS_DECODE_ROWS", "3")
    with pytest.raises(ValueError, match="1, 2, 4, 8 or 16"):
        pm.dot_rows(1)


@pytest.mark.parametrize("M", [1, 7, 70])
@pytest.mark.parametrize("chunks,bias", [(None, False), (1, False), (3, True)])
def test_a_norm_inside_the_projections_launch_is_the_norm_kernels_bits(M, chunks, bias):
    """matmul_many and swiglu with norm: the residual add and the RMS norm before a
    layer's projections made by the projections' own programs (no launch of their own on
    a GPU). The products, the new residual h and (normed) the normalized x are the bytes of
    pallas_norm.add_rms_norm (or rms_norm, with no parts) then the projections apart, with a weight whose K is
    split in two and one whose is whole, at the decode and the prompt variant (70 rows:
    4 dots a program); and a row's bytes are its own whichever rows share the call."""
    import jax.numpy as jnp

    from kinetic.kernels import pallas_norm as pn
    K, eps = 1536, 1e-6
    rng = np.random.default_rng(M + (chunks or 0))
    ws = [pm.repack(random_blocks(T.Q4_0, 64, K, 21), T.Q4_0, (64, K)),
          pm.repack(random_blocks(T.Q6_K, 32, K, 22), T.Q6_K, (32, K))]
    tiles = [pm.Tiling(32, 32, 2), pm.Tiling(32, 32, 1)]
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(K), jnp.float32)
    parts = None if chunks is None else jnp.asarray(
        rng.standard_normal((chunks, 16 * -(-M // 16), K + 32)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(K), jnp.float32) if bias else None
    if parts is None:
        h_want, y = x, pn.rms_norm(x, w, eps)
    else:
        h_want, y = pn.add_rms_norm(x, parts, b, w, eps)
    want = [np.asarray(pm.matmul(y, v, tiles=t)) for v, t in zip(ws, tiles)]
    got, h = pm.matmul_many(x, ws, tiles=tiles, norm=(parts, b, w, eps))
    for g, v, wnt in zip(got, ws, want):
        assert np.asarray(g).tobytes() == wnt.tobytes()
    assert (h is None) == (parts is None)
    if h is not None:
        assert np.asarray(h).tobytes() == np.asarray(h_want).tobytes()
    # normed: the call's first program writes the normalized x too (a mixture's router
    # hands it to the experts), the norm kernel's bytes
    got2, h2, y2 = pm.matmul_many(x, ws, tiles=tiles, norm=(parts, b, w, eps), normed=True)
    assert np.asarray(y2).tobytes() == np.asarray(y).tobytes()
    assert np.asarray(got2[0]).tobytes() == np.asarray(got[0]).tobytes()
    assert (h2 is None) == (parts is None)
    if M > 1:   # the last row alone: its own bytes
        last = None if parts is None else parts[:, M - 1:M]
        one, _ = pm.matmul_many(x[M - 1:], ws, tiles=tiles, norm=(last, b, w, eps))
        assert np.asarray(one[0]).tobytes() == np.asarray(got[0])[M - 1:].tobytes()
    gate, up = (pm.repack(random_blocks(T.Q4_0, 256, K, s), T.Q4_0, (256, K)) for s in (5, 6))
    down = pm.repack(random_blocks(T.Q4_0, K, 256, 7), T.Q4_0, (K, 256))
    f, h2 = pm.swiglu(x, gate, up, down, norm=(parts, b, w, eps))
    assert np.asarray(f).tobytes() == np.asarray(pm.swiglu(y, gate, up, down)).tobytes()
    assert (h2 is None) == (parts is None)


@pytest.mark.parametrize("M", [1, 7])
def test_a_post_norm_inside_the_projections_launch_is_the_norm_kernels_bits(M):
    """matmul_many and swiglu with norm's w_post (Gemma 3's norm after a projection): h = x +
    rms_norm(parts' sum, w_post), and the products of rms_norm(h, w), made by the
    projections' programs, are the bytes of pallas_norm.post_add_rms_norm (the launch a
    prompt step makes) then the projections apart; a row's bytes its own."""
    import jax.numpy as jnp

    from kinetic.kernels import pallas_norm as pn
    K, eps = 1536, 1e-6
    rng = np.random.default_rng(40 + M)
    ws = [pm.repack(random_blocks(T.Q4_0, 64, K, 31), T.Q4_0, (64, K))]
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    w, w_post = (jnp.asarray(rng.standard_normal(K), jnp.float32) for _ in range(2))
    parts = jnp.asarray(rng.standard_normal((2, 16, K + 32)), jnp.float32)
    h_want, y = pn.post_add_rms_norm(x, parts, None, w_post, w, eps)
    got, h = pm.matmul_many(x, ws, norm=(parts, None, w, eps, w_post))
    assert np.asarray(h).tobytes() == np.asarray(h_want).tobytes()
    assert np.asarray(got[0]).tobytes() == np.asarray(pm.matmul(y, ws[0])).tobytes()
    one, _ = pm.matmul_many(x[M - 1:], ws, norm=(parts[:, M - 1:M], None, w, eps, w_post))
    assert np.asarray(one[0]).tobytes() == np.asarray(got[0])[M - 1:].tobytes()
    gate, up = (pm.repack(random_blocks(T.Q8_0, 256, K, s), T.Q8_0, (256, K)) for s in (5, 6))
    down = pm.repack(random_blocks(T.Q4_0, K, 256, 7), T.Q4_0, (K, 256))
    f, h2 = pm.swiglu(x, gate, up, down, norm=(parts, None, w, eps, w_post), act="gelu")
    assert np.asarray(h2).tobytes() == np.asarray(h_want).tobytes()
    want = pm.swiglu(y, gate, up, down, act="gelu")
    assert np.asarray(f).tobytes() == np.asarray(want).tobytes()


def test_geglu_in_two_launches_is_its_parts_bits():
    """pallas_matmul.swiglu with act "gelu" (layers.geglu_ffn on a GPU: Gemma's
    feed-forward): the down projection's programs make gelu_tanh(gate) * up of the partial
    sums they read, the same bytes as the three matmuls with layers.gelu_tanh between, at
    the decode and the prompt variant."""
    import jax.numpy as jnp

    from kinetic.model import layers
    D = F = 1024
    gate, up = (pm.repack(random_blocks(T.Q8_0, F, D, s), T.Q8_0, (F, D)) for s in (1, 2))
    down = pm.repack(random_blocks(T.Q4_0, D, F, 3), T.Q4_0, (D, F))
    x = np.random.default_rng(5).standard_normal((70, D)).astype(np.float32)
    for M in (1, 7, 70):
        want = jax.jit(lambda x: pm.matmul(layers.gelu_tanh(pm.matmul(x, gate))
                                           * pm.matmul(x, up), down))(jnp.asarray(x[:M]))
        got = pm.swiglu(x[:M], gate, up, down, act="gelu")
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), M
        silu = pm.swiglu(x[:M], gate, up, down)
        assert np.asarray(silu).tobytes() != np.asarray(got).tobytes()
