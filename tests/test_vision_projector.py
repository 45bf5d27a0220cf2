"""Vision projectors (kinetic/vision) against llama.cpp's mtmd on the tiny random-weight pairs of
tests/tiny_vision.py, with the references in tests/data/vision/{gemma3,idefics3}.json
(scripts/record_vision_refs.py): the prompt layout llama-server used for each image, and the
embedding rows llama-mtmd-cli computed for it (`embeddings`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image as PILImage

from kinetic.model.gguf_file import GGUFFile
from kinetic.text.tokenizer import Tokenizer
from kinetic.vision import images, preprocess
from kinetic.vision.images import ImageError
from kinetic.vision.projector import ProjectorError, load_projector
from tests import tiny_vision

DATA = Path(__file__).parent / "data" / "vision"
MARKER = "<__media__>"


def _ref(family: str) -> dict:
    return json.loads((DATA / f"{family}.json").read_text())


@pytest.fixture(scope="module", params=tiny_vision.FAMILIES)
def pair(request, tmp_path_factory):
    """(family, projector, tokenizer, reference) for the recorded pair of `family`."""
    family = request.param
    ref = _ref(family)
    tmp = tmp_path_factory.mktemp(family)
    b = ref["builder"]
    text = tiny_vision.write_tiny_text_model(tmp / "text.gguf", family, **b["text"]["kwargs"])
    mmproj = tiny_vision.write_tiny_mmproj(tmp / "mmproj.gguf", family, **b["mmproj"]["kwargs"])
    assert hashlib.sha256(text.read_bytes()).hexdigest() == ref["text_sha256"]
    assert hashlib.sha256(mmproj.read_bytes()).hexdigest() == ref["mmproj_sha256"]
    tok = Tokenizer.from_metadata(GGUFFile(text).metadata)
    return family, load_projector(str(mmproj)), tok, ref


def _lookup(tok: Tokenizer, text: str) -> int:
    """mtmd's lookup_token: the first id whose piece (special tokens rendered) is `text`."""
    want = text.encode()
    return next(i for i in range(tok.vocab_size) if tok.token_bytes(i, special=True) == want)


def _layout(tok: Tokenizer, prompt: str, pieces: list) -> list[dict]:
    """The prompt as the reference records it: text runs (ids, BOS first) and row counts."""
    out: list[dict] = []

    def text(ids):
        if out and "text" in out[-1]:
            out[-1]["text"] += ids
        elif ids:
            out.append({"text": list(ids)})

    before, after = prompt.split(MARKER)
    text(tok.encode(before, add_special=False, parse_special=True))
    for kind, value in pieces:
        if kind == "text":
            text(tok.encode(value, add_special=False, parse_special=True))
        elif kind == "token":
            text([_lookup(tok, value)])
        else:
            out.append({"image": int(value.shape[0])})
    text(tok.encode(after, add_special=False, parse_special=True))
    if tok.add_bos:
        if out and "text" in out[0]:
            out[0]["text"].insert(0, tok.bos_id)
        else:
            out.insert(0, {"text": [tok.bos_id]})
    return out


def _image(case: dict) -> images.Image:
    return images.from_base64(case["image"]["base64"])


def test_load(pair):
    family, proj, _, ref = pair
    assert proj.family == family
    assert proj.n_embd == 64
    assert proj.non_causal == (family == "gemma3")


def test_layout_matches_llama_cpp(pair):
    family, proj, tok, ref = pair
    for case in ref["cases"]:
        pieces = proj.pieces(_image(case))
        want = [{k: v for k, v in e.items() if k != "tile"} for e in case["layout"]]
        assert _layout(tok, case["prompt"], pieces) == want, (case["image"]["name"],
                                                              case["prompt"])
        for kind, value in pieces:
            if kind == "rows":
                assert value.dtype == np.float32 and value.shape[1] == proj.n_embd


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_embeddings_match_llama_cpp(pair):
    """Every row against llama-mtmd-cli's (cosine >= 0.9999). The lossless images match
    closer (>= 0.99999: what is left is llama.cpp's float16 GELU table and summation order);
    the JPEG is decoded by Pillow here and by stb_image there, a pixel apart here and there."""
    family, proj, _, ref = pair
    cases = {c["image"]["name"]: c for c in ref["cases"]}
    worst = {}
    for name, chunks in ref["embeddings"]["images"].items():
        rows = [v for k, v in proj.pieces(_image(cases[name])) if k == "rows"]
        assert [r.shape for r in rows] == [np.asarray(c).shape for c in chunks], name
        worst[name] = min(_cosines(r, np.asarray(c, np.float32)).min()
                          for r, c in zip(rows, chunks))
    for name, cos in worst.items():
        assert cos >= (0.9999 if name.endswith(".jpg") else 0.99999), (name, worst)


def test_rows_finite_and_differ(pair):
    _, proj, _, ref = pair
    a, b = (np.concatenate([v for k, v in proj.pieces(_image(c)) if k == "rows"])
            for c in ref["cases"][:3:2])          # 40x30 and 1x1
    assert np.isfinite(a).all() and np.isfinite(b).all()
    assert np.abs(a[:len(b)] - b[:len(a)]).max() > 0.1


def _pixels(w: int, h: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_gemma3_odd_sizes_fit_inside_black_frame():
    # PAD_CEIL: scale min(64 / w, 64 / h), sides ceil(side * scale), centred on black
    for (w, h), (cw, ch) in {(1, 1): (64, 64), (1000, 10): (64, 1), (10, 1000): (1, 64),
                             (40, 30): (64, 48), (200, 20): (64, 7)}.items():
        view = preprocess.fixed_size(_pixels(w, h), 64)
        assert view.shape == (64, 64, 3)
        ox, oy = (64 - cw) // 2, (64 - ch) // 2
        mask = np.zeros((64, 64), bool)
        mask[oy:oy + ch, ox:ox + cw] = True
        assert not view[~mask].any(), (w, h)


def test_idefics3_grids():
    # (cols, rows) llama-mtmd-cli gave (tiles + 1 chunks), 32-pixel tiles, longest edge 96;
    # 100x67 scales to 96x64 (int, made even), not 96x65: 2 rows, not 3
    for (w, h), grid in {(1, 1): (3, 3), (40, 30): (3, 3), (200, 20): (3, 1),
                         (48, 64): (3, 3), (100, 67): (3, 2), (67, 100): (2, 3),
                         (1, 3): (1, 3), (97, 95): (3, 3)}.items():
        tiles, overview, got = preprocess.idefics3(_pixels(w, h), 32, 96)
        assert got == grid, (w, h)
        assert len(tiles) == grid[0] * grid[1]
        assert all(t.shape == (32, 32, 3) for t in tiles) and overview.shape == (32, 32, 3)
    for w, h in ((1000, 10), (10, 1000), (1000, 1)):   # llama.cpp: "resize target 96x0"
        with pytest.raises(ImageError):
            preprocess.idefics3(_pixels(w, h), 32, 96)


def test_resample_by_hand():
    # bilinear, 2 -> 4 (upscale, support 1): centres 0.25, 0.75, 1.25, 1.75 in source
    # coordinates -> weights (1, 0), (0.75, 0.25), (0.25, 0.75), (0, 1)
    src = np.array([[[0, 100, 255], [200, 50, 0]]], np.uint8)
    out = preprocess.resample(src, 4, 1, "bilinear")
    assert out[0, :, 0].tolist() == [0, 50, 150, 200]       # 0.25 * 200 = 50 ...
    assert out[0, :, 1].tolist() == [100, 88, 63, 50]       # 75 + 12.5 rounds up to 88
    # 4 -> 2 (downscale: the triangle widens to support 2): output 0's centre is 1.0, its
    # taps 0..2 (int(1 - 2 + 0.5) .. int(1 + 2 + 0.5)) at distances 0.25, 0.25, 0.75
    # (halved), weights 3/7, 3/7, 1/7: (30 + 60 + 30) / 7 = 17.1; output 1 (centre 3, taps
    # 1..3): (20 + 90 + 120) / 7 = 32.9
    row = np.array([[[10] * 3, [20] * 3, [30] * 3, [40] * 3]], np.uint8)
    assert preprocess.resample(row, 2, 1, "bilinear")[0, :, 0].tolist() == [17, 33]
    # same size: no pass at all
    assert (preprocess.resample(src, 2, 1, "lanczos") == src).all()
    # a constant image stays constant under Lanczos (weights normalised to 1)
    flat = np.full((5, 7, 3), 77, np.uint8)
    assert (preprocess.resample(flat, 13, 3, "lanczos") == 77).all()


@pytest.mark.parametrize("algo,pil", [("bilinear", PILImage.BILINEAR),
                                      ("lanczos", PILImage.LANCZOS)])
def test_resample_is_pillow(algo, pil):
    """llama.cpp's resize_pillow ports Pillow's resampler: ours gives Pillow's bytes."""
    for (h, w, oh, ow) in [(30, 40, 48, 64), (20, 200, 7, 64), (1, 1, 96, 96),
                           (41, 50, 78, 96), (13, 7, 5, 3), (96, 96, 32, 32)]:
        src = _pixels(w, h, seed=h * w)
        ref = np.asarray(PILImage.fromarray(src).resize((ow, oh), pil))
        assert (preprocess.resample(src, ow, oh, algo) == ref).all(), (h, w, oh, ow)


def test_normalize():
    px = np.array([[[0, 255, 128]]], np.uint8)
    out = preprocess.normalize(px, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert out.dtype == np.float32
    # float32 all the way, as clip_image_f32::from_u8 then normalize
    third = (np.float32(128) / np.float32(255) - np.float32(0.5)) / np.float32(0.5)
    np.testing.assert_array_equal(out[0, 0], np.float32([-1.0, 1.0, third]))


def test_refuses_what_it_cannot_run(tmp_path):
    text = tiny_vision.write_tiny_text_model(tmp_path / "t.gguf", "gemma3")
    with pytest.raises(ProjectorError, match="not an mmproj"):
        load_projector(str(text))
    path = tiny_vision.write_tiny_mmproj(tmp_path / "m.gguf", "gemma3")
    import gguf
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "clip")
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "clip.projector_type":
            w.add_string(field.name, "llava")
            continue
        w.add_key_value(field.name, field.contents(), field.types[0],
                        field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ProjectorError, match="'llava' is not supported"):
        load_projector(str(tmp_path / "bad.gguf"))
