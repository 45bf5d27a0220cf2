"""A prompt with images: token ids and the image rows (engine.request.ImageRows) that take the
places of the media markers, laid out as llama.cpp's mtmd lays them out.

mtmd tokenizes the text between markers piece by piece (special tokens parsed, none added),
puts the vocabulary's BOS first when it adds one, and in place of each marker the projector's
pieces for that image (Projector.pieces): text, single looked-up tokens, and rows of
embeddings, one prompt position per row. The rows' prompt ids are placeholders (0); the
engine feeds their embeddings instead, and keys them in the prefix cache by the image's
digest and the rows' place in it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kinetic.engine.request import ImageRows
from kinetic.vision.images import Image, ImageError, check_count

PLACEHOLDER = 0   # the prompt id of an image row (its embedding is what the model reads)
CACHED_IMAGES = 32   # images whose pieces a PieceCache keeps


class PieceCache:
    """The projector's pieces of the last CACHED_IMAGES images, by the image's digest: a
    continued conversation sends its images again, and they are not encoded again."""

    def __init__(self, projector):
        self.projector = projector
        self.non_causal = projector.non_causal
        self._pieces: OrderedDict[bytes, list] = OrderedDict()

    def pieces(self, image: Image) -> list:
        got = self._pieces.pop(image.digest, None)
        if got is None:
            got = self.projector.pieces(image)
        self._pieces[image.digest] = got
        while len(self._pieces) > CACHED_IMAGES:
            self._pieces.popitem(last=False)
        return got


def image_prompt(tokenizer, projector, text: str, images: list[Image],
                 marker: str) -> tuple[list[int], tuple[ImageRows, ...]]:
    """(prompt ids, image rows) of `text` whose `marker`s stand for `images`, in order.
    projector: a Projector, or a PieceCache over one."""
    check_count(len(images))
    pieces = text.split(marker)
    if len(pieces) - 1 != len(images):
        raise ImageError(f"the prompt has {len(pieces) - 1} image places for {len(images)} "
                         f"images")
    ids = [tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else []
    rows: list[ImageRows] = []
    for i, piece in enumerate(pieces):
        if piece:
            ids += tokenizer.encode(piece, add_special=False, parse_special=True)
        if i == len(images):
            break
        for j, (kind, value) in enumerate(projector.pieces(images[i])):
            if kind == "text":
                ids += tokenizer.encode(value, add_special=False, parse_special=True)
            elif kind == "token":
                ids.append(lookup_token(tokenizer, value))
            else:
                digest = hashlib.sha256(images[i].digest + j.to_bytes(4, "little")).digest()
                rows.append(ImageRows(len(ids), value, digest, projector.non_causal))
                ids += [PLACEHOLDER] * len(value)
    return ids, tuple(rows)


def lookup_token(tokenizer, text: str) -> int:
    """The first vocabulary id whose text (special tokens as their text) is exactly `text`
    (mtmd's lookup_token); ImageError if the vocabulary has none."""
    cache = tokenizer.__dict__.setdefault("_lookup_cache", {})
    if text not in cache:
        want = text.encode()
        cache[text] = next((i for i in range(tokenizer.vocab_size)
                            if tokenizer.token_bytes(i, special=True) == want), None)
    if cache[text] is None:
        raise ImageError(f"the model's vocabulary has no token {text!r}, which this "
                         f"projector's image layout needs")
    return cache[text]
