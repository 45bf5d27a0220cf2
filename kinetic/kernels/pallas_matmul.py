"""Quantized matmul as a Pallas kernel: the first piece of the GPU kernel "pallas".

    planes = repack(data, qtype, (N, K))      once, at load: GGUF blocks -> aligned planes
    y = matmul(x, planes)                     y[M, N] = x[M, K] @ W[N, K]^T, float32
    ys, h = matmul_many(x, [q, k, v], norm=(parts, bias, w, eps))
                                              the products of rms_norm(x + parts' sum + bias),
                                              the add and the norm made inside the launch

The weights stay quantized on the device, GGUF's blocks split once into planes (`Planes`):
the integer of each element in its low 4 bits, two to a byte, element 2j in byte j's low
nibble and 2j + 1 in its high one (uint8 [N, K / 2]; Q8_0 keeps its int8 [N, K]), the bits
above those as bit planes (int32 [N, K / 32], one bit per element: the Q5 formats' fifth
bit, Q6_K's fifth and sixth), and per group of 32 (16 for Q2_K, Q3_K and Q6_K) a scale
and, for the formats that have one, a minimum, added (quants.PARTS gives the one quants.py
subtracts: negated, exactly). Both are kinetic/model/quants.py's own parts of the blocks
(quants.PARTS), so exactly its values: the 32-block formats' are the file's half floats,
kept as float16 (HALF_SCALES); a K-quant's, d * the sub-block's scale, as float32. Float
weights (F32, F16, BF16) stay as they are. Device memory holds about the file's size (a
Q4_0 weight 0.5625 bytes an element, as in the file; a K-quant's a float32 scale per 16 or
32 elements, where the file has less).

A block format's product is integer arithmetic, as llama.cpp's own quantized matmuls do it:
each program reads a [bn, bk] tile of W's integers in registers (`integers`: the stored
value minus its offset, -32 to 31 in every format, so int8), never dequantized to global
memory; x's rows are rounded block by block of 32 as llama.cpp's q8_0 rounds them
(`quantize_x`: the scale max|x| / 127 kept as a half float, the integers to nearest); and
each group of 16 or 32 is one int8 dot (`integer_block`: on a GPU the tensor cores' integer
MMA), exact in any order, then scaled, x's scale times the group's, plus x's scale times
its integers' sum times the group's minimum. A float weight's tile is dequantized to
float32 (`dequantize_tile`) and multiplied by a float32 dot at precision HIGHEST (IEEE in
Triton, FMAs in order over K, no TF32: bench/triton_sm90.py).

Batch-invariant by construction: a program computes one tile of y, [R * dots, bn], for
one chunk of K; its reduction over the chunk walks it in blocks of bk, in order, each block
one dot per R rows. A block format's float arithmetic is elementwise (each element of the
tile its own row's scale and its own column's), so a row's bits do not depend on R or on
the rows beside it at all; a float weight's dot keeps one shape, [16, bk] x [bk, bn]
(dot_rows: 16 rows unless DECODE_ROWS says less). The chunks' partial sums are then added
in order. bn, bk and the chunks depend only on the weight's shape (`tiling`), so a row's
arithmetic is the same whatever M is and whichever rows share its call or its tile; M only
sets how many tiles the grid has, and which variant runs (`variant`): a decode call's
programs make one dot each, a prompt's four, sharing the weight tile; the same dots either
way. (Compiled by Triton, a multiply and an add may be contracted into one FMA: PyPI's
Triton does so by default, bench/triton_sm90.py; the same code in every program, so still
the same for every row.) tests/test_pallas_matmul.py checks it bitwise, with Pallas in
interpret mode on CPU (interpret=None picks it wherever JAX's backend is not a GPU), and
against a numpy reference of the arithmetic (`reference_arithmetic`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend
from kinetic.kernels import reference as kernel_reference
from kinetic.model import quants

BLOCK_M = 16          # rows of x per dot, whatever M is (padding rows are dropped)
DECODE_ROWS = 16      # the fewest rows of a decode call's dot (dot_rows; 1 to 16)
PROMPT_DOTS = 4       # a prompt's program makes this many 16-row dots per weight tile
PROGRAMS = 128        # a decode step's programs that keep a GPU busy (tiling)
CHUNK = 512           # the fewest elements of K a program's partial sum covers (tiling)
STAGES = 4            # Triton's pipeline depth: loads of 4 weight tiles in flight (speed
                      # only; bench/triton_sm90.py: no more registers than 2, fewer spills)
ROWS = 16             # a weight's rows are padded to a multiple of this (Triton's dots
                      # are at least 16 on a side and its blocks powers of 2)
QK = 32               # elements of a block of the quant planes (and of their fifth bits)
# a block format's integers (quants.PARTS) are stored plus an offset, as their low 4 bits and
# this many bit planes above them: (offset, bit planes); Q8_0's as they are, int8
_STORED = {T.Q4_0: (8, 0), T.Q4_1: (0, 0), T.Q5_0: (16, 1), T.Q5_1: (0, 1), T.Q2_K: (0, 0),
           T.Q3_K: (4, 0), T.Q4_K: (0, 0), T.Q5_K: (0, 1), T.Q6_K: (32, 2)}
_FLOATS = {T.F32: np.float32, T.F16: np.float16, T.BF16: None}
# the formats whose scale (and minimum) is a half float of the file's: planes keep it so
HALF_SCALES = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# a gated feed-forward's activation of its gate, made by the down projection's programs
# (swiglu's act): SwiGLU's, and GeGLU's (model/layers.py gelu_tanh's, Gemma's)
GLU = {"silu": jax.nn.silu, "gelu": lambda g: jax.nn.gelu(g, approximate=True)}
FORMATS = (T.Q8_0, *_STORED, *_FLOATS)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "d", "m", "bits"],
                   meta_fields=["offset", "group", "n", "experts"])
@dataclass(frozen=True)
class Planes:
    """A [N, K] weight's planes (module docstring). Its value at (n, k): q's integer, with
    the bit planes' bits above its low 4, minus `offset`, times the scale of its group of
    `group` elements, plus its minimum; a float weight's is q itself. The arrays' rows are
    padded with zeros to a multiple of ROWS (a tile of N is at least that); `n` rows are
    the weight's. experts > 0: a mixture's experts' weights, each [N, K], stacked (each
    expert's padded rows after the one before: `stack`, `expert`; matmul_experts)."""

    q: jax.Array                    # int8 [N, K]; uint8 [N, K / 2] 4-bit pairs; or floats
    d: jax.Array | None             # [N, K / group]: scales (None: a float weight)
    m: jax.Array | None = None      # [N, K / group]: minimums, added (both float16 for
                                    # HALF_SCALES' formats, else float32)
    bits: tuple = ()                # int32 [N, K / 32] each: bit i is element i's bit 4, 5
    offset: int = 0
    group: int = QK
    n: int = 0                      # the weight's rows (0: all of q's; stacked: an expert's)
    experts: int = 0                # stacked experts (0: one weight)

    @property
    def kind(self) -> str:
        if self.d is None:
            return "float"
        return "int8" if self.q.dtype == jnp.int8 else "packed"

    @property
    def shape(self) -> tuple[int, int]:
        return self.n or self.q.shape[0], self.q.shape[1] * (2 if self.kind == "packed" else 1)

    def expert(self, e: int) -> Planes:
        """A stacked mixture's expert e, as a weight of its own."""
        rows = self.q.shape[0] // self.experts

        def take(a):
            return None if a is None else a[e * rows:(e + 1) * rows]
        return Planes(take(self.q), take(self.d), take(self.m), tuple(map(take, self.bits)),
                      self.offset, self.group, self.n)

    @property
    def planes(self) -> tuple[jax.Array, ...]:
        """The planes besides q, in dequantize_tile's order."""
        return (*self.bits, *(a for a in (self.d, self.m) if a is not None))

    @property
    def spec(self) -> tuple:
        """What dequantize_tile needs to know beside the arrays (static under jit)."""
        return self.kind, len(self.bits), self.offset, self.group, self.m is not None


def repack(data: np.ndarray, qtype, shape: tuple[int, int]) -> Planes:
    """Planes of a GGUF tensor's bytes (`data`) of type `qtype` and numpy shape (N, K).
    Raises ValueError for a type the kernel lacks, naming it, or bytes that do not fit."""
    qtype = T(qtype)
    if qtype not in FORMATS:
        raise ValueError(f"the pallas kernel has no {qtype.name} matmul "
                         f"(it has {', '.join(t.name for t in FORMATS)})")
    N, K = shape
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if qtype in _FLOATS:
        if raw.size != N * K * (4 if qtype == T.F32 else 2):
            raise ValueError(f"{raw.size} bytes do not hold a {qtype.name} [{N}, {K}] weight")
        q = raw.view(_FLOATS[qtype] or np.uint16).reshape(N, K)
        q = jnp.asarray(q)
        return _pad(Planes(q if qtype != T.BF16 else lax.bitcast_convert_type(q, jnp.bfloat16),
                           None, n=N))
    per, block = quants.block_bytes(qtype), quants.block_size(qtype)
    if K % block:
        raise ValueError(f"a {qtype.name} weight's rows must be whole blocks of {block}, "
                         f"not {K}")
    if raw.size != N * K // block * per:
        raise ValueError(f"{raw.size} bytes do not hold a {qtype.name} [{N}, {K}] weight")
    q, scale, minimum = quants.PARTS[qtype](raw.reshape(N * K // block, per))
    # the 32-block formats' scales and minimums are the file's half floats: kept so (exact)
    kept = np.float16 if qtype in HALF_SCALES else np.float32
    scale = jnp.asarray(scale.reshape(N, -1).astype(kept))
    m = None if minimum is None else jnp.asarray((-minimum.reshape(N, -1)).astype(kept))
    group = K * N // scale.size
    if qtype == T.Q8_0:
        return _pad(Planes(jnp.asarray(q.reshape(N, K)), scale, m, (), 0, group, N))
    offset, n_bits = _STORED[qtype]
    u = (q.astype(np.int32) + offset).reshape(N, K)
    return _pad(Planes(_nibbles(u), scale, m,
                       tuple(_bit_plane(u, 4 + i) for i in range(n_bits)), offset, group, N))


def stack(ws: list[Planes]) -> Planes:
    """A mixture's experts (Planes of one format and shape each) stacked into one Planes."""
    first = ws[0]

    def cat(*a):
        return None if a[0] is None else jnp.concatenate(a)
    return Planes(cat(*(w.q for w in ws)), cat(*(w.d for w in ws)), cat(*(w.m for w in ws)),
                  tuple(cat(*b) for b in zip(*(w.bits for w in ws))), first.offset,
                  first.group, first.shape[0], len(ws))


def repack_experts(data: np.ndarray, qtype, shape: tuple[int, int, int]) -> Planes:
    """A stacked [E, N, K] GGUF tensor's experts as one stacked Planes (repack's errors).
    Repacked an expert at a time: the host's transient arrays are one expert's, not the
    whole tensor's (a 32-bit integer per element)."""
    E, N, K = shape
    rows = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if rows.size % E:
        raise ValueError(f"{rows.size} bytes are not {E} experts' weights")
    rows = rows.reshape(E, -1)
    return stack([repack(rows[e], qtype, (N, K)) for e in range(E)])


def _pad(w: Planes) -> Planes:
    """w with its arrays' rows padded with zeros to a multiple of ROWS."""
    extra = -w.n % ROWS
    if not extra:
        return w

    def pad(a):
        return None if a is None else jnp.pad(a, ((0, extra), (0, 0)))
    return Planes(pad(w.q), pad(w.d), pad(w.m), tuple(map(pad, w.bits)), w.offset, w.group,
                  w.n)


def _nibbles(u: np.ndarray) -> jax.Array:
    """uint8 [N, K / 2] of values [N, K] (< 16 in their low 4 bits): byte j holds element 2j
    in its low nibble and 2j + 1 in its high one, so a tile unpacks by a join and a reshape
    (Triton has no general concatenate)."""
    N, K = u.shape
    b = (u & 0x0F).astype(np.uint8).reshape(N, K // 2, 2)
    return jnp.asarray(b[..., 0] | (b[..., 1] << 4))


def _bit_plane(u: np.ndarray, bit: int) -> jax.Array:
    """int32 [N, K / 32]: bit `bit` of each value, element i of a block at bit i."""
    N, K = u.shape
    b = ((u >> bit) & 1).astype(np.uint32).reshape(N, K // QK, QK)
    return jnp.asarray((b << np.arange(QK, dtype=np.uint32)).sum(-1, dtype=np.uint32)
                       .view(np.int32))


def dequantize_tile(spec: tuple, q: jax.Array, *planes: jax.Array) -> jax.Array:
    """float32 [n, k] of a tile of the planes (Planes.spec, q, Planes.planes): the kernel's
    own arithmetic, quants.py's operations in its order (integer, times the scale, plus the
    minimum)."""
    kind, n_bits, offset, group, has_m = spec
    if kind == "float":
        return q.astype(jnp.float32)
    n = q.shape[0]
    d = planes[n_bits].astype(jnp.float32)
    v = integers(spec, q, *planes).reshape(n, d.shape[1], group)
    out = v.astype(jnp.float32) * d[..., None]
    if has_m:
        out = out + planes[n_bits + 1].astype(jnp.float32)[..., None]
    return out.reshape(n, -1)


def integers(spec: tuple, q: jax.Array, *planes: jax.Array) -> jax.Array:
    """int32 [n, k]: a block format's tile's integers (quants.PARTS'), each element's stored
    value with its bit planes' bits above its low 4, minus the offset: -32 to 31 in every
    format, so they fit int8."""
    kind, n_bits, offset = spec[:3]
    n = q.shape[0]
    if kind == "int8":
        return q.astype(jnp.int32)
    v = jnp.stack([q & 0x0F, q >> 4], axis=-1).astype(jnp.int32).reshape(n, -1)
    for i, plane in enumerate(planes[:n_bits]):
        bit = (plane[..., None] >> lax.broadcasted_iota(jnp.int32, (1, 1, QK), 2)) & 1
        v = v | (bit << (4 + i)).reshape(n, -1)
    return v - offset


def quantize_x(x: jax.Array, compiled: bool = False) -> tuple[jax.Array, jax.Array]:
    """x [R, 32] float32 as llama.cpp's q8_0 rounds a block of 32 (layers.quantize_q8_0's
    arithmetic, the C++ kernel's): (int8 [R, 32] q, float32 [R, 1] d), d = max|x| / 127,
    q = x * (1 / d) to the nearest integer (ties to even; 0 where d is 0), d then kept as
    a half float. A max is exact in any order and the rest is elementwise: a row's q and d
    depend on its own values alone. compiled: inside a kernel Triton compiles (divide)."""
    d = rounded("div", jnp.max(jnp.abs(x), axis=1, keepdims=True), np.float32(127), compiled)
    inv = jnp.where(d > 0, rounded("div", np.float32(1), jnp.where(d > 0, d, np.float32(1)),
                                   compiled), np.float32(0))
    y = rounded("mul", x, inv, compiled)
    return nearest(y).astype(jnp.int8), d.astype(jnp.float16).astype(jnp.float32)


def rounded(op: str, a, b, compiled: bool) -> jax.Array:
    """a / b ("div") or a * b ("mul") in float32, one IEEE rounding (as XLA's and numpy's).
    In a kernel Triton compiles (compiled) the PTX instruction itself, div.rn.f32 or
    mul.rn.f32: Triton's own division is approximate (div.full.f32, up to 2 ulp), and its
    compiler may fuse a product into the subtraction after it (an FMA: not rounded), which
    would change which way nearest() rounds; an instruction with its rounding mode named is
    never fused."""
    if not compiled:
        return a / b if op == "div" else a * b
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    (out,) = pltriton.elementwise_inline_asm(
        f"{op}.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
    return out


def nearest(y: jax.Array) -> jax.Array:
    """int32: y (float32, |y| < 2^23) to the nearest integer, ties to even, as numpy's rint.
    Triton has no round, and the float trick (y + 1.5 * 2^23 - 1.5 * 2^23) is one XLA
    folds away: so truncate, and step by one where the exact remainder says so."""
    t = y.astype(jnp.int32)                       # toward zero
    r = y - t.astype(jnp.float32)                 # exact, in (-1, 1)
    odd = (t & 1) == 1
    up = (r > 0.5) | ((r == 0.5) & odd)
    down = (r < -0.5) | ((r == -0.5) & odd)
    return t + up.astype(jnp.int32) - down.astype(jnp.int32)


def integer_block(x: jax.Array, w: jax.Array, groups: list, group: int,
                  acc: jax.Array, compiled: bool = False) -> jax.Array:
    """acc [R, bn] plus x [R, 32] (float32) times a block format's tile w (int8 [bn, 32],
    its integers): x quantized as llama.cpp's q8_0 (quantize_x), then per group of `group`
    columns (groups: each group's [scale] or [scale, minimum], [bn, 1] each) one int8 dot,
    exact, of x's integers in that group (the others zeroed) and w's, times x's d times the
    group's scale, and for a format with a minimum x's d times its integers' sum times the
    minimum; added to acc group by group, in order. Each element's arithmetic is its own
    row's and column's alone: no float sum depends on which rows share the dot or how many
    there are. compiled: as quantize_x's."""
    xq, dx = quantize_x(x, compiled)
    R, BK = x.shape
    cols = lax.broadcasted_iota(jnp.int32, (R, BK), 1)
    for g, (scale, *minimum) in enumerate(groups):
        xg = xq if len(groups) == 1 else jnp.where(cols // group == g, xq, jnp.int8(0))
        dot = lax.dot_general(xg, w, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.int32)
        acc = acc + (dx * scale.astype(jnp.float32).reshape(1, -1)) * dot.astype(jnp.float32)
        if minimum:
            total = jnp.sum(xg.astype(jnp.int32), axis=1, keepdims=True)
            acc = acc + ((dx * total.astype(jnp.float32))
                         * minimum[0].astype(jnp.float32).reshape(1, -1))
    return acc


def rows(w: Planes, tokens: jax.Array) -> jax.Array:
    """float32 [T, K]: rows `tokens` of w, dequantized (a step's token embeddings: only its
    rows, the same values as the whole table's)."""
    take = functools.partial(jnp.take, indices=tokens, axis=0)
    return dequantize_tile(w.spec, take(w.q), *map(take, w.planes))


def _divisor(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if n % s == 0), n)


@dataclass(frozen=True)
class Tiling:
    """How a [N, K] weight's product is cut, fixed by the weight's shape alone (`tiling`),
    never by M: a program's tile over N (bn), the dot's width over K (bk), and the number of
    equal chunks K is split into (chunks): each chunk's partial sum is its own program's,
    and y is chunk 0's plus chunk 1's plus ..., in that order."""

    bn: int
    bk: int
    chunks: int = 1


def tiling(N: int, K: int) -> Tiling:
    """The weight's Tiling. bk is 32 and bn 32 or 16: Triton's code for larger tiles spills
    registers (bench/triton_sm90.py compiles the kernels for sm_90 on a CPU: [16, 32] x
    [32, 32] dots leave every format's decode and prompt variant unspilled, bk 64 or more
    and bn 64 or more do not). A decode step (one 16-row tile over M) runs N / bn * chunks
    programs, which should be enough to keep a GPU's multiprocessors busy (PROGRAMS); what
    a program reads beside its weight tile is x's rows for its chunk (x's padding rows are
    masked off, never read) and its partial sum, written and read back (about 1 / chunk of
    the weight's bytes). So K is split into the fewest equal chunks of whole bk blocks, at
    least CHUNK elements each, that give PROGRAMS programs (else the most that keep
    CHUNK), and bn is 32 where it divides N (else 16, else N)."""
    bk = _divisor(K, (32,))
    bn = next((b for b in (32, 16) if N % b == 0), N)
    blocks = K // bk
    splits = [c for c in range(1, blocks + 1)
              if blocks % c == 0 and (c == 1 or K // c >= CHUNK)]
    enough = [c for c in splits if N // bn * c >= PROGRAMS]
    return Tiling(bn, bk, enough[0] if enough else splits[-1])


def matmul(x: jax.Array, w: Planes, interpret: bool | None = None,
           tiles: Tiling | None = None, partials: bool = False) -> jax.Array:
    """x [..., K] (any float type, computed in float32) @ w^T -> float32 [..., N]. tiles:
    a Tiling instead of the weight's own (a share of a split weight keeps the whole
    weight's: engine/split.py). partials (x [M, K]): the partial sums over K's chunks
    themselves, [chunks, >= M, >= N], whose sum in order and first M rows and N columns are
    the product (pallas_norm.add_rms_norm takes them so)."""
    return matmul_many(x, [w], interpret, None if tiles is None else [tiles], partials)[0]


def matmul_many(x: jax.Array, ws: list[Planes], interpret: bool | None = None,
                tiles: list[Tiling] | None = None, partials: bool = False,
                norm: tuple | None = None, normed: bool = False):
    """[matmul(x, w) for w in ws], the weights (each of K columns, in any format) in one
    kernel launch: a layer's q, k and v, or its gate and up, read one x. Each weight's
    programs are its own call's, at its own tiling, so each product is the same bits as
    its call alone (tests/test_pallas_matmul.py); a GPU launches one kernel where it would
    launch len(ws).

    norm (parts, bias, w, eps): the products are of rms_norm(h, w, eps), h = x + (parts'
    sum + bias) (x [M, K] a residual, parts a projection's partial sums or None: h = x),
    normalized inside the launch, pallas_norm.add_rms_norm's bits (a layer's add and norm
    with no launch of their own); returns (the products, h, or None without parts). norm
    (parts, bias, w, eps, w_post): h = x + rms_norm(parts' sum + bias, w_post, eps), the
    norm after a projection too (Gemma 3's), pallas_norm.post_add_rms_norm's bits. normed
    (with norm): the normalized x too, rms_norm(h, w, eps) [M, K], written by the call's
    first program, the norm kernel's bits (for what else reads it: a mixture's experts);
    returns (the products, h, it)."""
    interpret = pallas_backend.interpreted(interpret)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    tiles = tiles or [tiling(w.q.shape[0], w.shape[1]) for w in ws]   # (rows padded to ROWS)
    M = x.shape[0]
    ys = _matmul(x, tuple(w.q for w in ws), tuple(w.planes for w in ws),
                 tuple(w.spec for w in ws), interpret, tuple(tiles), variant(M),
                 not interpret, None, 1, dot_rows(M), 0, partials,
                 *_norm_args(norm), "silu", 0, normed)
    ys, *made = ys if norm is not None else (ys,)
    if not partials:
        ys = [y[:, :w.shape[0]].reshape(*lead, w.shape[0]) for y, w in zip(ys, ws)]
    return list(ys) if norm is None else (list(ys), *made)


def _norm_args(norm: tuple | None) -> tuple:
    """_matmul's (norm, eps) from a public call's norm (parts, bias, w, eps[, w_post])."""
    if norm is None:
        return None, None
    parts, bias, w, eps, *post = norm
    return (parts, bias, w, post[0] if post else None), float(eps)


def swiglu(x: jax.Array, gate: Planes, up: Planes, down: Planes,
           interpret: bool | None = None, partials: bool = False, norm: tuple | None = None,
           act: str = "silu"):
    """matmul(jax.nn.silu(matmul(x, gate)) * matmul(x, up), down), the same bits, in two
    launches: gate and up in one (matmul_many's), and down, whose programs make silu(gate)
    * up of the blocks of x they read from gate's and up's partial sums (_matmul's glu), so
    the product between has no launch (an XLA kernel a layer on a GPU:
    bench/gpu_compile.py). partials (x [M, K]): as matmul's. norm: as matmul_many's, for
    gate's and up's x; returns (the product, h). act "gelu": a GeGLU, gelu_tanh(gate) * up
    (GLU's)."""
    interpret = pallas_backend.interpreted(interpret)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])
    M = x.shape[0]
    shape = (not interpret, None, 1, dot_rows(M))
    halves = _matmul(x, (gate.q, up.q), (gate.planes, up.planes), (gate.spec, up.spec),
                     interpret, tuple(tiling(w.q.shape[0], w.shape[1]) for w in (gate, up)),
                     variant(M), *shape, 0, True, *_norm_args(norm))
    halves, h = halves if norm is not None else (halves, None)
    (y,) = _matmul(tuple(halves), (down.q,), (down.planes,), (down.spec,), interpret,
                   (tiling(down.q.shape[0], down.shape[1]),), variant(M), *shape, M,
                   partials, None, None, act)
    if not partials:
        y = y[:, :down.shape[0]].reshape(*lead, down.shape[0])
    return y if norm is None else (y, h)


def matmul_experts(x: jax.Array, ids: jax.Array, ws: list[Planes],
                   interpret: bool | None = None) -> list[jax.Array]:
    """A mixture's projections over every (row, chosen expert) pair, in one launch: x [R, K],
    ids [R, S] int32 (the S experts each row chose), ws stacked experts' Planes (each E
    experts of [N_w, K]). Returns [R, S, N_w] per weight: pair (r, s) is
    matmul(x[r], ws[w].expert(ids[r, s])), the same bits (tests/test_pallas_matmul.py).

    The pairs run in blocks of 16 rows (`pair_blocks`), a block's programs multiplying its
    rows by its expert's tiles at the expert's own tiling, the arithmetic of a call of that
    expert alone, so a pair's bits depend neither on the rows beside it nor on how many
    chose its expert; no expert has a launch or a branch of its own."""
    interpret = pallas_backend.interpreted(interpret)
    blocks = pair_blocks(ids, ws[0].experts)
    ys = _matmul(blocks.x(x), tuple(w.q for w in ws), tuple(w.planes for w in ws),
                 tuple(w.spec for w in ws), interpret, _expert_tiles(ws), 1, True,
                 blocks.groups, ws[0].experts, BLOCK_M, 0, False, None, None, "silu",
                 blocks.pair_rows)
    return [blocks.pairs(y, w.shape[0], ids.shape) for y, w in zip(ys, ws)]


def swiglu_experts(x: jax.Array, ids: jax.Array, gate: Planes, up: Planes, down: Planes,
                   interpret: bool | None = None, act: str = "silu") -> jax.Array:
    """[R, S, D]: each (row, chosen expert) pair's SwiGLU, down(silu(gate(x)) * up(x)) with
    that expert's stacked weights (act "gelu": a GeGLU), in two launches: gate and up over
    every pair (matmul_experts'), then down, whose programs make silu(gate) * up of the
    block rows they read from gate's and up's partial sums (_matmul's glu, as swiglu's), the
    same blocks in the same places, so nothing runs between. A pair's bits are those of
    swiglu(x[r], each weight's expert alone) (tests/test_pallas_matmul.py)."""
    interpret = pallas_backend.interpreted(interpret)
    E = gate.experts
    blocks = pair_blocks(ids, E)
    halves = _matmul(blocks.x(x), (gate.q, up.q), (gate.planes, up.planes),
                     (gate.spec, up.spec), interpret, _expert_tiles([gate, up]), 1, True,
                     blocks.groups, E, BLOCK_M, 0, True, None, None, "silu",
                     blocks.pair_rows)
    # down's block b reads its rows where gate's and up's block b wrote them (pair_rows 0)
    (y,) = _matmul(tuple(halves), (down.q,), (down.planes,), (down.spec,), interpret,
                   _expert_tiles([down]), 1, True, blocks.groups, E, BLOCK_M,
                   blocks.expert.shape[0] * BLOCK_M, False, None, None, act)
    return blocks.pairs(y, down.shape[0], ids.shape)


PAIR_BLOCKS = 32     # a mixture's launch gives each pair a block of its own up to this many


@dataclass(frozen=True)
class PairBlocks:
    """Where a mixture's launch (matmul_experts, swiglu_experts) puts its (row, expert)
    pairs: B blocks of 16 rows, block b's first live[b] rows (none: skipped) being pairs
    of expert[b]; pair p's product at row slot[p] of its output [B * 16, N]. rows: the
    pairs' x rows gathered in block order, block b's at rows 16 b.. of the launch's x; or
    (rows and live None, pair_rows S) each block one pair, its x row b // S of x itself.

    At most PAIR_BLOCKS pairs (a decode step's), each pair is a block (its row of x read
    in place, nothing to sort or gather: no XLA kernel but the choice); else the pairs are put
    in order of expert (a stable sort), each expert's cut into blocks of 16, at most
    ceil(P / 16) + min(E, P) blocks in all (a static grid; those past the last skipped),
    their x rows gathered: each chosen expert's weights read once per block of its rows.
    A row's bits are the same either way (a block format's arithmetic is elementwise in
    the rows; a float weight's dot has 16 rows in both)."""

    rows: jax.Array | None
    live: jax.Array | None
    expert: jax.Array
    slot: jax.Array
    pair_rows: int = 0

    @property
    def groups(self) -> tuple:
        """_matmul's groups."""
        return self.live, self.expert

    def x(self, x: jax.Array) -> jax.Array:
        return x if self.rows is None else jnp.take(x, self.rows, axis=0)

    def pairs(self, y: jax.Array, n: int, shape: tuple) -> jax.Array:
        """The pairs' rows of a launch's output y [B * 16, >= n], as [R, S, n]."""
        return jnp.take(y, self.slot, axis=0)[:, :n].reshape(*shape, n)


def pair_blocks(ids: jax.Array, E: int) -> PairBlocks:
    """The blocks of ids [R, S]'s pairs among E experts (PairBlocks)."""
    R, S = ids.shape
    P = R * S
    chosen = ids.reshape(P).astype(jnp.int32)
    if P <= PAIR_BLOCKS:
        return PairBlocks(None, None, chosen, jnp.arange(P, dtype=jnp.int32) * BLOCK_M, S)
    hit = (chosen[:, None] == jnp.arange(E, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    counts = jnp.sum(hit, axis=0)                              # [E] pairs per expert
    rank = jnp.sum(jnp.cumsum(hit, axis=0) * hit, axis=1) - 1  # a pair's place among its
    blocks = (counts + BLOCK_M - 1) // BLOCK_M                 # expert's, in order
    ends = jnp.cumsum(blocks)
    starts = ends - blocks                                     # each expert's first block
    firsts = jnp.cumsum(counts) - counts                       # its first pair, sorted
    B = -(-P // BLOCK_M) + min(E, P)
    b = jnp.arange(B, dtype=jnp.int32)
    expert = jnp.minimum(jnp.sum(ends[None, :] <= b[:, None], axis=1), E - 1).astype(jnp.int32)
    local = b - starts[expert]
    live = jnp.where(b < ends[-1], jnp.clip(counts[expert] - local * BLOCK_M, 0, BLOCK_M),
                     0).astype(jnp.int32)
    order = jnp.argsort(chosen, stable=True)                   # the pairs by expert
    at = (firsts[expert] + local * BLOCK_M)[:, None] + jnp.arange(BLOCK_M)[None, :]
    rows = order[jnp.clip(at, 0, P - 1)].reshape(-1) // S      # each block row's x row
    return PairBlocks(rows, live, expert, starts[chosen] * BLOCK_M + rank)


def _expert_tiles(ws: list[Planes]) -> tuple:
    """Each stacked weight's tiling: one expert's, as a call of that expert alone."""
    return tuple(tiling(w.q.shape[0] // w.experts, w.shape[1]) for w in ws)


def variant(M: int) -> int:
    """The 16-row dots a program makes (its rows over BLOCK_M): 1 for a decode step's few
    rows, PROMPT_DOTS for a prompt's many (each weight tile then dequantized once for
    PROMPT_DOTS * 16 rows). Either way each dot is the same [16, bk] x [bk, bn], so a row
    gets the same bits from both (tests/test_pallas_matmul.py)."""
    return PROMPT_DOTS if M >= PROMPT_DOTS * BLOCK_M else 1


def dot_rows(M: int) -> int:
    """The rows of each dot of an M-row call: BLOCK_M (16), or for a decode call of fewer
    rows M's next power of 2 but at least DECODE_ROWS. A float weight's dot does its rows'
    FMAs, so a one-row step's 16-row dot does 16 times the arithmetic it needs (bench/gpu.py
    times both); a block format's integer dot is exact, any rows the same bits. DECODE_ROWS
    is 16, one dot shape for every call, until a GPU shows that a smaller float dot gives a
    row the same bits (tests/test_pallas_matmul.py has the check, for the device run);
    KINETIC_PALLAS_DECODE_ROWS sets it for a run (decode_rows)."""
    if M >= BLOCK_M:
        return BLOCK_M
    return max(decode_rows(), 1 << max(M - 1, 0).bit_length())


def decode_rows() -> int:
    """The fewest rows of a decode call's dot: KINETIC_PALLAS_DECODE_ROWS where set (1, 2,
    4, 8 or 16; read at each trace), else DECODE_ROWS."""
    text = os.environ.get("KINETIC_PALLAS_DECODE_ROWS", "")
    if not text:
        return DECODE_ROWS
    if text not in ("1", "2", "4", "8", "16"):
        raise ValueError(f"KINETIC_PALLAS_DECODE_ROWS={text!r}: the fewest rows of a decode "
                         "dot is 1, 2, 4, 8 or 16")
    return int(text)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6, 7, 9, 10, 11, 12, 14, 15, 16, 17))
def _matmul(x, qs: tuple, planes: tuple, specs: tuple, interpret: bool, tiles: tuple,
            dots: int, in_place: bool, groups: tuple | None = None, experts: int = 1,
            rows: int = BLOCK_M, glu: int = 0, partials: bool = False,
            norm: tuple | None = None, eps: float | None = None, act: str = "silu",
            pair_rows: int = 0, normed: bool = False):
    """The products of x [M, K] with each weight (its q, its other planes, its spec and its
    Tiling at the same place in qs, planes, specs and tiles), [M, N_w] each, in one
    pallas_call. Its grid is (tiles over M, every weight's programs in turn): a weight's
    programs are (tile over N, chunk of K), chunks fastest, as a call of that weight alone
    would number them, and each runs that weight's code alone (a GPU branches once a
    program, on its id).

    groups (a mixture's experts: PairBlocks.groups): (live [B] or None, expert [B]) int32,
    the grid's tiles over M being B blocks of 16 rows (the output's [B * 16]), block b's
    first live[b] rows (None: 1; 0: the block is skipped) for the expert `expert[b]`, read
    in place from x's rows 16 b.., or with pair_rows S > 0 from its row b // S (a pair a
    block: PairBlocks); each weight `experts` experts', stacked (Planes.experts): a
    block's programs read their expert's tiles, at the weight's offset of that expert.

    rows: each dot's rows (dot_rows), a program's dots * rows of x.

    glu > 0: x is (gate, up), two _matmul calls' partial sums ([chunks, rows >= glu, K]
    each, as partials=True returns them) and the product's x is silu(gate) * up of their
    first glu rows, made by each program from the blocks it reads (swiglu: no launch of
    its own): each partial sum added in order, as the call returning the total adds them,
    then jax.nn.silu, as XLA's, so the same values as matmul(silu(gate) * up, w); act
    "gelu": gelu_tanh(gate) * up instead (a GeGLU, Gemma's: layers.gelu_tanh's jnp code).
    partials: the [chunks, rows, N_w] partial sums themselves, not their total [M, N_w].

    norm (parts, bias, w, w_post), with eps: the product's x is rms_norm(h, w, eps) of h = x
    + (parts' sum + bias) (parts [C, >= M, >= K] a projection's partial sums over its chunks,
    or None: h = x; w_post not None: what is added normalized first, rms_norm(parts' sum +
    bias, w_post, eps)), made by each program from the rows it reads, pallas_norm's arithmetic (its
    sum_squares over the whole row first, then h * (1 / sqrt(mean + eps)) * w a block at a
    time): the residual add and the norm before a layer's projections with no launch of
    their own (normed: the call's first program writes the normalized x too, returned
    after h). x and the parts are read whole, in place; with parts, the programs of the
    call's first (g 0) write h, the new residual. Returns (the products, h or None).

    in_place: x is read where it is, unpadded, each program its rows at their place in
    it and rows past M masked off (a GPU's way: no padded copy of x, a kernel launch, per
    matmul); else x is padded to whole tiles and each program gets its block (interpreted:
    a masked load there pads the array it reads, so it should be a block). The same
    values reach the same dots either way (tests/test_pallas_matmul.py)."""
    xs = tuple(x) if glu else (x,)
    M, K = (glu, xs[0].shape[2]) if glu else x.shape
    norm_arrays = []
    if norm is not None:   # read whole, in place (masked), whichever the mode
        n_parts, n_bias, n_w, n_post = norm
        norm_arrays = [a for a in (n_parts, n_bias, jnp.asarray(n_w, jnp.float32),
                                   None if n_post is None else jnp.asarray(n_post, jnp.float32))
                       if a is not None]
        in_place = True
    BM = rows * dots
    Mp = -(-M // BM) * BM
    group_arrays = [a for a in groups or () if a is not None]
    if groups is not None:   # a block's rows anywhere in x: read in place
        in_place, Mp = True, groups[1].shape[0] * BM
    parts = [_Part(q.shape[0] // experts, K, spec, t, [K // p.shape[1] for p in ps],
                   len(qs) == 1) for q, ps, spec, t in zip(qs, planes, specs, tiles)]
    starts = np.cumsum([0] + [p.programs for p in parts]).tolist()
    if in_place and glu:    # gate's and up's partial sums where they are
        xp = list(xs)
        x_specs = [pl.BlockSpec(a.shape, lambda i, g: (0, 0, 0)) for a in xs]
    elif in_place:  # one x for every weight
        xp = [x.astype(jnp.float32)]
        x_specs = [pl.BlockSpec((M, K), lambda i, g: (0, 0))]
    elif glu:       # a block of each: the chunk's columns of every partial sum
        (part,), (start,) = parts, starts[:1]
        xp = [jnp.zeros((a.shape[0], Mp, K), jnp.float32).at[:, :M].set(a[:, :M])
              for a in xs]
        x_specs = [pl.BlockSpec((a.shape[0], BM, part.chunk),
                                part.index_map(start, lambda j, s: (0, s), rows_at=1))
                   for a in xs]
    else:           # a block of each weight's chunk for each
        xp = [jnp.zeros((Mp, K), jnp.float32).at[:M].set(x.astype(jnp.float32))]
        x_specs = [pl.BlockSpec((BM, p.chunk), p.index_map(start, lambda j, s: s, rows_at=0))
                   for p, start in zip(parts, starts)]
    norm_specs = [pl.BlockSpec(a.shape, lambda i, g, n=a.ndim: (0,) * n) for a in norm_arrays]
    arrays = [a for q, ps in zip(qs, planes) for a in (q, *ps)]
    if groups is None:
        w_specs = [spec for p, start in zip(parts, starts) for spec in p.in_specs(start)]
    else:           # whole: a program finds its expert's tiles itself
        whole = [pl.BlockSpec(a.shape, lambda i, g: (0, 0)) for a in arrays]
        w_specs = [pl.BlockSpec(a.shape, lambda i, g: (0,)) for a in group_arrays] + whole
        arrays = [*group_arrays, *arrays]

    writes_h = norm is not None and norm[0] is not None
    writes_y = norm is not None and normed

    def kernel(*refs):
        x_refs, refs = refs[:len(x_specs)], refs[len(x_specs):]
        norm_refs, refs = refs[:len(norm_arrays)], refs[len(norm_arrays):]
        y_ref, refs = (refs[-1], refs[:-1]) if writes_y else (None, refs)
        h_ref, refs = (refs[-1], refs[:-1]) if writes_h else (None, refs)
        # each weight's x: (x,) or (gate, up)
        x_refs = ([tuple(x_refs)] if glu else [(r,) for r in x_refs])
        x_refs = x_refs * (len(parts) // len(x_refs))
        first = pl.program_id(0) * BM        # (program ids read here, outside the loop:
        g = pl.program_id(1)                 # interpret mode has none inside it)
        load_x = None if norm is None else _norm_prologue(
            x_refs[0][0], norm_refs, h_ref, norm, eps, first, g, M, K, rows, dots, y_ref)
        limit, expert, ok = M, None, True
        if groups is not None:
            live_ref, refs = (None, refs) if groups[0] is None else (refs[0], refs[1:])
            expert_ref, *refs = refs
            b = pl.program_id(0)
            live = 1 if live_ref is None else live_ref[b]
            if pair_rows:   # a pair a block: its row of x
                first = lax.div(b, pair_rows)
            limit = first + live
            expert, ok = expert_ref[b], live_ref is None or live > 0
        o_refs = refs[-len(parts):]
        at = 0
        for w, (part, start, x_ref, o_ref) in enumerate(zip(parts, starts, x_refs, o_refs)):
            w_refs = refs[at:at + 1 + len(part.widths)]
            at += len(w_refs)
            tile_at = None if expert is None else (
                expert * part.n + lax.div(g - start, part.chunks) * part.tiles.bn)
            run = functools.partial(part.program, x_ref, w_refs, o_ref, first, limit,
                                    (rows, dots), in_place, interpret,
                                    lax.rem(g - start, part.chunks) * part.chunk, tile_at,
                                    load_x, act)
            if len(parts) == 1 and groups is None:
                run()
            else:
                pl.when(ok & (g >= start) & (g < starts[w + 1]))(run)

    h_out = [jax.ShapeDtypeStruct((M, K), jnp.float32)] * (writes_h + writes_y)
    ys = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((p.chunks, Mp, p.n), jnp.float32) for p in parts]
        + h_out,
        grid=(Mp // BM, starts[-1]),
        in_specs=[*x_specs, *norm_specs, *w_specs],
        out_specs=[pl.BlockSpec((None, BM, p.tiles.bn),
                                p.index_map(start, lambda j, s: (s, j), rows_at=1))
                   for p, start in zip(parts, starts)]
        + [pl.BlockSpec((M, K), lambda i, g: (0, 0))] * len(h_out),
        **pallas_backend.options(interpret, num_stages=STAGES),
    )(*(xp if glu else xp * len(x_specs)), *norm_arrays, *arrays)
    ys = list(ys)
    y = ys.pop() if writes_y else None
    h = ys.pop() if writes_h else None
    out = ys if partials else [summed(y)[:M if groups is None else Mp] for y in ys]
    if norm is None:
        return out
    return (out, h, y) if normed else (out, h)


def _norm_prologue(x_ref, norm_refs, h_ref, norm: tuple, eps: float, first, g, M: int,
                   K: int, R: int, dots: int, y_ref=None):
    """Inside _matmul's kernel, with its norm: each dot's rows' scale, pallas_norm's
    sum_squares over the whole row and rms_scale (h written by program g 0 on the way),
    and the function giving the product's x, h * scale * w, at dot d's R rows (R is
    pallas_norm.NORM_ROWS: its blocks' shape) and columns c0.. (width), as _Part.program's
    load_x: pallas_norm.rms_norm's arithmetic, a row's bits the same. y_ref: program g 0
    writes the normalized rows there whole too, a block of pallas_norm.norm_block(K) at a
    time."""
    from kinetic.kernels import pallas_norm
    if R != pallas_norm.NORM_ROWS:
        raise ValueError(f"a norm inside the matmul needs {pallas_norm.NORM_ROWS}-row dots, "
                         f"not {R}")
    parts, bias, _, post = norm
    refs = iter(norm_refs)
    p_ref = next(refs) if parts is not None else None
    b_ref = next(refs) if bias is not None else None
    w_ref = next(refs)
    post_ref = next(refs) if post is not None else None

    def at_live(d, c0, width):
        row = first + d * R
        live = row + lax.broadcasted_iota(jnp.int32, (R, width), 0) < M
        return (pl.ds(row, R), pl.ds(c0, width)), live
    # the projection's output normalized before the add (pallas_norm._rms's order)
    post_scales = [None if post_ref is None else pallas_norm.rms_scale(pallas_norm.sum_squares(
        lambda c0, width, d=d: pallas_norm.partials_block(p_ref, b_ref, *at_live(d, c0, width)),
        K), K, eps) for d in range(dots)]

    def h_block(d, c0, width):
        at, live = at_live(d, c0, width)
        post = None if post_ref is None else (post_scales[d], post_ref)
        return pallas_norm.residual_block(x_ref, p_ref, b_ref, at, live, post), at, live

    def scale(d):
        def load(c0, width):
            h, at, live = h_block(d, c0, width)
            if h_ref is not None:
                pltriton.store(h_ref.at[at], h, mask=live & (g == 0))
            return h
        return pallas_norm.rms_scale(pallas_norm.sum_squares(load, K), K, eps)
    scales = [scale(d) for d in range(dots)]

    def load_x(d: int, c0, width: int):
        h, at, _ = h_block(d, c0, width)
        return h * scales[d] * w_ref[at[1]][None, :]
    if y_ref is not None:
        nb = pallas_norm.norm_block(K)
        for d in range(dots):
            def write(c, carry, d=d):
                h, at, live = h_block(d, c * nb, nb)
                pltriton.store(y_ref.at[at], h * scales[d] * w_ref[at[1]][None, :],
                               mask=live & (g == 0))
                return carry
            lax.fori_loop(0, K // nb, write, 0)
    return load_x


def summed(parts: jax.Array) -> jax.Array:
    """The product from its partial sums [chunks, ...]: chunk 0's plus chunk 1's plus ...,
    in that order (the chunks are the weight's tiling's, so every row's order is the same)."""
    out = parts[0]
    for c in range(1, parts.shape[0]):
        out = out + parts[c]
    return out


@dataclass(frozen=True)
class _Part:
    """One weight of a _matmul call, as its programs see it: n rows (padded to ROWS; a
    stacked mixture's: one expert's), K columns, its Planes.spec, its Tiling and its
    planes' elements per column (widths)."""

    n: int
    K: int
    spec: tuple
    tiles: Tiling
    widths: list
    alone: bool         # the call's only weight (its programs are the whole grid's)

    @property
    def chunks(self) -> int:
        return self.tiles.chunks

    @property
    def chunk(self) -> int:
        return self.K // self.chunks

    @property
    def programs(self) -> int:
        return self.n // self.tiles.bn * self.chunks

    @property
    def q_cols(self) -> int:        # q's columns per chunk
        return self.chunk // 2 if self.spec[0] == "packed" else self.chunk

    def index_map(self, start: int, block, rows_at: int | None = None):
        """A BlockSpec's index map (i: tile over M, g: program) of this weight's program
        (tile over N j, chunk s) = divmod(g - start, chunks), clamped into this weight's
        range (a program of another weight maps to a block it never touches: not clamped
        where the weight is alone); block(j, s) gives the block's index, with i inserted
        at rows_at (None: a weight's block, the same for every tile over M)."""
        def index(i, g):
            local = g if self.alone else jnp.clip(g - start, 0, self.programs - 1)
            idx = block(lax.div(local, self.chunks), lax.rem(local, self.chunks))
            idx = idx if isinstance(idx, tuple) else (idx,)
            return idx if rows_at is None else (*idx[:rows_at], i, *idx[rows_at:])
        return index

    def in_specs(self, start: int) -> list:
        """q's block and each other plane's: [bn, the chunk's columns of it]."""
        return [pl.BlockSpec((self.tiles.bn, cols), self.index_map(start, lambda j, s: (j, s)))
                for cols in (self.q_cols, *(self.chunk // e for e in self.widths))]

    def program(self, x_ref, w_refs, o_ref, first, limit, block: tuple, in_place: bool,
                interpret: bool, col, tile_at=None, load_x=None, act: str = "silu"):
        """One program: its [R * dots, bn] tile of this weight's chunk's partial sum (block:
        (R, dots), R rows a dot), from x's rows at `first` (those from `limit` on masked
        off; in place: columns from `col`) and the weight's tiles, in blocks of bk in order
        over the chunk. tile_at: where the weight's refs are whole (a mixture's), the first
        of the tile's rows in them. load_x(d, c0, width): x's values at dot d's rows and
        those columns, where x is made in the kernel (_matmul's norm)."""
        BN, BK = self.tiles.bn, self.tiles.bk
        R, dots = block
        q_ref, *block_refs = w_refs

        def tile(ref, per: int, i, g: int | None = None):
            """Block i's columns of the tile (`per` elements a column of ref); g: only its
            g-th column ([bn, 1])."""
            start = i * (BK // per) + (0 if tile_at is None else col // per)
            at = pl.ds(start, BK // per) if g is None else pl.ds(start + g, 1)
            # (tile_at None: the program's own block; else the whole array)
            return ref[:, at] if tile_at is None else ref[pl.ds(tile_at, BN), at]

        def x_rows(d, i):
            """x's d-th R rows of block i, rows past the limit masked off (zeros, as
            padded, not read: a decode step's one row reads one row of x); x_ref (gate,
            up): silu(gate) * up of them, each the sum of its partial sums in order."""
            row = first + d * R
            if load_x is not None:
                return load_x(d, col + i * BK, BK)
            live = row + lax.broadcasted_iota(jnp.int32, (R, BK), 0) < limit
            at = ((pl.ds(row, R), pl.ds(col + i * BK, BK))
                  if in_place else (pl.ds(d * R, R), pl.ds(i * BK, BK)))
            if len(x_ref) == 1:
                return pltriton.load(x_ref[0].at[at], mask=live, other=0.0)
            gate, up = (pallas_backend.load_sum(ref, at, live) for ref in x_ref)
            return GLU[act](gate) * up

        kind, n_bits, _, group, _ = self.spec

        def block(i, accs):
            q = tile(q_ref, self.chunk // self.q_cols, i)
            if kind == "float":
                w = dequantize_tile(self.spec, q)
                return tuple(
                    acc + lax.dot_general(x_rows(d, i), w, (((1,), (1,)), ((), ())),
                                          precision=lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)
                    for d, acc in enumerate(accs))
            bits = [tile(r, e, i) for r, e in zip(block_refs[:n_bits], self.widths)]
            w = integers(self.spec, q, *bits).astype(jnp.int8)
            # each group's scale (and minimum) as a column [bn, 1] of its own
            groups = [[tile(r, e, i, g)
                       for r, e in zip(block_refs[n_bits:], self.widths[n_bits:])]
                      for g in range(BK // group)]
            return tuple(integer_block(x_rows(d, i), w, groups, group, acc, not interpret)
                         for d, acc in enumerate(accs))
        accs = lax.fori_loop(0, self.chunk // BK, block,
                             (jnp.zeros((R, BN), jnp.float32),) * dots)
        for d, acc in enumerate(accs):
            o_ref[pl.ds(d * R, R), :] = acc


def reference(x: np.ndarray, w: Planes) -> np.ndarray:
    """numpy's float64 x @ dequantize(w)^T: what matmul approximates (tests)."""
    dense = np.asarray(dequantize_tile(w.spec, w.q, *w.planes), np.float64)[:w.shape[0]]
    return np.asarray(x, np.float64) @ dense.T


def reference_arithmetic(x: np.ndarray, w: Planes, tiles: Tiling | None = None) -> np.ndarray:
    """The kernel's own arithmetic in numpy, float32 [M, N] (tests compare it): a block
    format's integer_block over each block of 32 in order, per chunk of the tiling, the
    chunks' sums added in order; a float weight's product in float64 rounded to float32
    (its dots' order is the compiler's, checked against this within rounding)."""
    N, K = w.shape
    if w.kind == "float":
        return reference(x, w).astype(np.float32)
    tiles = tiles or tiling(w.q.shape[0], K)
    kind, n_bits, offset, group, has_m = w.spec
    ints = np.asarray(integers(w.spec, w.q, *w.planes[:n_bits]))[:N]          # [N, K]
    d = np.asarray(w.planes[n_bits], np.float32)[:N]                          # [N, K / group]
    m = np.asarray(w.planes[n_bits + 1], np.float32)[:N] if has_m else None
    acts = kernel_reference.quantize_acts("q8_0", x)   # the C++ kernel's rounding of x
    q, dx = acts.q.astype(np.int32), acts.d
    chunk = K // tiles.chunks
    y = None
    for c in range(tiles.chunks):
        acc = np.zeros((x.shape[0], N), np.float32)
        for b in range(c * chunk // QK, (c + 1) * chunk // QK):
            for g in range(QK // group):
                cols = slice(b * QK + g * group, b * QK + (g + 1) * group)
                dot = (q[:, cols] @ ints[:, cols].T).astype(np.float32)
                gi = cols.start // group
                acc = acc + (dx[:, b:b + 1] * d[None, :, gi]) * dot
                if has_m:
                    total = q[:, cols].sum(axis=1, keepdims=True).astype(np.float32)
                    acc = acc + (dx[:, b:b + 1] * total) * m[None, :, gi]
        y = acc if y is None else y + acc
    return y
