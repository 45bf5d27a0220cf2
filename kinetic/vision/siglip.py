"""The SigLIP vision tower and the gemma3 / idefics3 projectors (llama.cpp's
clip_graph_siglip::build in tools/mtmd/models/siglip.cpp, over clip_graph::build_inp and
build_vit in tools/mtmd/clip.cpp), as pure functions of one normalized image.

    pixels [S, S, 3] -> patches (a conv of stride p: one matmul over p x p x 3 blocks) + bias
      + position embeddings -> n blocks of x + attn(LN1(x)); x + MLP(LN2(x)) -> post LN
    gemma3:   average pool k x k over the patch grid -> RMS norm * soft_emb_norm
              -> @ input_projection ([width, d_text] as stored: the checkpoint's x @ W)
    idefics3: pixel shuffle by k (k x k neighbouring patches side by side, row-major) -> @ fc.T

Attention is full (every patch sees every patch). Weights are dense float32 arrays named as in
the GGUF file; the tower runs once per image (or tile), jitted per image shape. Matmuls ask for
full float32 precision (no TF32 or bf16 passes on accelerators).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp

from kinetic.model.layers import Proj, linear

HI = jax.lax.Precision.HIGHEST


@dataclass(frozen=True)
class TowerConfig:
    family: str          # "gemma3" or "idefics3"
    image_size: int
    patch_size: int
    n_layer: int
    n_head: int
    eps: float           # clip.vision.attention.layer_norm_epsilon (also gemma3's RMS norm)
    act: str             # "gelu" (tanh approximation), "gelu_quick" or "silu"
    scale_factor: int    # gemma3: pooling kernel; idefics3: pixel-shuffle factor


def _dense(x, w, b=None):
    """x @ w.T (+ b): w as stored, [out, in] (a float32 array), or a packed projection
    (kinetic's kernel, as the text model's weights)."""
    if isinstance(w, Proj):
        return linear(x, w, b)
    y = jnp.einsum("ti,oi->to", x, w.reshape(w.shape[0], -1), precision=HI)
    return y if b is None else y + b


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * w + b


def _act(x, act):
    if act == "gelu":        # ggml_gelu: the tanh approximation
        return jax.nn.gelu(x, approximate=True)
    if act == "gelu_quick":
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.silu(x)


def _attention(x, w, i, n_head):
    t, d = x.shape
    q = _dense(x, w[f"v.blk.{i}.attn_q.weight"], w[f"v.blk.{i}.attn_q.bias"])
    k = _dense(x, w[f"v.blk.{i}.attn_k.weight"], w[f"v.blk.{i}.attn_k.bias"])
    v = _dense(x, w[f"v.blk.{i}.attn_v.weight"], w[f"v.blk.{i}.attn_v.bias"])
    q, k, v = (a.reshape(t, n_head, d // n_head) for a in (q, k, v))   # [T, H, Q]
    scores = jnp.einsum("shq,thq->hst", q, k, precision=HI) / jnp.sqrt(jnp.float32(d // n_head))
    out = jnp.einsum("hst,thq->shq", jax.nn.softmax(scores, axis=-1), v, precision=HI)
    return _dense(out.reshape(t, d), w[f"v.blk.{i}.attn_out.weight"],
                  w[f"v.blk.{i}.attn_out.bias"])


def tower(pixels, w, cfg: TowerConfig):
    """[n_patches, width]: the ViT over one normalized image [S, S, 3] (row-major patches)."""
    p = cfg.patch_size
    gh, gw = pixels.shape[0] // p, pixels.shape[1] // p
    # [gh, p, gw, p, 3] -> [gh * gw, 3 * p * p] in the conv weight's (c, ky, kx) order
    blocks = pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, -1)
    x = _dense(blocks, w["v.patch_embd.weight"], w["v.patch_embd.bias"])
    x = x + w["v.position_embd.weight"]
    for i in range(cfg.n_layer):
        with jax.named_scope(f"block{i}"):
            h = _layer_norm(x, w[f"v.blk.{i}.ln1.weight"], w[f"v.blk.{i}.ln1.bias"], cfg.eps)
            x = x + _attention(h, w, i, cfg.n_head)
            h = _layer_norm(x, w[f"v.blk.{i}.ln2.weight"], w[f"v.blk.{i}.ln2.bias"], cfg.eps)
            h = _act(_dense(h, w[f"v.blk.{i}.ffn_up.weight"], w[f"v.blk.{i}.ffn_up.bias"]),
                     cfg.act)
            x = x + _dense(h, w[f"v.blk.{i}.ffn_down.weight"], w[f"v.blk.{i}.ffn_down.bias"])
    return _layer_norm(x, w["v.post_ln.weight"], w["v.post_ln.bias"], cfg.eps)


def _gemma3_projector(x, w, cfg: TowerConfig, grid: tuple[int, int]):
    gh, gw = grid
    k = cfg.scale_factor
    d = x.shape[-1]
    # ggml_pool_2d AVG, kernel = stride = k, no padding: a partial window at the edge is dropped
    x = x.reshape(gh, gw, d)[:gh // k * k, :gw // k * k]
    x = x.reshape(gh // k, k, gw // k, k, d).mean(axis=(1, 3)).reshape(-1, d)  # [T, D]
    x = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + cfg.eps)
    x = x * w["mm.soft_emb_norm.weight"]
    return jnp.einsum("td,de->te", x, w["mm.input_projection.weight"], precision=HI)


def _idefics3_projector(x, w, cfg: TowerConfig, grid: tuple[int, int]):
    gh, gw = grid
    k = cfg.scale_factor
    d = x.shape[-1]
    x = x.reshape(gh, gw, d)
    # build_patch_merge_permute pads the grid with zeros to a multiple of k
    x = jnp.pad(x, ((0, -gh % k), (0, -gw % k), (0, 0)))
    hb, wb = x.shape[0] // k, x.shape[1] // k
    # merged token (hb, wb) = patches (hb*k + i, wb*k + j) in (i, j, channel) order
    x = x.reshape(hb, k, wb, k, d).transpose(0, 2, 1, 3, 4).reshape(hb * wb, k * k * d)
    return _dense(x, w["mm.model.fc.weight"])


@partial(jax.jit, static_argnames=("cfg",))
def embed(pixels, w, cfg: TowerConfig):
    """[n_rows, n_embd] float32: the embedding rows of one normalized view [S, S, 3]."""
    x = tower(pixels, w, cfg)
    grid = (pixels.shape[0] // cfg.patch_size, pixels.shape[1] // cfg.patch_size)
    if cfg.family == "gemma3":
        return _gemma3_projector(x, w, cfg, grid)
    return _idefics3_projector(x, w, cfg, grid)
