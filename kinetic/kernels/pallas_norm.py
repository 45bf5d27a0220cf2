"""The norms as a Pallas kernel: a step's norms on a GPU (model/layers.py `rms_norm`,
model/bert.py `layer_norm`).

    y = rms_norm(x, w, eps)          x [..., D] -> float32 [..., D], x / sqrt(mean(x^2) + eps) * w
    y = layer_norm(x, w, b, eps)     (x - mean) / sqrt(var + eps) * w + b
    h, y = add_rms_norm(x, parts, bias, w, eps)      h = x + (parts' sum + bias), y = its norm

XLA computes a norm's mean as a reduction whose order it picks from the whole array's shape:
on a CPU it gave a row other bits at 16 rows than at 1 (bench/gpu.py's row pieces measure
the same on a GPU), which is why a CPU runs it in C++. Here a row's arithmetic never depends
on how many rows share the call or which; the number of rows only sets the grid.

The RMS norm: one program normalizes NORM_ROWS (16) rows, a block of norm_block(D) columns
at a time: the sum of squares is `sum_squares`'s, each [16, nb] block's row sums added in
order, then each block's h * (1 / sqrt(mean + eps)) * w written. The blocks have this
shape whatever D, the row count, or the kernel: a layer's projections normalize their x
themselves with the same function (kernels/pallas_matmul.py's norm), and so does the
rotary kernel a head (kernels/pallas_rope.py), all three the same bits for a row (XLA's
and Triton's row sums depend on the block's shape: interpreted here, a [4, 256] block's
row gave other bits than a [16, 256] one's). x, the parts and y are read and written where
they are, the rows past the last masked off.

The layer norm: one program a block of rows (`block_rows`: 16, fewer for rows wider than
512), the mean and the variance each one reduction of the block, whose shape depends on D
alone; a block's rows past the last and columns past D (it is D padded to a power of 2:
Triton's arrays have power-of-2 sizes) are zeros, which add nothing, and their output is
dropped: on a GPU by masks on loads and stores (no padded copies), interpreted by padding.

Interpreted wherever JAX's backend is not a GPU (kernels/pallas_backend.py);
tests/test_pallas_norm.py checks it there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kinetic.kernels import pallas_backend

BLOCK_ELEMENTS = 8192   # a layer norm's block: 16 rows of up to 512 values, fewer if wider
NORM_ROWS = 16          # an RMS norm's rows a program (and a block of its sum of squares)
NORM_BLOCK = 128       # the most columns of a block of the sum of squares (norm_block)


def block_rows(Dp: int) -> int:
    """The layer norm's rows per program for rows of Dp (a power of 2) values: up to 16,
    fewer for wide rows so that a block stays in registers (64 values a thread at 4 warps).
    Fixed by the width alone, never by the number of rows."""
    return max(1, min(16, BLOCK_ELEMENTS // Dp))


def norm_block(D: int) -> int:
    """The columns of each block of an RMS norm's sum of squares (`sum_squares`): the
    largest power of 2 up to NORM_BLOCK that divides D. Fixed by the width alone."""
    nb = NORM_BLOCK
    while D % nb:
        nb //= 2
    return nb


def sum_squares(load, D: int) -> jax.Array:
    """Inside a kernel: [NORM_ROWS, 1], the sum of the squares of NORM_ROWS rows of D values,
    a block of norm_block(D) columns at a time, each block's row sums added in order
    (`load(c0, nb)`: the rows' [NORM_ROWS, nb] values at columns c0..; rows past the last
    zeros). The RMS norm's order wherever a row is normalized (module docstring)."""
    nb = norm_block(D)

    def add(c, acc):
        v = load(c * nb, nb)
        return acc + jnp.sum(v * v, axis=1, keepdims=True)
    return lax.fori_loop(0, D // nb, add, jnp.zeros((NORM_ROWS, 1), jnp.float32))


def rms_scale(total: jax.Array, D: int, eps: float) -> jax.Array:
    """1 / sqrt(mean + eps) from sum_squares' total: what each value is multiplied by
    before the weight (x * scale * w)."""
    return 1.0 / jnp.sqrt(total / D + eps)


def residual_block(x_ref, parts_ref, bias_ref, at: tuple, live, post=None) -> jax.Array:
    """Inside a kernel: the block `at` (rows, columns) of h = x + (parts' sum + bias), as
    add_rms_norm adds them (XLA's order): the partial sums [C, rows, cols] in order, then
    the bias [D] (None: none), then the residual x; parts_ref None: x alone. post (scale
    [rows, 1], w_ref): what is added is normalized first, (sum + bias) * scale * w (a
    norm after the projection: post_add_rms_norm). The positions off `live` are zeros,
    not read."""
    x = pltriton.load(x_ref.at[at], mask=live, other=0.0)
    if parts_ref is None:
        return x
    total = partials_block(parts_ref, bias_ref, at, live)
    if post is not None:
        scale, w_ref = post
        total = total * scale * w_ref[at[1]][None, :]
    return x + total


def partials_block(parts_ref, bias_ref, at: tuple, live) -> jax.Array:
    """Inside a kernel: the block `at` of a projection's output from its partial sums, added
    in order, then its bias (layers.Pending.value's order)."""
    total = pallas_backend.load_sum(parts_ref, at, live)
    return total if bias_ref is None else total + bias_ref[at[1]][None, :]


def rms_norm(x: jax.Array, w: jax.Array, eps: float, interpret: bool | None = None) -> jax.Array:
    """x [..., D] (any float type, computed in float32), w [D] -> float32 [..., D]."""
    lead, D = x.shape[:-1], x.shape[-1]
    y = _rms(x.reshape(-1, D), w, float(eps), pallas_backend.interpreted(interpret))
    return y.reshape(*lead, D)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float,
               interpret: bool | None = None) -> jax.Array:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis of x [..., D] -> float32
    (BERT's norm: model/bert.py). The mean is one reduction of the block, as the variance."""
    return _rows(x, w, b, eps, interpret)


def add_rms_norm(x: jax.Array, parts: jax.Array, bias: jax.Array | None, w: jax.Array,
                 eps: float, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(h, rms_norm(h, w, eps)), h = x + (parts[0] + parts[1] + ... + bias): a residual add
    and the norm after it in one launch (model/layers.py `add_norm`), where XLA would add in
    a kernel of its own. x [M, D]; parts [C, >= M, >= D]: a projection's partial sums over
    the chunks of its K (pallas_matmul's partials) or one array [1, M, D]; bias [D] or
    None. The sum is XLA's order (the chunks in order, then the bias, then x), so h is the
    bits of `x + linear(...)`, and y the bits of rms_norm(h)."""
    return _rms(x, w, float(eps), pallas_backend.interpreted(interpret), parts, bias)


def post_add_rms_norm(x: jax.Array, parts: jax.Array, bias: jax.Array | None,
                      w_post: jax.Array, w: jax.Array, eps: float,
                      interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """(h, rms_norm(h, w, eps)), h = x + rms_norm(parts' sum + bias, w_post, eps): a norm
    after a projection, the residual add and the next norm in one launch (Gemma 3's layers:
    model/layers.py `post_add_norm`), where they were the partial sums' add, two norm
    kernels and XLA's add. The bits of those apart (each norm pallas_norm's arithmetic)."""
    return _rms(x, w, float(eps), pallas_backend.interpreted(interpret), parts, bias, w_post)


def _rows(x, w, b, eps: float, interpret: bool | None) -> jax.Array:
    lead, D = x.shape[:-1], x.shape[-1]
    interpret = pallas_backend.interpreted(interpret)
    y = _norm(x.reshape(-1, D), w, b, float(eps), interpret, not interpret)
    return y.reshape(*lead, D)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _rms(x, w, eps: float, interpret: bool, parts=None, bias=None, post=None):
    """The RMS norm of x [M, D]'s rows, or with parts (add_rms_norm) of h = x + (parts' sum
    + bias), returning (h, y); with post too (post_add_rms_norm), of h = x + rms_norm(parts'
    sum + bias, post). One program NORM_ROWS rows: sum_squares over them, then block by
    block h * rms_scale * w (and h) written; everything read and written in place, the rows
    past M masked off (module docstring)."""
    M, D = x.shape
    nb = norm_block(D)
    adds = parts is not None
    extra = [bias, post] if adds else []
    args = [x.astype(jnp.float32), jnp.asarray(w, jnp.float32)]
    args += [parts] if adds else []
    args += [jnp.asarray(a, jnp.float32) for a in extra if a is not None]

    def kernel(x_ref, w_ref, *refs):
        p_ref = refs[0] if adds else None
        ins = iter(refs[1:])
        b_ref, post_ref = (next(ins) if a is not None else None for a in (extra or [None] * 2))
        first = pl.program_id(0) * NORM_ROWS

        def at_live(c0, width):
            at = (pl.ds(first, NORM_ROWS), pl.ds(c0, width))
            return at, first + lax.broadcasted_iota(jnp.int32, (NORM_ROWS, width), 0) < M
        post_scale = None
        if post_ref is not None:   # the projection's output normalized before the add
            post_scale = rms_scale(sum_squares(
                lambda c0, width: partials_block(p_ref, b_ref, *at_live(c0, width)), D),
                D, eps)

        def rows(c0, width):
            at, live = at_live(c0, width)
            post = None if post_ref is None else (post_scale, post_ref)
            return residual_block(x_ref, p_ref, b_ref, at, live, post), at, live
        scale = rms_scale(sum_squares(lambda c0, width: rows(c0, width)[0], D), D, eps)

        def write(c, carry):
            h, at, live = rows(c * nb, nb)
            if adds:
                pltriton.store(refs[-2].at[at], h, mask=live)
            pltriton.store(refs[-1].at[at], h * scale * w_ref[at[1]][None, :], mask=live)
            return carry
        lax.fori_loop(0, D // nb, write, 0)

    def whole(a):
        return pl.BlockSpec(a.shape, lambda i, n=a.ndim: (0,) * n)
    shape = jax.ShapeDtypeStruct((M, D), jnp.float32)
    out = pl.pallas_call(
        kernel,
        out_shape=[shape, shape] if adds else shape,
        grid=(-(-M // NORM_ROWS),),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(shape), whole(shape)] if adds else whole(shape),
        **pallas_backend.options(interpret),
    )(*args)
    return tuple(out) if adds else out


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _norm(x, w, b, eps: float, interpret: bool, in_place: bool):
    """The layer norm of x [M, D]'s rows. in_place: x, w, b and y are read and written
    where they are, unpadded, each program its rows at their place and the padding masked
    off (a GPU's way: no padded copies, kernels of their own, around each norm); else they
    are padded to whole blocks (interpreted: a masked load there pads the array it reads).
    The same values reach the same arithmetic either way (tests/test_pallas_norm.py)."""
    M, D = x.shape
    Dp = pl.next_power_of_2(D)
    BM = block_rows(Dp)
    Mp = -(-M // BM) * BM
    vectors = [w, b]
    if in_place:
        args = [x.astype(jnp.float32), *(jnp.asarray(v, jnp.float32) for v in vectors)]
        rows_spec = pl.BlockSpec((M, D), lambda i: (0, 0))        # the whole of x, of y
        vector_spec = pl.BlockSpec((D,), lambda i: (0,))
        out_shape = (M, D)
    else:
        def row(v):   # a [D] vector as [1, Dp], zeros past D
            return jnp.zeros((1, Dp), jnp.float32).at[0, :D].set(jnp.asarray(v, jnp.float32))
        args = [jnp.zeros((Mp, Dp), jnp.float32).at[:M, :D].set(x.astype(jnp.float32)),
                *map(row, vectors)]
        rows_spec = pl.BlockSpec((BM, Dp), lambda i: (i, 0))      # a program's block
        vector_spec = pl.BlockSpec((1, Dp), lambda i: (0, 0))
        out_shape = (Mp, Dp)

    def kernel(x_ref, w_ref, b_ref, o_ref):
        first = pl.program_id(0) * BM
        cols = lax.broadcasted_iota(jnp.int32, (BM, Dp), 1)
        live = (first + lax.broadcasted_iota(jnp.int32, (BM, Dp), 0) < M) & (cols < D)

        def vector(ref):   # [1, Dp], zeros past D
            if not in_place:
                return ref[...]
            inside = lax.broadcasted_iota(jnp.int32, (Dp,), 0) < D
            return pltriton.load(ref.at[pl.ds(0, Dp)], mask=inside, other=0.0)[None, :]
        if in_place:
            v = pltriton.load(x_ref.at[pl.ds(first, BM), pl.ds(0, Dp)], mask=live, other=0.0)
        else:
            v = x_ref[...]
        # (the padding's x - mean would be -mean: times 0 it adds nothing to the variance)
        v = (v - jnp.sum(v, axis=1, keepdims=True) / D) * (cols < D).astype(jnp.float32)
        var = jnp.sum(v * v, axis=1, keepdims=True) / D
        y = v * (1.0 / jnp.sqrt(var + eps)) * vector(w_ref) + vector(b_ref)
        if in_place:
            pltriton.store(o_ref.at[pl.ds(first, BM), pl.ds(0, Dp)], y, mask=live)
        else:
            o_ref[...] = y

    shape = jax.ShapeDtypeStruct(out_shape, jnp.float32)
    out = pl.pallas_call(
        kernel,
        out_shape=shape,
        grid=(Mp // BM,),
        in_specs=[rows_spec] + [vector_spec] * len(vectors),
        out_specs=rows_spec,
        **pallas_backend.options(interpret),
    )(*args)
    return out[:M, :D]
