"""Images end to end against llama.cpp (tests/data/vision/, recorded by
scripts/record_vision_refs.py from llama-server --mmproj on the same tiny random-weight text
model and projector, tests/tiny_vision.py): kinetic lays each prompt out as llama.cpp did
(the same text ids, the same image rows in the same places), and teacher-forced on
llama-server's greedy continuation its top-1 agrees at >= 95% of the steps with a mean KL
over llama-server's top 20 <= 0.02 nats; two different images give different answers.
`pytest -s` prints the figures.

Gemma 3's images attend to themselves both ways (llama.cpp's non-causal image batches),
which kinetic's attention does not do yet: its projector is refused at load, with that reason.
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


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory):
    ref = json.loads((DATA / "idefics3.json").read_text())
    text, mmproj = build(ref, tmp_path_factory.mktemp("idefics3"))
    model = kinetic.load(text, mmproj=mmproj, n_ctx=1024, dtype="float32")
    yield ref, model
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


def test_idefics3_answers_as_llama_cpp_on_images(idefics3):
    ref, model = idefics3
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
    figures = (f"idefics3: top-1 {np.mean(top1):.2%} of {len(top1)} steps, mean KL "
               f"{np.mean(kls):.2e} (max {np.max(kls):.2e}), greedy 16 identical "
               f"{greedy}/{len(ref['cases'])}")
    print(figures)
    assert np.mean(top1) >= 0.95, figures
    assert np.mean(kls) <= 0.02, figures


def test_two_images_give_two_answers(idefics3):
    ref, model = idefics3
    answers = set()
    images = {c["image"]["name"]: c["image"]["base64"] for c in ref["cases"]}
    assert len(images) >= 2
    for name in sorted(images)[:2]:
        image = from_base64(images[name])
        ids, rows = model.image_prompt("Describe this image: <__media__>\nAnswer:", [image])
        answers.add(tuple(t for d in model.stream(ids, 8, images=rows) for t in d.token_ids))
    assert len(answers) == 2


def test_a_gemma3_projector_is_refused_with_the_reason(tmp_path):
    ref = json.loads((DATA / "gemma3.json").read_text())
    text, mmproj = build(ref, tmp_path)
    with pytest.raises(ValueError, match="both ways"):
        kinetic.load(text, mmproj=mmproj, n_ctx=512)


def test_an_image_needs_a_projector(idefics3, tmp_path):
    ref, model = idefics3
    png = base64.b64decode(ref["cases"][0]["image"]["base64"])
    assert model.image_prompt("<__media__>", [png])[1]
    plain = kinetic.load(tiny_vision.write_tiny_text_model(tmp_path / "t.gguf", "idefics3",
                                                          d_model=64), n_ctx=256)
    try:
        with pytest.raises(ValueError, match="no vision projector"):
            plain.image_prompt("<__media__>", [png])
    finally:
        plain.close()
