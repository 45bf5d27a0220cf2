"""A vision projector (llama.cpp "mmproj" GGUF file): an image in, the prompt pieces that stand
for it out, laid out as llama.cpp's mtmd lays them out (tools/mtmd/mtmd.cpp, mtmd_tokenizer).

    load_projector(path) -> Projector           metadata and tensors checked, weights dense f32
    Projector.pieces(image) -> [(kind, value)]  in prompt order:
        ("text", s)   text the caller tokenizes (special tokens parsed, no BOS): mtmd's
                      add_text(string, parse_special=true)
        ("token", s)  the one vocabulary token whose text is exactly s: mtmd's lookup_token
                      (the first id whose token_to_piece(special=true) equals s)
        ("rows", a)   float32 [n, n_embd]: embedding rows, one prompt position each

gemma3 (mtmd: img_beg / img_end as text, one chunk for the image):
    "<start_of_image>"  rows(image)  "<end_of_image>"
idefics3 (MTMD_SLICE_TMPL_IDEFICS3; mtmd_image_preprocessor_idefics3 cuts the tiles):
    for each grid row r, column c (1-based):
        "<fake_token_around_image><row_r_col_c>" (text)  rows(tile)
      then the token "\\n" after every grid row but the last (tok_row_end, no trailing one)
    tokens "\\n\\n" "<fake_token_around_image>" "<global-img>"  rows(global view)
    token "<fake_token_around_image>"
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from kinetic.model.gguf_file import GGUFFile
from kinetic.model.layers import Proj
from kinetic.model.weights import _Packer, dequantize, kernel_choice
from kinetic.vision import preprocess, siglip
from kinetic.vision.images import Image

FAMILIES = ("gemma3", "idefics3")


class ProjectorError(ValueError):
    """An mmproj file kinetic cannot use; the message says what is wrong or unsupported."""


@dataclass(frozen=True)
class Projector:
    family: str            # clip.projector_type: "gemma3" or "idefics3"
    n_embd: int            # width of the rows (the text model's d_model)
    non_causal: bool       # the rows of one image attend both ways (mtmd_decode_use_non_causal)
    cfg: siglip.TowerConfig
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    longest_edge: int      # idefics3: clip.vision.preproc_image_size
    weights: dict

    def views(self, image: Image) -> tuple[list[np.ndarray], np.ndarray | None, tuple[int, int]]:
        """The uint8 views the tower sees: (tiles row-major, the global view or None, (cols,
        rows)); gemma3 has one "tile", the whole image, and no global view."""
        size = self.cfg.image_size
        if self.family == "gemma3":
            return [preprocess.fixed_size(image.pixels, size)], None, (1, 1)
        return preprocess.idefics3(image.pixels, size, self.longest_edge)

    def embed(self, view: np.ndarray) -> np.ndarray:
        """float32 [n, n_embd]: the rows of one uint8 view [S, S, 3]."""
        pixels = jnp.asarray(preprocess.normalize(view, self.mean, self.std))
        return np.asarray(siglip.embed(pixels, self.weights, self.cfg), np.float32)

    def pieces(self, image: Image) -> list[tuple[str, object]]:
        """The prompt pieces that stand for `image`, in order (module docstring)."""
        tiles, overview, (cols, rows) = self.views(image)
        if self.family == "gemma3":
            return [("text", "<start_of_image>"), ("rows", self.embed(tiles[0])),
                    ("text", "<end_of_image>")]
        out: list[tuple[str, object]] = []
        for r in range(rows):
            for c in range(cols):
                out.append(("text", f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>"))
                out.append(("rows", self.embed(tiles[r * cols + c])))
            if r != rows - 1:
                out.append(("token", "\n"))
        out += [("token", "\n\n"), ("token", "<fake_token_around_image>"),
                ("token", "<global-img>"), ("rows", self.embed(overview)),
                ("token", "<fake_token_around_image>")]
        return out


def load_projector(path: str) -> Projector:
    """The projector of an mmproj GGUF file (gemma3 or idefics3 vision); ProjectorError
    naming what is missing, malformed or unsupported."""
    f = GGUFFile(path)
    meta = f.metadata

    def need(key: str):
        if key not in meta:
            raise ProjectorError(f"{path}: the mmproj file has no {key} key")
        return meta[key]

    if meta.get("general.architecture") != "clip":
        raise ProjectorError(f"{path}: not an mmproj file (general.architecture is "
                             f"{meta.get('general.architecture')!r}, not 'clip')")
    if not meta.get("clip.has_vision_encoder", False):
        raise ProjectorError(f"{path}: the mmproj file has no vision encoder "
                             "(clip.has_vision_encoder)")
    family = meta.get("clip.projector_type", meta.get("clip.vision.projector_type"))
    if family not in FAMILIES:
        raise ProjectorError(f"{path}: projector type {family!r} is not supported "
                             f"(supported: {', '.join(FAMILIES)})")
    if meta.get("clip.use_gelu") and meta.get("clip.use_silu"):
        raise ProjectorError(f"{path}: both clip.use_gelu and clip.use_silu are set")
    act = ("gelu" if meta.get("clip.use_gelu") else "silu" if meta.get("clip.use_silu")
           else "gelu_quick")
    image_size = int(need("clip.vision.image_size"))
    patch_size = int(need("clip.vision.patch_size"))
    width = int(need("clip.vision.embedding_length"))
    n_head = int(need("clip.vision.attention.head_count"))
    n_layer = int(need("clip.vision.block_count"))
    eps = float(need("clip.vision.attention.layer_norm_epsilon"))
    # gemma3's default kernel is 4 (clip.cpp load_hparams); idefics3 has no default
    scale = meta.get("clip.vision.projector.scale_factor", 4 if family == "gemma3" else None)
    if scale is None:
        raise ProjectorError(f"{path}: the mmproj file has no "
                             "clip.vision.projector.scale_factor key")
    scale = int(scale)
    mean, std = need("clip.vision.image_mean"), need("clip.vision.image_std")
    if len(mean) < 3 or len(std) < 3:
        raise ProjectorError(f"{path}: clip.vision.image_mean / image_std need 3 values")
    if image_size <= 0 or patch_size <= 0 or image_size % patch_size:
        raise ProjectorError(f"{path}: image_size {image_size} is not a multiple of "
                             f"patch_size {patch_size}")
    if width % n_head or scale < 1:
        raise ProjectorError(f"{path}: embedding_length {width} is not a multiple of "
                             f"head_count {n_head}, or scale_factor {scale} < 1")
    side = image_size // patch_size
    if family == "gemma3" and side % scale:
        raise ProjectorError(f"{path}: gemma3's {side}-patch side is not a multiple of the "
                             f"pooling kernel {scale}")
    longest_edge = int(need("clip.vision.preproc_image_size")) if family == "idefics3" else 0
    if family == "idefics3" and longest_edge <= 0:
        raise ProjectorError(f"{path}: clip.vision.preproc_image_size must be positive")

    weights = _weights(path, f, family, width, n_layer, side, scale, patch_size)
    fc = weights.get("mm.model.fc.weight")
    n_embd = (weights["mm.input_projection.weight"].shape[1] if family == "gemma3"
              else fc.n if isinstance(fc, Proj) else fc.shape[0])   # (a Proj's shape is (k, n))
    proj_dim = meta.get("clip.vision.projection_dim")
    if proj_dim is not None and int(proj_dim) != n_embd:
        raise ProjectorError(f"{path}: clip.vision.projection_dim {proj_dim} differs from the "
                             f"projector's output width {n_embd}")
    cfg = siglip.TowerConfig(family, image_size, patch_size, n_layer, n_head, eps, act, scale)
    return Projector(family, n_embd, family == "gemma3", cfg,
                     tuple(float(x) for x in mean[:3]), tuple(float(x) for x in std[:3]),
                     longest_edge, weights)


def _expected(family: str, width: int, n_layer: int, side: int, scale: int,
              d_ffn: int, patch: int, n_embd: int) -> dict[str, tuple[int, ...]]:
    """numpy-order shapes of every tensor the projector reads."""
    shapes = {"v.patch_embd.weight": (width, 3, patch, patch), "v.patch_embd.bias": (width,),
              "v.position_embd.weight": (side * side, width),
              "v.post_ln.weight": (width,), "v.post_ln.bias": (width,)}
    for i in range(n_layer):
        b = f"v.blk.{i}"
        for name in ("ln1", "ln2"):
            shapes[f"{b}.{name}.weight"] = shapes[f"{b}.{name}.bias"] = (width,)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            shapes[f"{b}.{name}.weight"], shapes[f"{b}.{name}.bias"] = (width, width), (width,)
        shapes[f"{b}.ffn_up.weight"], shapes[f"{b}.ffn_up.bias"] = (d_ffn, width), (d_ffn,)
        shapes[f"{b}.ffn_down.weight"], shapes[f"{b}.ffn_down.bias"] = (width, d_ffn), (width,)
    if family == "gemma3":
        shapes["mm.soft_emb_norm.weight"] = (width,)
        shapes["mm.input_projection.weight"] = (width, n_embd)
    else:
        shapes["mm.model.fc.weight"] = (n_embd, width * scale * scale)
    return shapes


def _weights(path: str, f: GGUFFile, family: str, width: int, n_layer: int, side: int,
             scale: int, patch: int) -> dict:
    tensors = dict(f.tensors)
    up = tensors.get("v.blk.0.ffn_up.weight")
    if up is None:
        raise ProjectorError(f"{path}: the mmproj file has no tensor v.blk.0.ffn_up.weight")
    # files converted with the old naming store up and down swapped; clip.cpp swaps them back
    # when ffn_down's input width (numpy's last axis) is the tower's width
    if tensors.get("v.blk.0.ffn_down.weight") is not None and \
            tensors["v.blk.0.ffn_down.weight"].shape[-1] == width and up.shape[-1] != width:
        for i in range(n_layer):
            for suffix in ("weight", "bias"):
                a, b = f"v.blk.{i}.ffn_up.{suffix}", f"v.blk.{i}.ffn_down.{suffix}"
                if a in tensors and b in tensors:
                    tensors[a], tensors[b] = tensors[b], tensors[a]
    d_ffn = tensors["v.blk.0.ffn_up.weight"].shape[0]
    proj = tensors.get("mm.input_projection.weight" if family == "gemma3" else
                       "mm.model.fc.weight")
    if proj is None:
        raise ProjectorError(f"{path}: the {family} projector's matrix is missing")
    n_embd = proj.shape[1] if family == "gemma3" else proj.shape[0]
    shapes = _expected(family, width, n_layer, side, scale, d_ffn, patch, n_embd)
    missing = sorted(set(shapes) - set(tensors))
    unused = sorted(set(tensors) - set(shapes))
    if missing or unused:
        raise ProjectorError(f"{path}: the {family} mmproj file's tensors do not match"
                             + (f"; missing: {', '.join(missing[:8])}" if missing else "")
                             + (f"; not used: {', '.join(unused[:8])}" if unused else ""))
    # the tower's matrices stay in their GGUF blocks and go through kinetic's kernel, as the
    # text model's do (llama.cpp's rounding of the activations for each weight type, no
    # float32 copy of an F16 tower); gemma3's input projection is used as x @ W, not W^T,
    # and stays a float32 array, as do vectors
    packer = _Packer(f) if kernel_choice("auto") == "ffi" else None
    out = {}
    for name, shape in shapes.items():
        raw = tensors[name]
        if tuple(raw.shape) != shape:
            raise ProjectorError(f"{path}: tensor {name} has shape {tuple(raw.shape)}, "
                                 f"expected {shape}")
        matrix = len(shape) >= 2 and name != "mm.input_projection.weight" and name.endswith(
            ".weight") and name != "v.position_embd.weight"
        if packer is not None and matrix:
            flat = dataclasses.replace(raw, shape=(shape[0], int(np.prod(shape[1:]))))
            out[name] = packer.proj(flat)
        else:
            out[name] = jnp.asarray(dequantize(raw).reshape(shape), jnp.float32)
    return out
