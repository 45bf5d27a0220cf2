"""Images from requests (kinetic/vision/images.py): data URLs of PNG and JPEG decoded to the
RGB pixels llama.cpp's loader gives its preprocessor, and every bad input refused with a
message that names it."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image as PILImage

from kinetic.vision import images
from kinetic.vision.images import ImageError


def encode(im: PILImage.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format=fmt, **kw)
    return buf.getvalue()


def url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


RNG = np.random.default_rng(0)
RGB = RNG.integers(0, 256, (7, 5, 3), dtype=np.uint8)


def test_a_png_data_url_gives_its_pixels_and_a_content_digest():
    data = encode(PILImage.fromarray(RGB))
    image = images.from_data_url(url(data))
    assert image.pixels.dtype == np.uint8 and image.size == (5, 7)
    assert np.array_equal(image.pixels, RGB)
    assert image.digest == images.from_bytes(data).digest
    assert image.digest != images.from_bytes(encode(PILImage.fromarray(RGB[::-1]))).digest


def test_alpha_is_dropped_not_blended_and_grey_is_repeated():
    rgba = np.concatenate([RGB, np.full((7, 5, 1), 10, np.uint8)], axis=2)
    got = images.from_bytes(encode(PILImage.fromarray(rgba, "RGBA"))).pixels
    assert np.array_equal(got, RGB)
    grey = RGB[:, :, 0]
    got = images.from_bytes(encode(PILImage.fromarray(grey, "L"))).pixels
    assert np.array_equal(got, np.repeat(grey[:, :, None], 3, axis=2))


def test_a_16_bit_png_keeps_the_high_byte():
    deep = RNG.integers(0, 65536, (4, 6), dtype=np.uint16)
    got = images.from_bytes(encode(PILImage.fromarray(deep))).pixels   # mode I;16
    assert np.array_equal(got[:, :, 1], (deep >> 8).astype(np.uint8))


def test_a_cmyk_jpeg_and_a_one_pixel_png_are_read():
    cmyk = PILImage.fromarray(RNG.integers(0, 256, (8, 8, 4), dtype=np.uint8), "CMYK")
    image = images.from_data_url(url(encode(cmyk, "JPEG"), "jpeg"))
    assert image.pixels.shape == (8, 8, 3)
    one = images.from_bytes(encode(PILImage.fromarray(RGB[:1, :1])))
    assert one.size == (1, 1)


def test_a_jpegs_exif_orientation_is_applied():
    tall = PILImage.fromarray(RNG.integers(0, 256, (20, 10, 3), dtype=np.uint8))
    exif = PILImage.Exif()
    exif[0x0112] = 6   # rotate 90 degrees clockwise to display
    image = images.from_bytes(encode(tall, "JPEG", exif=exif.tobytes()))
    assert image.size == (20, 10)


@pytest.mark.parametrize("bad,message", [
    ("https://example.com/cat.png", "fetches nothing"),
    ("file:///etc/passwd", "fetches nothing"),
    ("data:image/gif;base64,R0lGODlhAQABAAAAACw=", "PNG or JPEG"),
    ("data:image/png;base64,not base64!!", "not valid base64"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a....").decode(), "neither a PNG"),
])
def test_what_is_not_an_inline_png_or_jpeg_is_refused(bad, message):
    with pytest.raises(ImageError, match=message):
        images.from_data_url(bad)


def test_truncated_and_corrupt_data_are_refused():
    data = encode(PILImage.fromarray(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(ImageError, match="truncated or corrupt|neither"):
        images.from_bytes(data[:len(data) // 2])
    corrupt = bytearray(data)
    corrupt[60:80] = b"\xff" * 20
    with pytest.raises(ImageError):
        images.from_bytes(bytes(corrupt))


def bomb_png() -> bytes:
    """A small PNG whose header claims 60000 x 60000 pixels (its data would be gigabytes)."""
    small = encode(PILImage.fromarray(RGB))
    chunk = b"IHDR" + struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    return (small[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + small[33:])


def test_a_decompression_bomb_is_refused_from_its_header():
    """A PNG whose header claims 60000 x 60000 pixels is refused before any of it is
    decompressed."""
    with pytest.raises(ImageError, match="over the limit"):
        images.from_bytes(bomb_png())


def test_sizes_and_counts_are_bounded():
    with pytest.raises(ImageError, match="MiB"):
        images.from_base64("A" * (images.MAX_IMAGE_BYTES * 2))
    images.check_count(images.MAX_IMAGES)
    with pytest.raises(ImageError, match="100 images"):
        images.check_count(100)
