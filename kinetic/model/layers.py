"""Pieces every architecture shares: norms, rotary embeddings, projections, paged attention.

Axis alphabet for every einsum in kinetic/model (declared once, here):
  t token rows of a step   s sequence slots   l key positions of a slot
  d model width            h query heads      k kv heads      g query heads per kv head
  q head width             f ffn width        v vocabulary

Determinism: a step is a fixed block of T token rows. Nothing here lets row i read row j's
values except through the KV cache of row i's own sequence; attention reduces over a fixed,
padded key axis where masked keys add exact zeros. See tests/test_invariance.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from kinetic.kernels import attention as native_attention
from kinetic.kernels import ffi as native
from kinetic.kernels import target
from kinetic.kernels.reference import FORMATS, Q8_0
from kinetic.model import device_split
from kinetic.model.config import Config


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInput:
    """One forward step's token rows, all of shape [T] except `page_table`.

    tokens, positions: the token and its position in its sequence.
    slots: which sequence slot the row belongs to (index into page_table).
    write_index: flat cache row (page * page_size + offset) where the row's K/V are stored;
      padding rows point into the reserved page 0, which no sequence ever reads as valid.
    page_table: [S, P] page ids of each slot's sequence, in order.
    logit_rows: [R] the rows whose logits are returned, in order (None: all T).
    logit_mask: [T] int32, with logit_rows None: the rows whose logits are computed (nonzero);
      the others' logits are unspecified and never read (None: every row's). A step that samples several rows pays
      the output projection, the largest matrix of a small model, for those rows alone.
    recur: the recurrent layers' part (kinetic/model/delta_net.Recur; None: no such layer).
    embeds, embed_mask: [T, D] and [T]: rows whose input is the given embedding (an image's
      rows, where embed_mask is 1) instead of their token's (None: every row is a token).
    attend_end: [T] the last key position each row sees (an image whose rows see each other
      both ways: its last row's; None: the row's own position, causal).
    heads (static): the mesh whose devices each hold their share of the KV heads' cache
      (model/device_split.py, by_heads; None: every device the whole cache).
    """

    tokens: jax.Array
    positions: jax.Array
    slots: jax.Array
    write_index: jax.Array
    page_table: jax.Array
    logit_rows: jax.Array | None = None
    recur: object | None = None
    embeds: jax.Array | None = None
    embed_mask: jax.Array | None = None
    attend_end: jax.Array | None = None
    logit_mask: jax.Array | None = None
    heads: Any = field(default=None, metadata=dict(static=True))


def output_logits(x: jax.Array, step: StepInput, norm: jax.Array, output: Proj | None,
                  eps: float) -> jax.Array:
    """The logits [R, V] of the step's rows step.logit_rows ([R] row indices, the rows that
    are sampled; None: all T rows of x [T, D]) after the final norm. A prompt chunk samples
    only its last row, one before it none, and the output projection is the largest matrix
    of a small model: R = 0 skips it. output None (an embedding model): the normed hidden
    states [R, D] themselves. step.logit_mask: only the masked rows' logits are computed."""
    if step.logit_rows is not None:
        if step.logit_rows.shape[0] == 0:
            return jnp.zeros((0, x.shape[1] if output is None else output.shape[1]), jnp.float32)
        x = jnp.take(x, step.logit_rows, axis=0)
    x = rms_norm(x, norm, eps)
    return x if output is None else linear(x, output, live=step.logit_mask)


def _native_rows() -> bool:
    """Whether the row-wise pieces XLA computes differently per row count (norms, rotary
    cos/sin) run in kinetic's C++ instead: wherever the library is built and the step is
    traced for the CPU (kernels/target.py), whichever kernel multiplies the weights.
    Decided at each trace, never cached: a CPU may trace a step for a GPU."""
    return native.usable()


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * w over the last axis. XLA's reduction here gave a row
    other bits at 16 rows than at 1 on a CPU (bench/gpu.py's row pieces), so it runs in
    C++ on a CPU (_native_rows) and as a Pallas kernel on a GPU (kernels/pallas_norm.py:
    the same block shape for every row count); XLA's own (xla_rms_norm) elsewhere, or on a
    GPU with KINETIC_GPU_NORM=xla."""
    if _native_rows():
        return native.rms_norm(x, w, eps)
    if pallas_norms():
        from kinetic.kernels import pallas_norm
        return pallas_norm.rms_norm(x, w, eps)
    return xla_rms_norm(x, w, eps)


def pallas_norms() -> bool:
    """Whether a step's norms are the Pallas kernel's (kernels/pallas_norm.py): when it is
    traced for a GPU, unless KINETIC_GPU_NORM=xla. Decided at each trace."""
    return target.backend() == "gpu" and _gpu_norm() != "xla"


def norms_in_matmul(rows: int) -> bool:
    """Whether a pre-norm layer's residual add and norm, in a step of `rows` rows, are made
    inside the projections' kernel after them (Normed: pallas_matmul's norm) rather than a
    norm kernel of their own: on a GPU unless KINETIC_GPU_NORM=kernel (or xla), in a
    decode step's few rows (pallas_matmul.variant 1: each program then reads the rows'
    residual and partial sums whole, which costs little at a few rows and too much at
    many: a prompt's norms stay kernels of their own, the same arithmetic, so a row's bits
    are the same either way), while a dot has 16 rows (the norm's blocks:
    KINETIC_PALLAS_DECODE_ROWS unset or 16). Decided at each trace."""
    if not pallas_norms() or _gpu_norm() != "pallas":
        return False
    from kinetic.kernels import pallas_matmul, pallas_norm
    return (pallas_matmul.variant(rows) == 1
            and pallas_matmul.decode_rows() == pallas_norm.NORM_ROWS)


def _gpu_norm() -> str:
    """KINETIC_GPU_NORM: pallas (the default: norms inside the projections where they can
    be, else Pallas kernels of their own), kernel (always kernels of their own) or xla."""
    text = os.environ.get("KINETIC_GPU_NORM", "pallas")
    if text not in ("pallas", "kernel", "xla"):
        raise ValueError(f"KINETIC_GPU_NORM={text!r}: pallas, kernel or xla")
    return text


def xla_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """rms_norm as XLA computes it (its reduction's order is XLA's choice)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


DENSE = -1  # Proj.fmt of a dense matrix (the pure-JAX path)
PLANES = -2  # Proj.fmt of a weight as the pallas kernel's planes (kernels/pallas_matmul.py)


@partial(jax.tree_util.register_dataclass, data_fields=["data"],
         meta_fields=["fmt", "offset", "n", "k", "act_quant", "mesh", "owner", "rows"])
@dataclass(frozen=True)
class Proj:
    """A projection W [N, K] (y = x . W^T, n outputs from k inputs), in one of two forms:

    - packed (fmt = the GGML type id): W stays in its GGUF blocks; `data` is the whole
      memory-mapped file as a uint8 array (one zero-copy buffer shared by every weight) and W
      starts `offset` bytes into it. kinetic's C++ kernel multiplies it (kinetic/kernels),
      rounding activations as llama.cpp does, exact by construction. fmt may carry
      kernels.REPACK16: the blocks rearranged at load into the 16-column layout (same bytes,
      same results; weights._Packer).
    - dense (fmt = DENSE): `data` is W transposed, [K, N], in a compute dtype, multiplied by
      XLA (GPU, non-x86, KINETIC_KERNEL=xla); `act_quant` emulates llama.cpp's activation
      rounding there: "q8_0", "q8_K", "f16" or "" (see weights.py).
    - planes (fmt = PLANES): `data` is a pallas_matmul.Planes, W still quantized, multiplied
      by the pallas kernel (kernel "pallas"); a mixture's experts are one Proj of them all,
      stacked (experts.py).

    mesh (packed only): W split over the devices of this mesh (model/device_split.py): by
    rows (`--split-mode row`: `rows`, each device's count of them), or whole on the device
    `owner` (`--split-mode layer`); `offset` is then into each device's own buffer, `n`
    still W's."""

    data: jax.Array
    fmt: int = DENSE
    offset: int = 0
    n: int = 0
    k: int = 0
    act_quant: str = ""
    mesh: Any = None
    owner: int = -1
    rows: tuple = ()

    @property
    def shape(self) -> tuple[int, int]:
        """(k, n): inputs, outputs."""
        if self.fmt == PLANES:
            n, k = self.data.shape
            return k, n
        return tuple(self.data.shape) if self.fmt == DENSE else (self.k, self.n)


def quantize_activations(x: jax.Array, kind: str) -> jax.Array:
    """x rounded as llama.cpp's CPU matmul rounds it before an integer dot product, so that
    our float dot sees the values llama.cpp multiplies. [..., K] -> [..., K] float32."""
    if kind == "f16":
        return x.astype(jnp.float16).astype(jnp.float32)
    if kind not in ("q8_0", "q8_K"):
        return x
    block = 32 if kind == "q8_0" else 256
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    if kind == "q8_0":
        d = jnp.max(jnp.abs(xb), axis=-1, keepdims=True) / 127.0
        inv = jnp.where(d > 0, 1.0 / d, 0.0)
        q = jnp.round(xb * inv)
        d = d.astype(jnp.float16).astype(jnp.float32)
    else:  # q8_K: the scale comes from the signed value of largest magnitude
        idx = jnp.argmax(jnp.abs(xb), axis=-1, keepdims=True)
        amax = jnp.take_along_axis(xb, idx, axis=-1)
        inv = jnp.where(amax != 0, -127.0 / amax, 0.0)
        q = jnp.minimum(jnp.round(xb * inv), 127.0)
        d = jnp.where(amax != 0, 1.0 / inv, 0.0)
    return (q * d).reshape(x.shape)


@dataclass(frozen=True)
class Pending:
    """A projection's output [M, N] not yet summed: the pallas kernel's partial sums over
    the chunks of its K ([C, >= M, >= N]: pallas_matmul's partials), and its bias. What a
    residual add takes whole into the next norm's kernel (add_norm), where summing it first
    would be a kernel of its own on a GPU; `value` gives the array linear would have."""

    parts: jax.Array
    rows: int
    cols: int
    bias: jax.Array | None = None

    def value(self) -> jax.Array:
        from kinetic.kernels import pallas_matmul
        y = pallas_matmul.summed(self.parts)[:self.rows, :self.cols]
        return y if self.bias is None else y + self.bias


def partial_sums(y: jax.Array | Pending) -> tuple[jax.Array, jax.Array | None]:
    """(parts, bias) of what a norm's kernel adds: a Pending's partial sums and bias, or
    an array as one part [1, M, N] and no bias."""
    return (y.parts, y.bias) if isinstance(y, Pending) else (y[None], None)


def value(y) -> jax.Array:
    """y itself, or a Pending's or a Normed's array."""
    return y.value() if isinstance(y, (Pending, Normed)) else y


@dataclass
class Normed:
    """rms_norm(x + y, w, eps) not yet computed: a pre-norm layer's input as residual_layers
    hands it to a mixer or a feed-forward that takes it whole (rotated_qkv, swiglu), whose
    projections' kernel adds and normalizes its x itself (pallas_matmul's norm:
    pallas_norm's bits, and no launch of its own on a GPU). x: the residual [T, D]; y: what
    is added to it (Pending, an array, or None: nothing, the first layer's norm). Anything
    else takes `value()` (add_norm's or rms_norm's result). Either way `residual()` is then
    x + y, the next add's x. post (Gemma 3's norm after a projection): y is normalized
    with it before the add (post_add_norm's), x + rms_norm(y, post, eps)."""

    x: jax.Array
    y: Any
    w: jax.Array
    eps: float
    post: jax.Array | None = None
    _residual: jax.Array | None = None
    _value: jax.Array | None = None

    @property
    def shape(self) -> tuple:
        return self.x.shape

    @property
    def ndim(self) -> int:
        return self.x.ndim

    def value(self) -> jax.Array:
        if self._value is None:
            if self.y is None:
                self._residual, self._value = self.x, rms_norm(self.x, self.w, self.eps)
            elif self.post is not None:
                self._residual, self._value = post_add_norm(self.x, self.y, self.post,
                                                            self.w, self.eps)
            else:
                self._residual, self._value = add_norm(self.x, self.y, self.w, self.eps)
        return self._value

    def norm(self) -> tuple:
        """pallas_matmul's norm: (parts, bias, w, eps[, post])."""
        if self.y is None:
            return None, None, self.w, self.eps
        post = () if self.post is None else (self.post,)
        return (*partial_sums(self.y), self.w, self.eps, *post)

    @property
    def made(self) -> bool:
        """Whether its value is computed already (a kernel wrote the normed rows, or
        value() ran): what else takes it reads that, not another norm inside its launch."""
        return self._value is not None

    def took(self, h: jax.Array | None, normed: jax.Array | None = None) -> None:
        """A projections' kernel normalized it and wrote h, x + y (None: x, nothing added),
        and maybe the normed rows themselves."""
        if self._residual is None:
            self._residual = self.x if h is None else h
        if normed is not None and self._value is None:
            self._value = normed

    def residual(self) -> jax.Array:
        """x + y (computed with the norm if no kernel took it)."""
        if self._residual is None:
            self.value()
        return self._residual


def residual(x: jax.Array | None, h) -> jax.Array:
    """The residual after h, a layer's normed input, was used: x, or where h is a Normed
    (x None then), the x + y that its kernel made."""
    return h.residual() if isinstance(h, Normed) else x


def add_and_norm(x: jax.Array, y, w: jax.Array, eps: float, fused: bool,
                 post: jax.Array | None = None) -> tuple[jax.Array | None, Any]:
    """(x + y, its norm) before a layer's next block (y None: x and its norm; post: y
    normalized with it first, Gemma 3's), as Normed.value makes them (add_norm,
    post_add_norm or rms_norm); fused: (None, the Normed itself), for projections that
    make the add and the norm inside their launch (norms_in_matmul)."""
    h = Normed(x, y, w, eps, post)
    return (None, h) if fused else (h.residual(), h.value())


def norm_inside(x, run):
    """run(x, norm) of a Pallas launch whose x may be a Normed: an array (or a Normed whose
    value is made already: that value) with norm None, returning its output; else the
    Normed's residual x and its pallas_matmul norm, returning (output, h[, the normed
    rows]), which the Normed takes (Normed.took). The output either way."""
    if isinstance(x, Normed) and x.made:
        x = x.value()
    if not isinstance(x, Normed):
        return run(x, None)
    out, *made = run(x.x, x.norm())
    x.took(*made)
    return out


def add_norm(x: jax.Array, y: jax.Array | Pending, w: jax.Array,
             eps: float) -> tuple[jax.Array, jax.Array]:
    """(x + y, rms_norm(x + y, w, eps)): a residual add and the norm after it. Where the
    norms are the Pallas kernel's (a GPU), one launch (pallas_norm.add_rms_norm) that reads
    y's partial sums itself (y Pending), the same bits as the add and the norm apart."""
    if pallas_norms():
        from kinetic.kernels import pallas_norm
        return pallas_norm.add_rms_norm(x, *partial_sums(y), w, eps)
    x = x + value(y)
    return x, rms_norm(x, w, eps)


def post_add_norm(x: jax.Array, y, w_post: jax.Array, w: jax.Array,
                  eps: float) -> tuple[jax.Array, jax.Array]:
    """(h, rms_norm(h, w, eps)), h = x + rms_norm(y, w_post, eps): a norm after a
    projection, the residual add and the next norm (Gemma 3's). Where the norms are the
    Pallas kernel's (a GPU), one launch (pallas_norm.post_add_rms_norm) reading y's partial
    sums itself (y Pending: linear's pending), h within the added term's rounding of the
    ops apart (the add may be an FMA there)."""
    if pallas_norms():
        from kinetic.kernels import pallas_norm
        return pallas_norm.post_add_rms_norm(x, *partial_sums(y), w_post, w, eps)
    x = x + rms_norm(value(y), w_post, eps)
    return x, rms_norm(x, w, eps)


def linear(x: jax.Array, p: Proj, b: jax.Array | None = None,
           live: jax.Array | None = None, pending: bool = False) -> jax.Array | Pending:
    """x [..., K] . W^T -> [..., N] float32: the one swap point between the C++ kernel
    (packed weights) and XLA's dot (dense ones). live [T] (x [T, K]): the rows wanted; the
    others are unspecified (the C++ kernel neither computes nor writes them; XLA's dot gives
    0; the pallas kernel computes them). pending (a residual's projection, x [T, K]): a
    Pending where the pallas kernel's output goes into the next norm's kernel (add_norm),
    else the array."""
    if pending and _pending(x, [p]) and live is None:
        from kinetic.kernels import pallas_matmul
        return Pending(pallas_matmul.matmul(x, p.data, partials=True), x.shape[0],
                       p.shape[1], b)
    if p.fmt in (DENSE, PLANES):
        if p.fmt == PLANES and p.mesh is not None:
            y = device_split.planes_linear(x, p.data, p.mesh, p.rows)
        elif p.fmt == PLANES:
            from kinetic.kernels import pallas_matmul   # (JAX's Pallas: imported on use)
            y = pallas_matmul.matmul(x, p.data)
        else:
            x = quantize_activations(x, p.act_quant)
            y = jnp.dot(x.astype(p.data.dtype), p.data, preferred_element_type=jnp.float32)
        if live is not None and p.fmt == DENSE:   # (the pallas kernel's are left as they
            y = jnp.where(live[:, None] != 0, y, 0.0)   # are: a pass over [T, N] saved)
    elif p.mesh is not None:
        (y,) = device_split.linear_many(x, p.data, [(p.fmt, p.offset, p.n)], p.k, p.mesh,
                                        live, p.owner, [p.rows])
    else:
        y = native.qmatmul(x, p.data, p.fmt, p.offset, p.n, p.k, live)
    return y if b is None else y + b


def _pending(x: jax.Array, projs) -> bool:
    """Whether a residual's projection of x by projs can stay Pending: the pallas
    kernel's planes, unsplit, x [T, K], and the norms the Pallas kernel's (add_norm)."""
    return (x.ndim == 2 and pallas_norms()
            and all(p.fmt == PLANES and p.mesh is None for p in projs))


def linear_many(x: jax.Array | Normed, projs: list[Proj], biases=None,
                partials: bool = False) -> list[jax.Array]:
    """[linear(x, p, b) for each p]: packed weights of one buffer go through one kernel call
    (the activations rounded once, every part's columns split over the threads together),
    which costs less than a call each, and so do the pallas kernel's planes (one launch on
    a GPU where there would be one a weight, pallas_matmul.matmul_many); the results are
    the same bits. x may be a Normed: its add and norm made inside that launch where the
    norms are the Pallas kernel's (pallas_matmul's norm), else its value. partials (x [T,
    K], no biases): each product as partial sums [chunks, >= T, >= N] for a Pallas kernel
    that adds them itself (pallas_backend.load_sum): the pallas kernel's own, else the
    product as [1, T, N]."""
    biases = biases or [None] * len(projs)
    if isinstance(x, Normed) and not _pending(x, projs):
        x = x.value()
    if all(p.fmt == PLANES and p.mesh is None for p in projs):
        from kinetic.kernels import pallas_matmul
        data = [p.data for p in projs]
        ys = norm_inside(x, lambda x, norm: pallas_matmul.matmul_many(
            x, data, partials=partials, norm=norm))
        return [y if b is None else y + b for y, b in zip(ys, biases)]
    if partials:
        return [y[None] for y in linear_many(x, projs, biases)]
    packed = all(p.fmt >= 0 for p in projs) and len({id(p.data) for p in projs}) == 1
    if not packed or len({p.owner for p in projs}) > 1:
        return [linear(x, p, b) for p, b in zip(projs, biases)]
    parts = [(p.fmt, p.offset, p.n) for p in projs]
    mesh = projs[0].mesh
    ys = (native.qmatmul_many(x, projs[0].data, parts, projs[0].k) if mesh is None
          else device_split.linear_many(x, projs[0].data, parts, projs[0].k, mesh,
                                        owner=projs[0].owner, rows=[p.rows for p in projs]))
    return [y if b is None else y + b for y, b in zip(ys, biases)]


def rope_angles(positions: jax.Array, cfg: Config, base: float,
                freq_factors: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """cos and sin, [T, rope_dim / 2], for the rows' positions."""
    half = cfg.rope_dim // 2
    # a constant, computed once in float64 (XLA's pow, fused into the loop below, gave a row
    # other bits at 2 rows than at 1)
    inv_freq = float(base) ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)
    scale, mscale = cfg.rope_freq_scale, 1.0
    if cfg.rope_yarn:   # each frequency's own mix of kept and interpolated, also a constant
        inv_freq = inv_freq * yarn_mix(cfg, base)
        scale = 1.0
        mscale = cfg.rope_attn_factor * (1.0 + 0.1 * math.log(1.0 / cfg.rope_freq_scale))
    inv_freq = jnp.asarray(inv_freq.astype(np.float32))
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors
    theta = (positions.astype(jnp.float32) * scale)[:, None] * inv_freq[None, :]
    if _native_rows():  # XLA's cos and sin gave a row other bits at 2 rows than at 1
        cos, sin = native.cos_sin(theta)
    else:
        cos, sin = jnp.cos(theta), jnp.sin(theta)
    return (cos, sin) if mscale == 1.0 else (cos * mscale, sin * mscale)


def yarn_mix(cfg: Config, base: float) -> np.ndarray:
    """YaRN's factor on each rotary frequency [rope_dim / 2] (float64): 1 for the fast ones
    (more than yarn_beta_fast rotations over the original context: kept), rope_freq_scale
    for the slow ones (fewer than yarn_beta_slow: interpolated), a linear ramp between, as
    llama.cpp's rope computes it."""
    d = cfg.rope_dim

    def dim_of(rotations: float) -> float:
        return d * math.log(cfg.rope_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low = max(0.0, math.floor(dim_of(cfg.yarn_beta_fast)))
    high = min(d - 1.0, math.ceil(dim_of(cfg.yarn_beta_slow)))
    i = np.arange(d // 2, dtype=np.float64)
    keep = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)
    return cfg.rope_freq_scale * (1.0 - keep) + keep


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, neox: bool) -> jax.Array:
    """Rotate the first rope_dim features of each head of x [T, H, Q]."""
    rot = cos.shape[-1] * 2
    xr, rest = x[..., :rot], x[..., rot:]
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:  # pairs (i, i + rot/2)
        a, b = xr[..., : rot // 2], xr[..., rot // 2:]
        out = jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    else:  # adjacent pairs (2i, 2i+1)
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(xr.shape)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# a q8_0 cache row: GGUF's Q8_0 blocks, an f16 scale and 32 int8 in 34 bytes
Q8_0_BLOCK, Q8_0_BYTES = FORMATS[Q8_0].qk, FORMATS[Q8_0].bytes


def kv_storage(kv_dtype: str, width: int) -> tuple[int, jnp.dtype]:
    """How a cache row of `width` values is stored: (last dimension, array dtype). q8_0: the
    row's width / 32 blocks as bytes (uint8), each d (f16) then q (int8 x 32), value d * q,
    as GGUF stores Q8_0 (kinetic/kernels/csrc/common.h); the float types as themselves."""
    if kv_dtype == "q8_0":
        return width // Q8_0_BLOCK * Q8_0_BYTES, jnp.dtype(jnp.uint8)
    return width, jnp.dtype(kv_dtype)


def quantize_q8_0(x: jax.Array) -> jax.Array:
    """x [..., n] (n a multiple of 32) as q8_0 blocks, uint8 [..., n / 32 * 34]: per block
    d = max|x| / 127, q = x * (1 / d) rounded to nearest even (0 where d is 0), d stored as
    f16, as kinetic/kernels/csrc/quantize.cc q8_0_row rounds (llama.cpp's q8_0)."""
    x = x.astype(jnp.float32)
    xb = x.reshape(*x.shape[:-1], -1, Q8_0_BLOCK)
    d = jnp.max(jnp.abs(xb), axis=-1) / jnp.float32(127)
    inv = jnp.where(d > 0, jnp.float32(1) / jnp.where(d > 0, d, 1), 0)
    q = jnp.clip(jnp.round(xb * inv[..., None]), -127, 127).astype(jnp.int8)
    d_bytes = lax.bitcast_convert_type(d.astype(jnp.float16), jnp.uint8)   # [..., nb, 2]
    blocks = jnp.concatenate([d_bytes, lax.bitcast_convert_type(q, jnp.uint8)], axis=-1)
    return blocks.reshape(*x.shape[:-1], -1)


def dequantize_q8_0(b: jax.Array) -> jax.Array:
    """q8_0 blocks uint8 [..., n / 32 * 34] as float32 [..., n], d * q (exact)."""
    blocks = b.reshape(*b.shape[:-1], -1, Q8_0_BYTES)
    d = lax.bitcast_convert_type(blocks[..., :2].reshape(*blocks.shape[:-1], 1, 2),
                                 jnp.float16)[..., 0].astype(jnp.float32)   # [..., nb]
    q = lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    return (d[..., None] * q).reshape(*b.shape[:-1], -1)


def to_cache(x: jax.Array, cache_dtype) -> jax.Array:
    """Values x [..., n] in a cache's storage (its dtype; uint8: q8_0 blocks)."""
    if jnp.dtype(cache_dtype) == jnp.uint8:
        return quantize_q8_0(x)
    return x.astype(cache_dtype)


def from_cache(c: jax.Array) -> jax.Array:
    """A cache's stored rows as float32 values (exact)."""
    return dequantize_q8_0(c) if c.dtype == jnp.uint8 else c.astype(jnp.float32)


def rotation_sizes(kv: tuple[jax.Array, jax.Array], head_dim: int,
                   v_head_dim: int) -> tuple[int, int]:
    """The Hadamard rotations of a layer whose cache is `kv` (0: none), as llama.cpp rotates
    a quantized cache (its attn_rot_k / attn_rot_v): keys (and queries) in blocks of the
    largest power of two that divides head_dim, values (and the attention's output) in
    blocks of 64, each only where its head width is a multiple of 64. A rotation leaves
    q.k and the weighted sum of values the same in exact arithmetic and spreads a head's
    outlier channels (Qwen2.5's keys reach 140 beside a median of 7) over the whole block
    that q8_0 quantizes with one scale. Float caches are not rotated."""
    if kv[0].dtype != jnp.uint8:
        return 0, 0
    nk = 64 if head_dim % 64 == 0 else 0
    while nk and head_dim % (2 * nk) == 0:
        nk *= 2
    return nk, 64 if v_head_dim % 64 == 0 else 0


def hadamard(x: jax.Array, n: int) -> jax.Array:
    """x [..., D] with each block of n values of its last dimension (D a multiple of n, n a
    power of two) multiplied by the orthonormal Walsh-Hadamard matrix of size n (Sylvester's
    order; its own inverse). As butterflies, elementwise: a row's bits never depend on the
    rows beside it (an XLA dot's could). On CPU one C++ call (csrc/hadamard.h, the same
    operations: as XLA ops the butterflies of 4 rotations a layer added 20 MiB of code to
    each compiled step of SmolLM2)."""
    if _native_rows():
        return native.hadamard(x, n)
    shape = x.shape
    y = x.astype(jnp.float32).reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = jnp.stack([a + b, a - b], axis=2)
        h *= 2
    return y.reshape(shape) * jnp.float32(1 / np.sqrt(n))


def cached_attention(q: jax.Array, k: jax.Array | None, v: jax.Array | None,
                     kv: tuple[jax.Array, jax.Array], step: StepInput, scale: float,
                     kernel: str, window: int = 0, softcap: float = 0.0,
                     ends: jax.Array | None = None,
                     gate: jax.Array | None = None) -> tuple[jax.Array, tuple]:
    """One layer's attention over its paged cache: the step's k [T, K, Q] and v [T, K, Qv]
    written into kv (write_kv_pair), then q [T, H, Q] attends over it (paged_attention).
    Returns (out [T, H, Qv], the new kv). A quantized cache holds its keys and values
    rotated (rotation_sizes): q and k are rotated before, the output rotated back after.
    k and v None: kv has the step's rows already (rope_write's, a float cache). gate:
    paged_attention's (kernel "pallas", which checks it, and no split over devices)."""
    if gate is not None and step.heads is not None:
        raise ValueError("an output gate inside the attention is the pallas kernel's, unsplit")
    if k is None:
        nk = nv = 0
    else:
        nk, nv = rotation_sizes(kv, k.shape[-1], v.shape[-1])
    if nk:
        q, k = hadamard(q, nk), hadamard(k, nk)
    if nv:
        v = hadamard(v, nv)

    def attend(q, k, v, kv, step, ends):
        if k is not None:
            kv = write_kv_pair(kv, k, v, step.write_index)
        return paged_attention(q, *kv, step, scale, window=window, softcap=softcap,
                               kernel=kernel, ends=ends, gate=gate), kv

    if step.heads is None:
        a, kv = attend(q, k, v, kv, step, ends)
    else:   # each device its KV heads' pages and their queries
        a, kv = device_split.by_heads(attend, step.heads)(
            q, k, v, kv, dataclasses.replace(step, heads=None), ends)
    return (hadamard(a, nv) if nv else a), kv


def rotated_qkv(x: jax.Array, w: dict, cfg: Config, kv: tuple[jax.Array, jax.Array],
                step: StepInput, cos: jax.Array, sin: jax.Array, neox: bool,
                head_norms: bool = False, fuse: bool = True):
    """A dense layer's attention inputs from its normed x [T, D] (or a Normed, made in the
    projections' kernel where rope_write runs): (q [T, H, Q], k, v, kv),
    q and k rotated, with head_norms each head of q and k RMS-normalized first (Qwen3's
    attn_q_norm and attn_k_norm), for cached_attention. Where a GPU's step runs it (and
    `fuse`), one launch (rope_write) has written k and v into kv already: k and v are None
    then, and q is in the cache's type. Else qkv, rms_norm and apply_rope as XLA runs them."""
    fused = rope_write(x, w, cfg, kv, step, cos, sin, neox, head_norms) if fuse else None
    if fused is not None:
        q, kv = fused
        return q, None, None, kv
    q, k, v = qkv(value(x), w, cfg)
    if head_norms:
        q = rms_norm(q, w["attn_q_norm"], cfg.norm_eps)
        k = rms_norm(k, w["attn_k_norm"], cfg.norm_eps)
    return apply_rope(q, cos, sin, neox), apply_rope(k, cos, sin, neox), v, kv


def rope_write(x: jax.Array, w: dict, cfg: Config, kv: tuple[jax.Array, jax.Array],
               step: StepInput, cos: jax.Array, sin: jax.Array, neox: bool,
               head_norms: bool = False, q_gated: bool = False):
    """(q [T, H, Q] rotated, kv with the step's k rotated and v written) of a dense layer's
    normed x [T, D] in one launch where a GPU's step runs it (kernels/pallas_rope.py: q, k
    and v read as their projections' partial sums, XLA's three kernels a layer between
    them gone; with head_norms the heads' RMS norms too, two Pallas launches fewer), the
    bits of qkv, rms_norm, apply_rope and cached_attention's write as a step jitted here
    runs them (tests/test_pallas_rope.py). None where it does not apply (the step of a CPU
    or of a split, a quantized cache, a head or a rotary part Triton cannot block, biases
    beside head norms): the caller runs those instead (rotated_qkv). q_gated (Qwen3.5's
    attn_q: each head's q then its output gate): (q, kv, the q projection's partial sums
    [C, >= T, >= 2 H Q]), from which the paged attention's kernel reads each head's gate
    (pallas_attention's gate)."""
    projs = [w["attn_q"], w["attn_k"], w["attn_v"]]
    biases = [w.get(f"attn_{n}.bias") for n in "qkv"]
    from kinetic.kernels import pallas_rope
    if (step.heads is not None or cfg.v_head_dim != cfg.head_dim or not _pending(x, projs)
            or kv[0].dtype != kv[1].dtype
            or ((head_norms or q_gated) and any(b is not None for b in biases[:2]))
            or not pallas_rope.supported(cfg.head_dim, 2 * cos.shape[-1], kv[0].dtype)):
        return None
    from kinetic.kernels import pallas_matmul
    data = [p.data for p in projs]
    parts = norm_inside(x, lambda x, norm: pallas_matmul.matmul_many(x, data, partials=True,
                                                                   norm=norm))
    norms = (w["attn_q_norm"], w["attn_k_norm"], cfg.norm_eps) if head_norms else None
    q, k_cache, v_cache = pallas_rope.rope_write(
        *parts, biases, cos, sin, step.write_index, kv[0], kv[1],
        (cfg.n_head, cfg.n_kv_head), neox, norms, q_gated=q_gated)
    if not q_gated:
        return q, (k_cache, v_cache)
    return q, (k_cache, v_cache), parts[0]


def write_kv_pair(kv: tuple[jax.Array, jax.Array], k: jax.Array, v: jax.Array,
                  write_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The layer's (k_cache, v_cache) with the step's new rows k [T, K, Q] and v [T, K, Qv]
    written at write_index. On CPU one C++ call writes both in place (XLA's scatter cost
    about 15 us per array and layer there); elsewhere write_kv. The same values either way
    (rounded to the cache's type to nearest even); of two rows with one index (padding
    rows, in the reserved page) the later stays in C++, either in XLA."""
    if _native_rows():
        return native.kv_write(kv[0], kv[1], k, v, write_index)
    return write_kv(kv[0], k, write_index), write_kv(kv[1], v, write_index)


def write_kv(cache: jax.Array, new: jax.Array, write_index: jax.Array) -> jax.Array:
    """Scatter new [T, K, Q] rows into cache [pages, page_size, K, Q] (donated: no copy),
    in the cache's storage (to_cache)."""
    pages, page_size = cache.shape[:2]
    flat = cache.reshape(pages * page_size, *cache.shape[2:])
    if new.shape[0] == 1:
        flat = lax.dynamic_update_slice_in_dim(flat, to_cache(new, cache.dtype),
                                               write_index[0], 0)
    else:
        flat = flat.at[write_index].set(to_cache(new, cache.dtype), unique_indices=False)
    return flat.reshape(cache.shape)


def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, step: StepInput,
                    scale: float, window: int = 0, softcap: float = 0.0,
                    kernel: str = "xla", ends: jax.Array | None = None,
                    gate: jax.Array | None = None) -> jax.Array:
    """Attention of each row's queries q [T, H, Q] over its own sequence's keys, causal
    unless ends says otherwise.

    ends [T]: each row's last visible key (>= its position), for an image whose rows attend
    to each other both ways; None: the positions. A window's lower bound is always from the
    row's own position (llama.cpp masks key p0 for query p1 when (causal and p0 > p1) or
    p1 - p0 >= n_swa).

    kernel "ffi": kinetic's C++ kernel (kinetic/kernels/attention.py), which walks only the
    row's own visible keys in one fixed order: a row's bits depend neither on T nor on the
    other rows nor on the page table's width (XLA's einsums below change a row's bits with
    T). kernel "xla": as follows.

    Every row is scored against each slot's keys in turn, at one shape per slot ([T] rows x
    [L] keys, L = P * page_size), and keeps its own slot's result with an exact select. So
    a row's bits depend neither on its slot's index nor on how many slots the step has (a
    joint (slot, key) reduction would change its order with both). Masked keys add exact
    zeros. Returns [T, H, Qv].

    gate (kernel "pallas" only): Qwen3.5's output gate as its projection's partial sums,
    each head's output multiplied by sigmoid(its gate) inside the kernel
    (pallas_attention's gate).
    """
    if gate is not None and kernel != "pallas":
        raise ValueError("an output gate inside the attention is the pallas kernel's")
    if kernel == "ffi":
        return native_attention.paged_attention(q, k_cache, v_cache, step, scale, window, softcap,
                                                ends)
    if kernel == "pallas":
        if k_cache.dtype == jnp.uint8 or v_cache.dtype == jnp.uint8:
            raise ValueError("the pallas kernel reads float caches (f32, f16, bf16), not q8_0")
        from kinetic.kernels import pallas_attention
        return pallas_attention.paged_attention(q, k_cache, v_cache, step.page_table, step.slots,
                                                step.positions, scale, window, softcap, ends,
                                                gate)
    T, H, Q = q.shape
    S, P = step.page_table.shape
    page_size, K = k_cache.shape[1], k_cache.shape[2]
    Qv = v_cache.shape[-1]
    if v_cache.dtype == jnp.uint8:   # q8_0 blocks: 32 values in 34 bytes
        Qv = Qv // Q8_0_BYTES * Q8_0_BLOCK
    L = P * page_size
    # q meets the cache in its storage type, as llama.cpp's f16 cache makes it (exact for f32;
    # q8_0 keys: each head's row quantized and read back, as llama.cpp quantizes the query)
    q = (dequantize_q8_0(quantize_q8_0(q)) if k_cache.dtype == jnp.uint8
         else q.astype(k_cache.dtype).astype(jnp.float32))
    qg = q.reshape(T, K, H // K, Q) * scale  # [T, K, G, Q]
    key_pos = jnp.arange(L, dtype=jnp.int32)[None, :]
    pos = step.positions[:, None]
    end = pos if ends is None else jnp.asarray(ends, jnp.int32)[:, None]
    visible = key_pos <= end  # [T, L]
    if window:
        visible &= key_pos > pos - window
    out = None
    for s in range(S):
        keys = from_cache(k_cache[step.page_table[s]]).reshape(L, K, Q)  # [L, K, Q]
        vals = from_cache(v_cache[step.page_table[s]]).reshape(L, K, Qv)
        scores = jnp.einsum("tkgq,lkq->tkgl", qg, keys, preferred_element_type=jnp.float32)
        if softcap:
            scores = softcap * jnp.tanh(scores / softcap)
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        # rows of other slots may see no key at all: keep them finite, they are discarded
        m = jnp.max(scores, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(scores - m)
        p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
        o = jnp.einsum("tkgl,lkq->tkgq", p, vals, preferred_element_type=jnp.float32)
        out = o if out is None else jnp.where((step.slots == s)[:, None, None, None], o, out)
    return out.reshape(T, H, Qv)  # [T, H, Qv]


def residual_layers(x: jax.Array, weights: dict, cache: list, eps: float, mixer, ffn,
                    ffn_norm: str = "ffn_norm",
                    take_normed: tuple[bool, bool] = (False, False)) -> tuple[jax.Array, list]:
    """A pre-norm decoder's layers over x [T, D]: per layer i, x += mixer(i, attn_norm(x), w,
    the layer's cache) (which returns its output and the layer's new cache: attention, or a
    hybrid's other mixer) then x += ffn(i, ffn_norm(x), w). Returns (x, the new cache).
    Each add and the norm after it (the next layer's attn_norm after the ffn's add) are one
    add_norm; the mixer's and the ffn's output may be Pending (linear's pending).
    take_normed (the mixer's, the ffn's): whether it takes its input as a Normed, whose
    add and norm its projections' kernel makes (where norms_in_matmul)."""
    blocks, new_cache = weights["blk"], []
    fused = [t and norms_in_matmul(x.shape[0]) for t in take_normed]

    def normed(x, y, w, who: int):
        """add_and_norm for the mixer (0) or the ffn (1)."""
        return add_and_norm(x, y, w, eps, fused[who])

    if len(blocks):
        x, h = normed(x, None, blocks[0]["attn_norm"], 0)
    for i, (w, layer_cache) in enumerate(zip(blocks, cache)):
        y, layer_cache = mixer(i, h, w, layer_cache)
        x, h = normed(residual(x, h), y, w[ffn_norm], 1)
        with jax.named_scope("ffn"):
            f = ffn(i, h, w)
            x = residual(x, h)
            if i + 1 < len(blocks):
                x, h = normed(x, f, blocks[i + 1]["attn_norm"], 0)
            else:
                x = x + value(f)
        new_cache.append(layer_cache)
    return x, new_cache


def gelu_tanh(x: jax.Array) -> jax.Array:
    return jax.nn.gelu(x, approximate=True)


def swiglu_ffn(x: jax.Array, w: dict, pending: bool = False) -> jax.Array | Pending:
    return swiglu(x, w["ffn_gate"], w["ffn_up"], w["ffn_down"], pending)


def swiglu(x: jax.Array, gate_w: Proj, up_w: Proj, down_w: Proj,
           pending: bool = False, act: str = "silu") -> jax.Array | Pending:
    """down(silu(gate(x)) * up(x)): a SwiGLU feed-forward (a layer's, or an expert's); act
    "gelu": gelu_tanh(gate(x)) * up(x), a GeGLU (Gemma's). The pallas kernel's weights,
    unsplit, where the step is not the CPU's (silu_times): two launches, the product made
    inside the second (pallas_matmul.swiglu), x's add and norm inside the first where x is
    a Normed. pending: as linear's."""
    projs = (gate_w, up_w, down_w)
    if not _native_rows() and all(p.fmt == PLANES and p.mesh is None for p in projs):
        from kinetic.kernels import pallas_matmul
        data = [p.data for p in projs]
        partials = bool(pending and _pending(x, projs))
        y = norm_inside(x, lambda x, norm: pallas_matmul.swiglu(
            x, *data, partials=partials, norm=norm, act=act))
        return Pending(y, x.shape[0], down_w.shape[1]) if partials else y
    x = value(x)
    gate, up = linear_many(x, [gate_w, up_w])
    return linear(silu_times(gate, up) if act == "silu" else gelu_tanh(gate) * up, down_w)


def silu_times(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up. On CPU in C++ (_native_rows; csrc/glu.h): XLA ran it as a fusion
    that its runtime split over its own sleeping threads, 40-52 us a layer at a 16-row step
    of Qwen2.5-Coder-0.5B, where the kernel's threads take 18-20 us."""
    if _native_rows():
        return native.swiglu(gate, up)
    return jax.nn.silu(gate) * up


def geglu_ffn(x: jax.Array, w: dict, pending: bool = False) -> jax.Array | Pending:
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's feed-forward (swiglu's, act "gelu")."""
    return swiglu(x, w["ffn_gate"], w["ffn_up"], w["ffn_down"], pending, act="gelu")


def qkv(x: jax.Array, w: dict, cfg: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer's q [T, H, Q], k [T, K, Q] and v [T, K, Qv] projections (biases where the
    file has them), through one kernel call."""
    T = x.shape[0]
    q, k, v = linear_many(x, [w["attn_q"], w["attn_k"], w["attn_v"]],
                          [w.get("attn_q.bias"), w.get("attn_k.bias"), w.get("attn_v.bias")])
    return (q.reshape(T, cfg.n_head, cfg.head_dim), k.reshape(T, cfg.n_kv_head, cfg.head_dim),
            v.reshape(T, cfg.n_kv_head, cfg.v_head_dim))


def input_rows(step: StepInput, table: jax.Array | Proj, scale: float = 1.0) -> jax.Array:
    """The step's input rows [T, D]: each token's embedding times `scale`, or where the step
    gives one (an image's rows) that embedding as it is (llama.cpp scales token rows only)."""
    x = embed(step.tokens, table, scale)
    if step.embeds is None:
        return x
    return jnp.where(step.embed_mask[:, None] != 0, step.embeds, x)


def embed(tokens: jax.Array, table: jax.Array | Proj, scale: float = 1.0) -> jax.Array:
    """The rows of the token embedding: gathered from its GGUF blocks and dequantized (only
    the step's rows) when packed, or taken from a float32 [V, D] table."""
    if isinstance(table, Proj) and table.fmt == PLANES and table.mesh is not None:
        x = device_split.planes_rows(tokens, table.data, table.rows)
    elif isinstance(table, Proj) and table.fmt == PLANES:
        from kinetic.kernels import pallas_matmul
        x = pallas_matmul.rows(table.data, tokens)
    elif isinstance(table, Proj) and table.mesh is not None:
        x = device_split.rows(tokens, table.data, table.fmt, table.offset, table.n, table.k,
                              table.mesh, table.owner, table.rows)
    elif isinstance(table, Proj):
        x = native.dequant_rows(tokens, table.data, table.fmt, table.offset, table.n, table.k)
    else:
        x = jnp.take(table, tokens, axis=0).astype(jnp.float32)  # [T, D]
    return x * scale if scale != 1.0 else x
