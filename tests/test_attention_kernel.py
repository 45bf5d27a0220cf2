"""The C++ paged attention (kinetic/kernels/attention.py, csrc/attention.h).

(a) batch invariance: a row's output bits are the same alone as inside steps of any T, with
    other rows and slots around it, at any slot index and page-table width;
(b) the same bits on every ISA path and thread count (C ABI) and through jit;
(c) bitwise equal to the numpy reference, which does the same float32 operations in the same
    order, its exp written out in the same float32 operations (exp_softmax) and its softcap's
    tanhf the same libm function, called through ctypes;
(d) within 1e-5 relative of layers.paged_attention (XLA; a different order of sums);
(e) bad indices are an error with a message, never a crash;
(f) a prompt chunk's rows (one slot, consecutive positions), which share one unit's key work,
    give the bits each row gets on its own (max_group=1), on every ISA and thread count;
(g) a float16 cache holding every finite half reads the same on every path (the SIMD paths
    convert with F16C, the scalar one in software);
(i) a q8_0 cache (blocks of 32: an f16 scale, 32 int8; the query quantized alike): equal to
    the reference bitwise on every path and thread count, batch invariant, close to the XLA
    path, and refused where a head is not a multiple of 32 wide;
(h) rows whose end (last visible key) is past their position, as an image that attends to
    itself both ways gives them (Gemma 3's): equal to the reference bitwise on every path,
    thread count and group size, each row's bits its own, close to layers.paged_attention's
    XLA path; rows whose end is their position keep the causal bits; a bad end is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import kinetic.kernels as kk
from kinetic.kernels import KernelError
from kinetic.kernels import attention as A
from kinetic.kernels import reference as R
from kinetic.model import layers

pytestmark = pytest.mark.skipif(not kk.available(), reason="the C++ kernel is not built")

DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
PAGES, PS = 24, 4  # cache pages, page size


def cache(rng, K, Q, Qv, dtype, pages=PAGES):
    k = rng.standard_normal((pages, PS, K, Q)).astype(np.float32)
    v = rng.standard_normal((pages, PS, K, Qv)).astype(np.float32)
    return k.astype(dtype), v.astype(dtype)


def step_input(page_table, slots, positions) -> layers.StepInput:
    T = len(slots)
    return layers.StepInput(tokens=jnp.zeros(T, jnp.int32),
                            positions=jnp.asarray(positions, jnp.int32),
                            slots=jnp.asarray(slots, jnp.int32),
                            write_index=jnp.zeros(T, jnp.int32),
                            page_table=jnp.asarray(page_table, jnp.int32))


_kernel_jit = jax.jit(A.paged_attention, static_argnums=(4, 5, 6))
_layers_jit = jax.jit(layers.paged_attention, static_argnums=(4, 5, 6))


def jitted(q, k, v, page_table, slots, positions, scale, window=0, softcap=0.0, fn=_kernel_jit,
           ends=None):
    """The kernel through jit and the XLA FFI (what the engine calls)."""
    more = {} if ends is None else {"ends": jnp.asarray(ends, jnp.int32)}
    return np.asarray(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                         step_input(page_table, slots, positions), scale, window, softcap,
                         **more))


@pytest.mark.parametrize("dtype,window,softcap", [("f32", 0, 0.0), ("f16", 5, 0.0),
                                                  ("bf16", 0, 3.0)])
def test_row_is_batch_invariant(dtype, window, softcap):
    rng = np.random.default_rng(1)
    H, K, Q, Qv, scale = 6, 2, 16, 8, 0.25
    k, v = cache(rng, K, Q, Qv, DTYPES[dtype])
    pos = 13  # the row sees keys 0..13: pages 0..3 of its slot
    own = rng.permutation(PAGES)[:4].astype(np.int32)
    q_row = rng.standard_normal((1, H, Q)).astype(np.float32)
    alone = jitted(q_row, k, v, own[None], [0], [pos], scale, window, softcap)[0]
    for T in (2, 3, 4, 7, 16, 64):
        for S in (1, 3):
            for P in (4, 6, 9):  # just covering the row, and wider
                table = rng.integers(0, PAGES, (S, P)).astype(np.int32)
                mine = int(rng.integers(0, S))
                table[mine, :4] = own
                slots = rng.integers(0, S, T).astype(np.int32)
                positions = rng.integers(0, P * PS, T).astype(np.int32)
                at = int(rng.integers(0, T))
                slots[at], positions[at] = mine, pos
                q = rng.standard_normal((T, H, Q)).astype(np.float32)
                q[at] = q_row[0]
                got = jitted(q, k, v, table, slots, positions, scale, window, softcap)[at]
                assert np.array_equal(got, alone), (T, S, P)


def random_case(rng, T, H, K, Q, Qv, dtype, S=3, P=7):
    k, v = cache(rng, K, Q, Qv, DTYPES[dtype])
    table = rng.integers(0, PAGES, (S, P)).astype(np.int32)
    slots = rng.integers(0, S, T).astype(np.int32)
    positions = rng.integers(0, P * PS, T).astype(np.int32)
    positions[0] = 0  # a row that sees one key
    q = rng.standard_normal((T, H, Q)).astype(np.float32)
    return q, k, v, table, slots, positions


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
def test_same_bits_on_every_isa_and_thread_count(dtype):
    rng = np.random.default_rng(2)
    # Q and Qv not multiples of the lane counts; P * PS = 84 keys spans two key blocks
    case = random_case(rng, 9, 9, 3, 20, 13, dtype, P=21)
    for window, softcap in [(0, 0.0), (7, 0.0), (0, 2.5)]:
        args = (*case, 0.3, window, softcap)
        base = A.attention_host(*args, isa="scalar", threads=1)
        for isa in kk.supported_isas():
            for threads in (1, 2):
                got = A.attention_host(*args, isa=isa, threads=threads)
                assert np.array_equal(got, base), (isa, threads, window, softcap)
        assert np.array_equal(jitted(*args), base)


@pytest.mark.parametrize("dtype,window,softcap", [("f32", 0, 0.0), ("f16", 0, 0.0),
                                                  ("bf16", 6, 0.0), ("f32", 3, 4.0)])
def test_matches_numpy_reference_bitwise(dtype, window, softcap):
    rng = np.random.default_rng(3)
    case = random_case(rng, 5, 4, 2, 24, 12, dtype)
    args = (*case, 0.2, window, softcap)
    assert np.array_equal(A.attention_host(*args), A.reference_attention(*args))


def test_softmax_exp_is_near_exp_and_exact_at_its_ends():
    """The kernel's exp (exp_softmax: float32 operations, no libm) against float64's e^x on a
    dense grid of [-86, 0]: within 2 ulp; e^0 is exactly 1 (the max's weight); below -86, at
    -inf and for a NaN it is 0."""
    x = np.concatenate([np.linspace(-86, 0, 1_000_001, dtype=np.float32),
                        -np.logspace(-30, 1, 10_001, dtype=np.float32)])
    got = A.exp_softmax(x)
    want = np.exp(x.astype(np.float64))
    assert np.all(np.abs(got - want) <= 2 * np.spacing(want.astype(np.float32)))
    assert A.exp_softmax(np.float32(0)) == 1.0
    assert not np.any(A.exp_softmax(np.array([-86.001, -100, -np.inf, np.nan], np.float32)))


def test_queries_rounded_to_half_alike_on_every_isa():
    """A half cache's queries are rounded to half first: F16C on the SIMD paths, software on
    the scalar one. Queries at the edges of that rounding (ties to even, half subnormals,
    the largest half, overflow to infinity, a NaN) give every path the reference's bits;
    the rows with an infinite or NaN query come out the same NaN everywhere."""
    rng = np.random.default_rng(12)
    q, k, v, table, slots, positions = random_case(rng, 6, 9, 3, 40, 13, "f16", P=21)
    edges = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -25, 3 * 2.0 ** -26, 6e-8,
                      1e-5, 65504.0, 65519.0, 65520.0, -2.0 ** -24, 0.5 + 2.0 ** -12],
                     np.float32)
    q[1:5] = rng.choice(edges, q[1:5].shape) * rng.choice([-1, 1], q[1:5].shape)
    q[4, 2, 5] = np.nan
    args = (q, k, v, table, slots, positions, 0.125)
    want = A.reference_attention(*args).view(np.uint32)
    assert np.isnan(A.reference_attention(*args)[4, 2]).all()   # the NaN row is there
    for isa in kk.supported_isas():
        for threads in (1, 2):
            got = A.attention_host(*args, isa=isa, threads=threads).view(np.uint32)
            assert np.array_equal(got, want), (isa, threads)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_wide_scores_match_the_reference_on_every_isa(dtype):
    """Scores hundreds apart (a large scale): the exp's every branch (weights far below
    e^-86 are 0) and the range reduction at large n, the same bits on every path as the
    numpy reference."""
    rng = np.random.default_rng(11)
    case = random_case(rng, 6, 9, 3, 20, 13, dtype, P=21)
    args = (*case, 12.0)
    want = A.reference_attention(*args)
    for isa in kk.supported_isas():
        assert np.array_equal(A.attention_host(*args, isa=isa), want), isa


@pytest.mark.parametrize("name,H,K,dtype,window,softcap",
                         [("causal", 4, 2, "f32", 0, 0.0), ("window", 4, 2, "f32", 5, 0.0),
                          ("softcap", 4, 2, "f32", 0, 2.0), ("gqa", 9, 3, "f32", 0, 0.0),
                          ("f16 cache", 4, 2, "f16", 0, 0.0)])
def test_close_to_layers_paged_attention(name, H, K, dtype, window, softcap):
    rng = np.random.default_rng(4)
    q, k, v, table, slots, positions = random_case(rng, 8, H, K, 32, 16, dtype)
    scale = 32 ** -0.5
    ours = jitted(q, k, v, table, slots, positions, scale, window, softcap)
    xla = jitted(q, k, v, table, slots, positions, scale, window, softcap, fn=_layers_jit)
    # relative to the output's scale (entries near zero have no relative meaning)
    err = np.abs(ours - xla).max() / np.abs(xla).max()
    assert err < 1e-5, (name, err)


def test_bad_input_is_an_error_not_a_crash():
    rng = np.random.default_rng(5)
    q, k, v, table, slots, positions = random_case(rng, 4, 4, 2, 8, 8, "f32")
    args = (q, k, v, table, slots, positions, 0.5)

    def bad(i, x):
        a = list(args)
        a[i] = x
        return a

    slot_out = slots.copy()
    slot_out[2] = 3
    page_out = table.copy()
    page_out[1, 3] = PAGES
    page_neg = table.copy()
    page_neg[0, 0] = -1
    pos_out = positions.copy()
    pos_out[1] = table.shape[1] * PS
    pos_neg = positions.copy()
    pos_neg[3] = -2
    cases = [(bad(4, slot_out), "slot"), (bad(3, page_out), "page id"),
             (bad(3, page_neg), "page id"), (bad(5, pos_out), "position"),
             (bad(5, pos_neg), "position")]
    for a, word in cases:
        with pytest.raises(KernelError, match=word):
            A.attention_host(*a)
        with pytest.raises(Exception, match=word):
            jitted(*a)
    with pytest.raises(KernelError, match="window"):
        A.attention_host(*args, window=-1)
    with pytest.raises(KernelError, match="multiple"):
        A.attention_host(q[:, :3], *args[1:])  # H = 3 query heads over K = 2
    with pytest.raises(ValueError, match="float32, float16, bfloat16 or q8_0"):
        A.attention_host(q, k.astype(np.int8), *args[2:])
    with pytest.raises(ValueError, match="float32, float16, bfloat16 or q8_0"):
        jitted(q, k.astype(np.int8), *args[2:])
    ends_before, ends_past = positions.copy(), positions.copy()
    ends_before[1] = positions[1] - 1
    ends_past[2] = table.shape[1] * PS
    for ends in (ends_before, ends_past):
        with pytest.raises(KernelError, match="end"):
            A.attention_host(*args, ends=ends)
        with pytest.raises(Exception, match="end"):
            jitted(*args, ends=ends)
    with pytest.raises(ValueError, match="ends must be"):
        A.attention_host(*args, ends=positions[:3])
    # still fine afterwards
    assert np.array_equal(A.attention_host(*args), jitted(*args))


def chunk_case(rng, dtype, H=4, K=2, Q=20, Qv=13, pages=48, S=3, P=40):
    """A step of prompt chunks and single rows over three slots (P * PS = 160 keys, three
    key blocks): runs of 20 (across a block edge, longer than a group), 1, 5, 3, 1, 18, 2
    and 19 rows, each run one slot at consecutive positions, next to others of the same
    slot that do not continue it."""
    k, v = cache(rng, K, Q, Qv, DTYPES[dtype], pages)
    table = np.stack([rng.permutation(pages)[:P] for _ in range(S)]).astype(np.int32)
    runs = [(0, 50, 20), (1, 100, 1), (1, 0, 5), (2, 120, 3), (0, 7, 1), (2, 123, 18),
            (1, 5, 2), (0, 141, 19)]
    slots = np.concatenate([np.full(n, s) for s, _, n in runs]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for _, p, n in runs]).astype(np.int32)
    q = rng.standard_normal((len(slots), H, Q)).astype(np.float32)
    return q, k, v, table, slots, positions


@pytest.mark.parametrize("dtype,window,softcap", [("f32", 0, 0.0), ("f16", 7, 0.0),
                                                  ("bf16", 64, 2.5), ("f16", 0, 3.0),
                                                  ("f32", 20, 0.0)])
def test_prompt_chunk_rows_get_their_own_bits(dtype, window, softcap):
    rng = np.random.default_rng(6)
    args = (*chunk_case(rng, dtype), 0.3, window, softcap)
    alone = A.attention_host(*args, isa="scalar", threads=1, max_group=1)
    for isa in kk.supported_isas():
        for threads in (1, 2):
            for max_group in (1, 3, 16, None):
                got = A.attention_host(*args, isa=isa, threads=threads, max_group=max_group)
                assert np.array_equal(got, alone), (isa, threads, max_group)
    assert np.array_equal(jitted(*args), alone)
    assert np.array_equal(alone, A.reference_attention(*args))


def test_f16_cache_of_every_finite_half():
    rng = np.random.default_rng(7)
    bits = np.arange(1 << 16, dtype=np.uint16)
    finite = bits[(bits & 0x7C00) != 0x7C00].view(np.float16)  # no inf, no NaN of any kind
    H, K, Q, ps = 2, 1, 32, 4
    pages = finite.size // (ps * K * Q)  # 496 pages, 1984 keys: each half once in k, in v
    k = rng.permutation(finite).reshape(pages, ps, K, Q)
    v = rng.permutation(finite).reshape(pages, ps, K, Q)
    table = np.arange(pages, dtype=np.int32)[None]
    positions = np.concatenate([np.arange(1970, 1984), np.arange(4)]).astype(np.int32)
    slots = np.zeros(positions.size, np.int32)
    q = rng.standard_normal((positions.size, H, Q)).astype(np.float32)
    args = (q, k, v, table, slots, positions, 0.2)
    base = A.attention_host(*args, isa="scalar", threads=1, max_group=1)
    assert np.isfinite(base).all()
    for isa in kk.supported_isas():
        for threads in (1, 2):
            assert np.array_equal(A.attention_host(*args, isa=isa, threads=threads), base), isa
    assert np.array_equal(base, A.reference_attention(*args))


def ends_case(rng, dtype):
    """chunk_case's step with images (every row of one sees up to the image's last key): rows
    54..65 of slot 0's first run (across a key block edge), the whole run at 0..4 of slot 1,
    126..137 of slot 2, the last rows of slot 0's table (151..159); a single row (100) that
    sees ten keys past itself; and slot 1's rows at 5 and 6 with ends 9 and 6 (ends that
    fall: no group may join them)."""
    q, k, v, table, slots, positions = chunk_case(rng, dtype)
    ends = positions.copy()
    for first, last in [(4, 15), (21, 25), (33, 44), (60, 68)]:
        ends[first:last + 1] = positions[last]
    ends[20] = positions[20] + 10
    ends[48] = positions[48] + 4
    return (q, k, v, table, slots, positions), ends


@pytest.mark.parametrize("dtype,window,softcap", [("f32", 0, 0.0), ("f16", 7, 0.0),
                                                  ("bf16", 20, 2.5)])
def test_rows_that_see_past_their_position(dtype, window, softcap):
    rng = np.random.default_rng(8)
    case, ends = ends_case(rng, dtype)
    args = (*case, 0.3, window, softcap)
    alone = A.attention_host(*args, isa="scalar", threads=1, max_group=1, ends=ends)
    assert np.array_equal(alone, A.reference_attention(*args, ends=ends))
    for isa in kk.supported_isas():
        for threads in (1, 2):
            for max_group in (1, 3, None):
                got = A.attention_host(*args, isa=isa, threads=threads, max_group=max_group,
                                       ends=ends)
                assert np.array_equal(got, alone), (isa, threads, max_group)
    assert np.array_equal(jitted(*args, ends=ends), alone)
    # a row's bits are its own: alone in its step, an image's row as a step of one
    q, k, v, table, slots, positions = case
    for t in (4, 15, 20, 22, 48, 49, 68):
        one = A.attention_host(q[t:t + 1], k, v, table, slots[t:t + 1], positions[t:t + 1],
                               *args[6:], ends=ends[t:t + 1])
        assert np.array_equal(one[0], alone[t]), t
    # rows whose end is their position keep the causal bits (no ends: the kernel's null
    # pointer; ends = positions; jit's causal call); the others see more
    causal = A.attention_host(*args)
    same = ends == positions
    assert np.array_equal(alone[same], causal[same])
    assert not np.array_equal(alone[~same], causal[~same])
    assert np.array_equal(A.attention_host(*args, ends=positions), causal)
    assert np.array_equal(jitted(*args, ends=positions), causal)


@pytest.mark.parametrize("window", [0, 7])
def test_ends_close_to_layers_paged_attention(window):
    rng = np.random.default_rng(9)
    case, ends = ends_case(rng, "f32")
    args = (*case, 0.3, window, 0.0)
    ours = jitted(*args, ends=ends)
    xla = jitted(*args, ends=ends, fn=_layers_jit)
    err = np.abs(ours - xla).max() / np.abs(xla).max()
    assert err < 1e-5, err
    assert not np.allclose(xla, jitted(*args, fn=_layers_jit))  # the ends were honoured


# --- (i) q8_0 caches ---------------------------------------------------------------------------

def q8_0_case(rng, T, H=4, K=2, Q=64, Qv=32, S=3, P=7):
    """A random case over q8_0 caches (kinetic/kernels/reference.py q8_0_blocks), some values
    large beside small ones (a block's scale then rounds its small values to few levels)."""
    kf = rng.standard_normal((PAGES, PS, K, Q)).astype(np.float32)
    kf[..., 5] *= 40   # an outlier channel, as real keys have
    vf = rng.standard_normal((PAGES, PS, K, Qv)).astype(np.float32)
    k, v = R.q8_0_blocks(kf), R.q8_0_blocks(vf)
    table = rng.integers(0, PAGES, (S, P)).astype(np.int32)
    slots = rng.integers(0, S, T).astype(np.int32)
    positions = rng.integers(0, P * PS, T).astype(np.int32)
    positions[0] = 0
    q = rng.standard_normal((T, H, Q)).astype(np.float32)
    return q, k, v, table, slots, positions


def test_q8_0_cache_is_its_reference_on_every_path_and_thread_count():
    rng = np.random.default_rng(11)
    case = q8_0_case(rng, 9)
    for window, softcap in [(0, 0.0), (7, 0.0), (0, 2.5)]:
        args = (*case, 0.125, window, softcap)
        want = A.reference_attention(*args)
        for isa in kk.supported_isas():
            for threads in (1, 2):
                got = A.attention_host(*args, isa=isa, threads=threads)
                assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (isa, threads)
        assert np.array_equal(jitted(*args).view(np.uint32), want.view(np.uint32))
        # XLA's path reads the same values (layers.dequantize_q8_0) and sums in its own order
        np.testing.assert_allclose(jitted(*args, fn=_layers_jit), want, rtol=2e-5, atol=2e-5)


def test_q8_0_row_is_batch_invariant():
    rng = np.random.default_rng(12)
    q, k, v, table, slots, positions = q8_0_case(rng, 16)
    alone = jitted(q[3:4], k, v, table, slots[3:4], positions[3:4], 0.125)[0]
    for T in (4, 7, 16):
        assert np.array_equal(jitted(q[:T], k, v, table, slots[:T], positions[:T], 0.125)[3],
                              alone), T


def test_q8_0_query_is_quantized_as_the_keys_are():
    """A q8_0 key cache meets a q8_0 query (llama.cpp quantizes the query for q8_0 keys): a
    query already made of q8_0 values gives the same bits as the raw one it came from."""
    rng = np.random.default_rng(13)
    q, k, v, table, slots, positions = q8_0_case(rng, 5)
    read_back = R.q8_0_values(R.q8_0_blocks(q))
    assert not np.array_equal(read_back, q)
    args = (k, v, table, slots, positions, 0.125)
    assert np.array_equal(A.attention_host(q, *args), A.attention_host(read_back, *args))


def test_q8_0_needs_heads_a_multiple_of_32_wide():
    """A q8_0 row is whole blocks of 32: the kernel refuses a query whose width its cache rows
    cannot hold, and an engine refuses a q8_0 cache for a model with such heads, naming them."""
    import dataclasses
    from kinetic.engine.engine_config import EngineConfig
    from tests import mock_model
    rng = np.random.default_rng(14)
    q, k, v, table, slots, positions = q8_0_case(rng, 3, Q=64, Qv=32)
    with pytest.raises(Exception, match="head width"):   # 48 values: not whole blocks
        jitted(np.zeros((3, 4, 48), np.float32), k[..., :51], v, table, slots, positions, 0.125)
    cfg = dataclasses.replace(mock_model.CONFIG, head_dim=48, v_head_dim=64)
    with pytest.raises(ValueError, match="blocks of 32 values: this model.s heads are 48 wide"):
        EngineConfig(parallel=1, n_ctx=64, kv_dtype="q8_0").resolved(cfg)
    EngineConfig(parallel=1, n_ctx=64, kv_dtype="q8_0").resolved(
        dataclasses.replace(cfg, head_dim=96))
    with pytest.raises(ValueError, match="the pallas kernel reads float caches"):
        EngineConfig(parallel=1, n_ctx=64, kv_dtype="q8_0").resolved(
            dataclasses.replace(cfg, head_dim=96, kernel="pallas"))
