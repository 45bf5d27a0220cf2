"""Images from requests: base64 data URLs of PNG or JPEG, decoded to RGB pixels, bounded.

The server fetches nothing: an image is a `data:image/png;base64,...` or
`data:image/jpeg;base64,...` URL (Ollama: the bare base64), and anything else is a
`ImageError` naming what is wrong (the API layer answers 400 in its own shape). Every size a
client controls is bounded before the work it costs: the encoded bytes, the pixel count
(read from the header, before anything is decompressed: a PNG bomb costs nothing), the
images in one request.

Pixels as llama.cpp's loader gives them to its preprocessor (stb_image asked for 3
channels): an alpha channel is dropped (not blended), grey is repeated into R, G and B, a
palette is looked up, 16-bit samples keep their high byte, CMYK JPEGs are converted to RGB.
One deliberate difference: the EXIF orientation of a JPEG is applied (a phone photo is
upright), which stb_image ignores.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from dataclasses import dataclass

import numpy as np

MAX_IMAGE_BYTES = 20 << 20        # encoded size of one image
MAX_IMAGE_PIXELS = 32_000_000     # width x height of one image
MAX_IMAGES = 16                   # images in one request
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg);base64,", re.IGNORECASE)


class ImageError(ValueError):
    """An image part that cannot be read; the message says why (a 400)."""


@dataclass(frozen=True)
class Image:
    """One decoded image: pixels [height, width, 3] uint8 (RGB), and the SHA-256 of its
    encoded bytes (the key of its embeddings and of its rows in the prefix cache)."""

    pixels: np.ndarray
    digest: bytes

    @property
    def size(self) -> tuple[int, int]:
        """(width, height)."""
        return self.pixels.shape[1], self.pixels.shape[0]


def from_data_url(url: str) -> Image:
    """An image from a data URL (PNG or JPEG, base64)."""
    if not isinstance(url, str):
        raise ImageError("an image URL must be a string")
    match = _DATA_URL.match(url)
    if match is None:
        if url.startswith(("http://", "https://", "file:", "ftp://")):
            raise ImageError("images must be inline base64 data URLs (data:image/png;base64,... "
                             "or data:image/jpeg;base64,...): the server fetches nothing")
        raise ImageError("an image URL must be a base64 data URL of a PNG or JPEG image "
                         "(data:image/png;base64,... or data:image/jpeg;base64,...)")
    return from_base64(url[match.end():])


def from_base64(text: str) -> Image:
    """An image from its base64 text (Ollama's `images` entries; a data URL's payload)."""
    if not isinstance(text, str):
        raise ImageError("an image must be base64 text")
    if len(text) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise ImageError(f"an image is larger than {MAX_IMAGE_BYTES >> 20} MiB encoded")
    try:
        # wrapped lines (base64's 76 columns, MIME's) are whitespace base64 allows
        data = base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image's base64 data is not valid base64") from None
    return from_bytes(data)


def from_bytes(data: bytes) -> Image:
    """An image from its encoded bytes (PNG or JPEG)."""
    from PIL import Image as PILImage
    from PIL import ImageOps, UnidentifiedImageError

    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"an image is larger than {MAX_IMAGE_BYTES >> 20} MiB encoded")
    try:
        im = PILImage.open(io.BytesIO(data), formats=["PNG", "JPEG"])
    except PILImage.DecompressionBombError:   # Pillow's own bound, from the header
        raise ImageError(f"an image is over the limit of {MAX_IMAGE_PIXELS:,} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError("an image is neither a PNG nor a JPEG that can be read") from None
    width, height = im.size
    if width < 1 or height < 1:
        raise ImageError("an image has no pixels")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"an image of {width}x{height} pixels is over the limit of "
                         f"{MAX_IMAGE_PIXELS:,} pixels")
    try:
        im.load()
        if im.format == "JPEG":
            im = ImageOps.exif_transpose(im)
        pixels = _rgb(im)
    except (OSError, ValueError, SyntaxError, PILImage.DecompressionBombError):
        raise ImageError("an image's data is truncated or corrupt") from None
    return Image(pixels, hashlib.sha256(data).digest())


def _rgb(im) -> np.ndarray:
    """[height, width, 3] uint8 as stb_image gives 3 channels: alpha dropped, grey
    repeated, 16-bit samples' high byte."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):   # 16-bit grey
        grey = (np.asarray(im, np.uint32) >> 8).clip(0, 255).astype(np.uint8)
        return np.repeat(grey[:, :, None], 3, axis=2)
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = im.convert("RGBA" if im.mode != "LA" else "LA")
        arr = np.asarray(im)
        arr = arr[:, :, :3] if arr.shape[2] == 4 else np.repeat(arr[:, :, :1], 3, axis=2)
        return np.ascontiguousarray(arr)
    if im.mode == "P" and "transparency" in im.info:
        return np.ascontiguousarray(np.asarray(im.convert("RGBA"))[:, :, :3])
    return np.ascontiguousarray(np.asarray(im.convert("RGB")))


def check_count(n: int) -> None:
    if n > MAX_IMAGES:
        raise ImageError(f"{n} images in one request; the limit is {MAX_IMAGES}")
