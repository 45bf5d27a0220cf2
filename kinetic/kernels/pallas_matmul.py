"""Quantized matmul as a Pallas kernel: the first piece of the GPU kernel "pallas".

    planes = repack(data, qtype, (N, K))      once, at load: GGUF blocks -> aligned planes
    y = matmul(x, planes)                     y[M, N] = x[M, K] @ W[N, K]^T, float32

The weights stay quantized on the device, GGUF's blocks split once into planes (`Planes`):
the quants (Q8_0: int8 [N, K]; Q4_0: the block's 16 packed bytes as they are, uint8
[N, K / 2], low nibbles elements 0..15 and high ones 16..31) and the blocks' scales (float32
[N, K / 32], the file's half floats widened, exactly). A kernel program dequantizes a
[BN, BK] tile of W in registers (`dequantize_tile`: one multiply, d * q or d * (q - 8), the
arithmetic of kinetic/model/quants.py, so the same bits), never to global memory.

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
FORMATS = {T.Q8_0: "q8_0", T.Q4_0: "q4_0"}


@dataclass(frozen=True)
class Planes:
    """A [N, K] weight in its GGUF format, split into planes (module docstring)."""

    fmt: str               # "q8_0" or "q4_0"
    q: jax.Array           # int8 [N, K] (q8_0) or uint8 [N, K / 2] (q4_0)
    d: jax.Array           # float32 [N, K / 32]: each block's scale

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.d.shape[1] * QK


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
    per = {T.Q8_0: 34, T.Q4_0: 18}[qtype]
    blocks = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if blocks.size != N * K // QK * per:
        raise ValueError(f"{blocks.size} bytes do not hold a {qtype.name} [{N}, {K}] weight")
    blocks = blocks.reshape(N, K // QK, per)
    d = blocks[..., :2].copy().view("<f2").astype(np.float32).reshape(N, K // QK)
    q = blocks[..., 2:].reshape(N, -1)
    if qtype == T.Q8_0:
        q = q.view(np.int8)
    return Planes(FORMATS[qtype], jnp.asarray(q), jnp.asarray(d))


def dequantize_tile(fmt: str, q: jax.Array, d: jax.Array) -> jax.Array:
    """float32 [n, k] of a tile's quants ([n, k] int8 or [n, k / 2] uint8) and scales
    ([n, k / 32]): the kernel's own arithmetic, one multiply per element."""
    n, blocks = d.shape
    if fmt == "q4_0":
        b = q.reshape(n, blocks, QK // 2)
        nib = jnp.concatenate([b & 0x0F, b >> 4], axis=-1).astype(jnp.int32) - 8
    else:
        nib = q.reshape(n, blocks, QK).astype(jnp.int32)
    return (nib.astype(jnp.float32) * d[..., None]).reshape(n, blocks * QK)


def _divisor(n: int, sizes: tuple[int, ...]) -> int:
    return next((s for s in sizes if n % s == 0), n)


def tiles(N: int, K: int) -> tuple[int, int]:
    """(BN, BK) of a [N, K] weight: fixed by its shape alone, never by M."""
    return _divisor(N, (128, 64, 32, 16, 8)), _divisor(K, (256, 128, 64, 32))


def matmul(x: jax.Array, w: Planes, interpret: bool | None = None) -> jax.Array:
    """x [M, K] (any float type, computed in float32) @ w^T -> float32 [M, N]."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _matmul(x, w.q, w.d, w.fmt, interpret)


@functools.partial(jax.jit, static_argnums=(3, 4))
def _matmul(x, q, d, fmt: str, interpret: bool):
    M, K = x.shape
    N = q.shape[0]
    BN, BK = tiles(N, K)
    Mp = -(-M // BLOCK_M) * BLOCK_M
    xp = jnp.zeros((Mp, K), jnp.float32).at[:M].set(x.astype(jnp.float32))
    qk = BK if fmt == "q8_0" else BK // 2   # quant columns per BK elements

    def kernel(x_ref, q_ref, d_ref, o_ref):
        def block(i, acc):
            xs = x_ref[:, pl.ds(i * BK, BK)]
            w = dequantize_tile(fmt, q_ref[:, pl.ds(i * qk, qk)],
                                d_ref[:, pl.ds(i * (BK // QK), BK // QK)])
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
                  pl.BlockSpec((BN, K // QK), lambda i, j: (j, 0))],
        out_specs=pl.BlockSpec((BLOCK_M, BN), lambda i, j: (i, j)),
        interpret=interpret,
    )(xp, q, d)
    return out[:M]


def reference(x: np.ndarray, w: Planes) -> np.ndarray:
    """numpy's float64 x @ dequantize(w)^T: what matmul approximates (tests)."""
    N, K = w.shape
    dense = np.asarray(dequantize_tile(w.fmt, w.q, w.d), np.float64)
    return np.asarray(x, np.float64) @ dense.T
