"""Quantized matmul as a Pallas kernel: the first piece of the GPU kernel "pallas".

    planes = repack(data, qtype, (N, K))      once, at load: GGUF blocks -> aligned planes
    y = matmul(x, planes)                     y[M, N] = x[M, K] @ W[N, K]^T, float32

The weights stay quantized on the device, GGUF's blocks split once into planes (`Planes`):
the quants (Q8_0: int8 [N, K]; the 4- and 5-bit formats: the block's 16 packed bytes as they
are, uint8 [N, K / 2], low nibbles elements 0..15 and high ones 16..31), the blocks' scales
and minimums (float32 [N, K / 32], the file's half floats widened, exactly) and the Q5
formats' fifth bits (int32 [N, K / 32], bit i for element i). A kernel program dequantizes a
[BN, BK] tile of W in registers (`dequantize_tile`: the arithmetic of
kinetic/model/quants.py, d * q, d * (q - 8), d * q + m ..., so the same bits), never to
global memory.

Batch-invariant by construction: a program computes one [BM, BN] tile of y; its reduction
over K walks K in blocks of BK, in order, each block one dot of the same shape
[BM, BK] x [BK, BN] accumulated in float32 (precision HIGHEST: no TF32). BM is fixed
(BLOCK_M) and BK, BN depend only on the weight's shape, so a row's arithmetic is the same
whatever M is and whichever rows share its call or its tile; M only sets how many tiles the
grid has. tests/test_pallas_matmul.py checks it bitwise, with Pallas in interpret mode on
CPU (interpret=None picks it wherever JAX's backend is not a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from jax import lax
from jax.experimental import pallas as pl

BLOCK_M = 16          # rows of x per program, whatever M is (padding rows are dropped)
QK = 32               # elements per block of the 32-element formats
FORMATS = {T.Q8_0: "q8_0", T.Q4_0: "q4_0", T.Q4_1: "q4_1", T.Q5_0: "q5_0", T.Q5_1: "q5_1"}
# bytes of a block: scale d (f16), minimum m (f16, _1 formats), fifth bits qh (u32, Q5),
# then the quants
_LAYOUT = {T.Q8_0: (34, False, False), T.Q4_0: (18, False, False),
           T.Q4_1: (20, True, False), T.Q5_0: (22, False, True), T.Q5_1: (24, True, True)}


@dataclass(frozen=True)
class Planes:
    """A [N, K] weight in its GGUF format, split into planes (module docstring)."""

    fmt: str               # FORMATS' names
    q: jax.Array           # int8 [N, K] (q8_0) or uint8 [N, K / 2] (the others)
    d: jax.Array           # float32 [N, K / 32]: each block's scale
    m: jax.Array | None = None    # float32 [N, K / 32]: each block's minimum (q4_1, q5_1)
    qh: jax.Array | None = None   # int32 [N, K / 32]: each block's fifth bits (q5_0, q5_1)

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.d.shape[1] * QK

    @property
    def per_block(self) -> tuple[jax.Array, ...]:
        """The planes with one column per block, in dequantize_tile's order."""
        return tuple(a for a in (self.d, self.m, self.qh) if a is not None)


def repack(data: np.ndarray, qtype, shape: tuple[int, int]) -> Planes:
    """Planes of a GGUF tensor's bytes (`data`) of type `qtype` and numpy shape (N, K).
    Raises ValueError for a type the kernel lacks, naming it, or bytes that do not fit."""
    qtype = T(qtype)
    if qtype not in FORMATS:
        raise ValueError(f"the pallas kernel has no {qtype.name} matmul "
                         f"(it has {', '.join(t.name for t in FORMATS)})")
    N, K = shape
    if K % QK:
        raise ValueError(f"a {qtype.name} weight's rows must be whole blocks of {QK}, not {K}")
    per, has_m, has_qh = _LAYOUT[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if blocks.size != N * K // QK * per:
        raise ValueError(f"{blocks.size} bytes do not hold a {qtype.name} [{N}, {K}] weight")
    blocks = blocks.reshape(N, K // QK, per)

    def half(at: int) -> jax.Array:
        return jnp.asarray(blocks[..., at:at + 2].copy().view("<f2").astype(np.float32)
                           .reshape(N, K // QK))
    at = 4 if has_m else 2
    qh = None
    if has_qh:
        qh = jnp.asarray(blocks[..., at:at + 4].copy().view("<u4").view(np.int32)
                         .reshape(N, K // QK))
        at += 4
    q = blocks[..., at:].reshape(N, -1)
    if qtype == T.Q8_0:
        q = q.view(np.int8)
    return Planes(FORMATS[qtype], jnp.asarray(q), half(0), half(2) if has_m else None, qh)


def dequantize_tile(fmt: str, q: jax.Array, d: jax.Array, *rest: jax.Array) -> jax.Array:
    """float32 [n, k] of a tile's quants ([n, k] int8 or [n, k / 2] uint8), scales
    ([n, k / 32]) and the format's other per-block planes (Planes.per_block: minimums, fifth
    bits): the kernel's own arithmetic, quants.py's operations in its order."""
    n, blocks = d.shape
    rest = list(rest)
    m = rest.pop(0) if fmt in ("q4_1", "q5_1") else None
    if fmt == "q8_0":
        v = q.reshape(n, blocks, QK).astype(jnp.int32)
    else:
        b = q.reshape(n, blocks, QK // 2)
        v = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).astype(jnp.int32)
    if fmt in ("q5_0", "q5_1"):
        bits = (rest.pop(0)[..., None] >> jnp.arange(QK, dtype=jnp.int32)) & 1
        v = v | (bits << 4)
    v = v - {"q4_0": 8, "q5_0": 16}.get(fmt, 0)
    out = v.astype(jnp.float32) * d[..., None]
    if m is not None:
        out = out + m[..., None]
    return out.reshape(n, blocks * QK)


def _divisor(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if n % s == 0), n)


def tiles(N: int, K: int) -> tuple[int, int]:
    """(BN, BK) of a [N, K] weight: fixed by its shape alone, never by M."""
    return _divisor(N, (128, 64, 32, 16, 8)), _divisor(K, (256, 128, 64, 32))


def matmul(x: jax.Array, w: Planes, interpret: bool | None = None) -> jax.Array:
    """x [M, K] (any float type, computed in float32) @ w^T -> float32 [M, N]."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _matmul(x, w.q, w.per_block, w.fmt, interpret)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _matmul(x, q, per_block: tuple, fmt: str, interpret: bool):
    M, K = x.shape
    N = q.shape[0]
    BN, BK = tiles(N, K)
    Mp = -(-M // BLOCK_M) * BLOCK_M
    xp = jnp.zeros((Mp, K), jnp.float32).at[:M].set(x.astype(jnp.float32))
    qk = BK if fmt == "q8_0" else BK // 2   # quant columns per BK elements

    def kernel(x_ref, q_ref, *refs):
        *block_refs, o_ref = refs

        def block(i, acc):
            xs = x_ref[:, pl.ds(i * BK, BK)]
            w = dequantize_tile(fmt, q_ref[:, pl.ds(i * qk, qk)],
                                *(r[:, pl.ds(i * (BK // QK), BK // QK)] for r in block_refs))
            return acc + lax.dot_general(xs, w, (((1,), (1,)), ((), ())),
                                         precision=lax.Precision.HIGHEST,
                                         preferred_element_type=jnp.float32)
        o_ref[...] = lax.fori_loop(0, K // BK, block, jnp.zeros((BLOCK_M, BN), jnp.float32))

    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        grid=(Mp // BLOCK_M, N // BN),
        in_specs=[pl.BlockSpec((BLOCK_M, K), lambda i, j: (i, 0)),
                  pl.BlockSpec((BN, q.shape[1]), lambda i, j: (j, 0)),
                  *[pl.BlockSpec((BN, K // QK), lambda i, j: (j, 0))] * len(per_block)],
        out_specs=pl.BlockSpec((BLOCK_M, BN), lambda i, j: (i, j)),
        interpret=interpret,
    )(xp, q, *per_block)
    return out[:M]


def reference(x: np.ndarray, w: Planes) -> np.ndarray:
    """numpy's float64 x @ dequantize(w)^T: what matmul approximates (tests)."""
    dense = np.asarray(dequantize_tile(w.fmt, w.q, *w.per_block), np.float64)
    return np.asarray(x, np.float64) @ dense.T
