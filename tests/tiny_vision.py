"""Tiny random-weight vision projectors (llama.cpp "mmproj" GGUF files) and the text models
they pair with, for checking `--mmproj` against llama.cpp's mtmd.

Two projector families whose text models kinetic runs:

* "gemma3": Gemma 3's SigLIP vision tower and projector (llama.cpp projector type
  "gemma3"): the tower's patches are average-pooled `scale_factor` x `scale_factor`
  (clip.vision.projector.scale_factor; llama.cpp's default 4 when absent), RMS-normed with
  `mm.soft_emb_norm` (the effective weight, 1 + w of the checkpoint, as converted) and
  multiplied by `mm.input_projection` (stored [vision width, text width] in numpy order: the
  checkpoint's `x @ W`). Pairs with a tiny "gemma3" text model.
* "idefics3": SmolVLM / Idefics3 (projector type "idefics3"): the same SigLIP tower, a pixel
  shuffle by `scale_factor` (width x scale_factor**2 features per merged token) and one linear
  `mm.model.fc` without bias. Pairs with a tiny "llama" text model.

Metadata keys are those llama.cpp's clip loader reads (tools/mtmd/clip.cpp
clip_model_loader::load_hparams): general.architecture "clip", clip.has_vision_encoder,
clip.projector_type, clip.use_gelu, clip.vision.{image_size, patch_size, embedding_length,
feed_forward_length, projection_dim, block_count, attention.head_count,
attention.layer_norm_epsilon, image_mean, image_std, projector.scale_factor} and, for
idefics3, clip.vision.preproc_image_size (the longest edge its preprocessor resizes to
before cutting image_size tiles). Tensors (gguf.TENSOR_NAMES V_*): v.patch_embd.{weight,
bias} (a conv of stride patch_size; numpy [width, 3, p, p]), v.position_embd.weight
([n_patches, width]), v.blk.N.{ln1, attn_q, attn_k, attn_v, attn_out, ln2, ffn_up,
ffn_down}.{weight, bias}, v.post_ln.{weight, bias}, then the projector's. ffn_down's input
width must differ from the tower's width: clip.cpp swaps up/down of these projector types
when ffn_down's first dimension equals n_embd (files converted with the old naming).

The text models' vocabularies get the family's image markers as USER_DEFINED tokens
(matched in any text whatever parse_special says), appended after the vocabulary file's
tokens (token_embd grows with them): llama.cpp's mtmd looks the markers up by their text
(mtmd_context::lookup_token for idefics3's "\\n\\n", "<fake_token_around_image>",
"<global-img>", "\\n": a missing one becomes LLAMA_TOKEN_NULL, -1, in the prompt) or
tokenizes them as text ("<start_of_image>" / "<end_of_image>" and idefics3's
"<row_i_col_j>": without the tokens they would fall apart into several word pieces).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import gguf
import numpy as np

from kinetic.model.gguf_file import GGUFFile
from tests import tiny_models

FAMILIES = ("gemma3", "idefics3")
TEXT_ARCH = {"gemma3": "gemma3", "idefics3": "llama"}
# SmolVLM's tokenizer adds <row_1_col_1> ... <row_6_col_6>
IMAGE_TOKENS = {
    "gemma3": ["<start_of_image>", "<end_of_image>"],
    "idefics3": ["<fake_token_around_image>", "<global-img>", "<image>"]
                + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
}
# the builders' defaults per family: small, but within clip.cpp's constraints (gemma3: the
# patch grid a multiple of scale_factor; idefics3: of scale_factor too, and preproc_image_size
# a multiple of image_size)
DEFAULTS = {
    "gemma3": {"image_size": 64, "patch_size": 8, "scale_factor": 2},
    "idefics3": {"image_size": 32, "patch_size": 8, "scale_factor": 2,
                 "preproc_image_size": 96},
}


@contextlib.contextmanager
def _appended_tokens(extra: list[str]):
    """While active, tests.tiny_models.write_tiny_model's vocabulary gets `extra` appended
    as USER_DEFINED tokens (score 0)."""
    original = tiny_models.copy_tokenizer
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")

    def copy_tokenizer(writer: gguf.GGUFWriter, vocab: str, skip: tuple[str, ...] = ()) -> int:
        meta = GGUFFile(tiny_models.vocab_file(vocab)).metadata
        original(writer, vocab, skip=tuple(skip) + keys)
        tokens = list(meta["tokenizer.ggml.tokens"])
        clash = [t for t in extra if t in tokens]
        if clash:
            raise ValueError(f"{vocab} already has {clash}")
        writer.add_token_list(tokens + extra)
        if "tokenizer.ggml.scores" in meta:
            writer.add_token_scores([float(x) for x in meta["tokenizer.ggml.scores"]]
                                    + [0.0] * len(extra))
        if "tokenizer.ggml.token_type" in meta:
            writer.add_token_types([int(x) for x in meta["tokenizer.ggml.token_type"]]
                                   + [int(gguf.TokenType.USER_DEFINED)] * len(extra))
        return len(tokens) + len(extra)

    tiny_models.copy_tokenizer = copy_tokenizer
    try:
        yield
    finally:
        tiny_models.copy_tokenizer = original


def write_tiny_text_model(path: Path, family: str, **kwargs) -> Path:
    """The text model of `family` (write_tiny_model of TEXT_ARCH[family] with `kwargs`; its
    d_model must equal the projector's projection_dim), its vocabulary with the family's
    IMAGE_TOKENS appended."""
    with _appended_tokens(IMAGE_TOKENS[family]):
        return tiny_models.write_tiny_model(path, TEXT_ARCH[family], **kwargs)


def write_tiny_mmproj(path: Path, family: str, *, seed: int = 0, image_size: int | None = None,
                      patch_size: int | None = None, n_layer: int = 2, width: int = 48,
                      n_head: int = 4, d_ffn: int = 96, projection_dim: int = 64,
                      scale_factor: int | None = None, preproc_image_size: int | None = None,
                      eps: float = 1e-6, image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
                      image_std: tuple[float, float, float] = (0.5, 0.5, 0.5),
                      qtype: str = "F32") -> Path:
    """Write a random-weight vision projector of `family` ("gemma3" or "idefics3") to path.

    image_size: the square the tower sees (gemma3: every image is resized to it; idefics3:
    the tile size and the global view's size); patch_size: the conv's kernel and stride;
    width: the tower's embedding length (n_head heads); d_ffn: its feed-forward width (GELU,
    tanh approximation: clip.use_gelu); projection_dim: the text model's embedding length;
    scale_factor: gemma3's average-pooling kernel (tokens per image (image_size / patch_size
    / scale_factor)**2) or idefics3's pixel-shuffle factor (per tile); preproc_image_size:
    idefics3's longest edge. qtype "F32" or "F16" stores the matrices (the conv, the
    attention, feed-forward and projector weights); norms, biases and the position embedding
    stay F32. Returns path.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: one of {FAMILIES}")
    d = DEFAULTS[family]
    image_size = d["image_size"] if image_size is None else image_size
    patch_size = d["patch_size"] if patch_size is None else patch_size
    scale_factor = d["scale_factor"] if scale_factor is None else scale_factor
    side = image_size // patch_size
    if image_size % patch_size or side % scale_factor:
        raise ValueError(f"{family}: image_size {image_size} must be a multiple of patch_size "
                         f"{patch_size}, and the {side}-patch side of scale_factor "
                         f"{scale_factor}")
    if width % n_head or d_ffn == width:
        raise ValueError("width must be a multiple of n_head, and d_ffn differ from width "
                         "(clip.cpp reads ffn_down of width n_embd as swapped)")
    if family == "idefics3":
        preproc_image_size = (d["preproc_image_size"] if preproc_image_size is None
                              else preproc_image_size)
        if preproc_image_size % image_size:
            raise ValueError("preproc_image_size must be a multiple of image_size")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_string("general.name", f"tiny-{family}-mmproj")
    w.add_clip_has_vision_encoder(True)
    w.add_clip_projector_type(family)
    w.add_vision_use_gelu(True)
    w.add_vision_image_size(image_size)
    w.add_vision_patch_size(patch_size)
    w.add_vision_embedding_length(width)
    w.add_vision_feed_forward_length(d_ffn)
    w.add_vision_projection_dim(projection_dim)
    w.add_vision_block_count(n_layer)
    w.add_vision_head_count(n_head)
    w.add_vision_attention_layernorm_eps(eps)
    w.add_vision_image_mean(list(image_mean))
    w.add_vision_image_std(list(image_std))
    w.add_vision_projector_scale_factor(scale_factor)
    if family == "idefics3":
        w.add_vision_preproc_image_size(preproc_image_size)

    def tensor(name: str, *shape: int, scale: float = 0.1, store: str = qtype) -> None:
        value = (rng.standard_normal(shape) * scale).astype(np.float32)
        w.add_tensor(name, value.astype(np.float16) if store == "F16" else value)

    def norm(name: str, n: int) -> None:
        w.add_tensor(f"{name}.weight", (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        w.add_tensor(f"{name}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))

    tensor("v.patch_embd.weight", width, 3, patch_size, patch_size, scale=0.2)
    tensor("v.patch_embd.bias", width, store="F32")
    tensor("v.position_embd.weight", side * side, width, scale=0.5, store="F32")
    for i in range(n_layer):
        b = f"v.blk.{i}"
        norm(f"{b}.ln1", width)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensor(f"{b}.{name}.weight", width, width, scale=width ** -0.5)
            tensor(f"{b}.{name}.bias", width, store="F32")
        norm(f"{b}.ln2", width)
        tensor(f"{b}.ffn_up.weight", d_ffn, width, scale=width ** -0.5)
        tensor(f"{b}.ffn_up.bias", d_ffn, store="F32")
        tensor(f"{b}.ffn_down.weight", width, d_ffn, scale=d_ffn ** -0.5)
        tensor(f"{b}.ffn_down.bias", width, store="F32")
    norm("v.post_ln", width)
    if family == "gemma3":
        w.add_tensor("mm.soft_emb_norm.weight",
                     (1.0 + 0.1 * rng.standard_normal(width)).astype(np.float32))
        tensor("mm.input_projection.weight", width, projection_dim, scale=width ** -0.5)
    else:
        tensor("mm.model.fc.weight", projection_dim, width * scale_factor ** 2,
               scale=(width * scale_factor ** 2) ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tokens_per_tile(path: Path) -> int:
    """Embedding rows one image (gemma3) or one tile / the global view (idefics3) becomes."""
    meta = GGUFFile(path).metadata
    side = meta["clip.vision.image_size"] // meta["clip.vision.patch_size"]
    return (side // meta["clip.vision.projector.scale_factor"]) ** 2
