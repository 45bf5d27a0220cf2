"""Images end to end against llama.cpp (tests/data/vision/, recorded by
scripts/record_vision_refs.py from llama-server --mmproj on the same tiny random-weight text
model and projector, tests/tiny_vision.py): kinetic lays each prompt out as llama.cpp did
(the same text ids, the same image rows in the same places), and teacher-forced on
llama-server's greedy continuation its top-1 agrees at >= 95% of the steps with a mean KL
over llama-server's top 20 <= 0.02 nats; two different images give different answers.
`pytest -s` prints the figures.

Gemma 3's image rows attend to each other both ways (llama.cpp decodes its image batches
non-causally): each row sees the keys up to its image's last row (the attention kernel's
per-row end), its sliding window still from its own position.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

import kinetic
from kinetic.vision.images import from_base64
from tests import tiny_vision

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from parity import log_softmax, top_kl  # noqa: E402

DATA = Path(__file__).parent / "data" / "vision"
MARKER = "<__media__>"


def build(ref: dict, folder: Path) -> tuple[Path, Path]:
    """The recorded text model and projector, rebuilt (checked by their sha256)."""
    b = ref["builder"]
    text = tiny_vision.write_tiny_text_model(folder / "text.gguf", b["text"]["family"],
                                             **b["text"]["kwargs"])
    mmproj = tiny_vision.write_tiny_mmproj(folder / "mmproj.gguf", b["mmproj"]["family"],
                                           **b["mmproj"]["kwargs"])
    for path, key in ((text, "text_sha256"), (mmproj, "mmproj_sha256")):
        assert hashlib.sha256(path.read_bytes()).hexdigest() == ref[key], (
            f"{path.name}: tests/tiny_vision.py builds another file now; re-record with "
            f"`{ref['header']['regenerate']}`")
    return text, mmproj


@pytest.fixture(scope="module", params=["idefics3", "gemma3"])
def family(request, tmp_path_factory):
    ref = json.loads((DATA / f"{request.param}.json").read_text())
    text, mmproj = build(ref, tmp_path_factory.mktemp(request.param))
    model = kinetic.load(text, mmproj=mmproj, n_ctx=1024, dtype="float32")
    yield request.param, ref, model
    model.close()


def layout_ids(layout: list[dict]) -> tuple[list[int], list[tuple[int, int]]]:
    """llama-server's prompt as the reference lays it out: (ids, with 0 at image rows;
    (start, rows) of each image chunk)."""
    ids, chunks = [], []
    for entry in layout:
        if "text" in entry:
            ids += entry["text"]
        else:
            chunks.append((len(ids), entry["image"]))
            ids += [0] * entry["image"]
    return ids, chunks


def test_answers_as_llama_cpp_on_images(family):
    name, ref, model = family
    top1, kls, greedy = [], [], 0
    for case in ref["cases"]:
        image = from_base64(case["image"]["base64"])
        ids, rows = model.image_prompt(case["prompt"], [image], MARKER)
        want_ids, chunks = layout_ids(case["layout"])
        assert ids == want_ids, case["image"]["name"]
        assert [(r.start, len(r.embeddings)) for r in rows] == chunks
        steps = case["steps"]
        logits = model.logits(ids + [s["id"] for s in steps[:-1]], rows)
        for j, s in enumerate(steps):
            lp = log_softmax(logits[len(ids) - 1 + j])
            ref_top = s["top_logprobs"]
            top1.append(int(np.argmax(lp)) == (ref_top[0]["id"] if ref_top else s["id"]))
            if ref_top:
                kls.append(top_kl(lp, ref_top, renormalize=True))
        got = [t for d in model.stream(ids, 16, images=rows) for t in d.token_ids]
        wanted = [t for t in case["tokens"] if t not in model.tokenizer.eog_ids]
        greedy += got == wanted[:16]
    figures = (f"{name}: top-1 {np.mean(top1):.2%} of {len(top1)} steps, mean KL "
               f"{np.mean(kls):.2e} (max {np.max(kls):.2e}), greedy 16 identical "
               f"{greedy}/{len(ref['cases'])}")
    print(figures)
    assert np.mean(top1) >= 0.95, figures
    assert np.mean(kls) <= 0.02, figures


def test_two_images_give_two_answers(family):
    _, ref, model = family
    answers = set()
    images = {c["image"]["name"]: c["image"]["base64"] for c in ref["cases"]}
    assert len(images) >= 2
    for name in sorted(images)[:2]:
        image = from_base64(images[name])
        ids, rows = model.image_prompt("Describe this image: <__media__>\nAnswer:", [image])
        answers.add(tuple(t for d in model.stream(ids, 8, images=rows) for t in d.token_ids))
    assert len(answers) == 2


def test_an_image_needs_a_projector(family, tmp_path):
    name, ref, model = family
    png = base64.b64decode(ref["cases"][0]["image"]["base64"])
    assert model.image_prompt("<__media__>", [png])[1]
    if name != "idefics3":
        return   # (one family is enough for the text model's side)
    plain = kinetic.load(tiny_vision.write_tiny_text_model(tmp_path / "t.gguf", "idefics3",
                                                          d_model=64), n_ctx=256)
    try:
        with pytest.raises(ValueError, match="no vision projector"):
            plain.image_prompt("<__media__>", [png])
    finally:
        plain.close()
