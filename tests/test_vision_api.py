"""Images through the server's chat completions (kinetic serve TEXT --mmproj MMPROJ), on the
tiny random-weight SmolVLM-style pair (tests/tiny_vision.py) with a ChatML template: the
official openai client sends an image part as a data URL and gets the answer the Python API
gives for the same prompt and image; every bad image is a 400 in OpenAI's shape, and the
server answers normally after them."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import openai
import pytest
from PIL import Image as PILImage

from tests import tiny_vision
from tests.app_client import model_app

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def png(w: int, h: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PILImage.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vision-api")
    text = tiny_vision.write_tiny_text_model(folder / "text.gguf", "idefics3", qtype="Q8_0",
                                             output_scale=16.0, d_model=64,
                                             chat_template=CHATML)
    mmproj = tiny_vision.write_tiny_mmproj(folder / "mmproj.gguf", "idefics3",
                                           projection_dim=64)
    return text, mmproj


@pytest.fixture(scope="module")
def app(files):
    with model_app(files[0], n_ctx=1024, mmproj=files[1]) as client:
        yield client


def ask(app, content, **kw):
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": 8, **kw}
    return app.post("/v1/chat/completions", json.dumps(body).encode())


def test_the_openai_client_sends_an_image_and_gets_the_python_apis_answer(files):
    """`kinetic serve TEXT --mmproj MMPROJ`, and the official client over HTTP."""
    import kinetic
    from tests.serve_process import serving
    image = png(40, 30, 1)
    model = kinetic.load(files[0], mmproj=files[1], n_ctx=1024)
    try:
        text = model.apply_chat_template(
            [{"role": "user", "content": "What is in this picture?<__media__>"}])
        ids, rows = model.image_prompt(text, [image])
        want = [model.tokenizer.decode([d]) for delta in model.stream(ids, 8, images=rows)
                for d in delta.token_ids]
    finally:
        model.close()
    with serving(str(files[0]), "--mmproj", str(files[1]), "-c", "1024", "-np", "1") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        check_answers(client, image, want, len(ids))


def check_answers(client, image, want, n_prompt):
    out = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=8, logprobs=True,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(image)}}]}])
    got = [t.token for t in out.choices[0].logprobs.content]
    assert got == want and out.usage.prompt_tokens == n_prompt
    other = client.chat.completions.create(
        model="tiny", temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image_url", "image_url": {"url": data_url(png(40, 30, 2))}}]}])
    assert other.choices[0].message.content != out.choices[0].message.content


def _truncated() -> str:
    data = png(64, 64, 3)
    return data_url(data[:len(data) // 2])


def _bomb() -> str:
    from tests.test_images import bomb_png
    return data_url(bomb_png())


@pytest.mark.parametrize("url,words", [
    ("https://example.com/cat.png", "fetches nothing"),
    ("data:image/png;base64,@@@", "not valid base64"),
    ("TRUNCATED", "truncated or corrupt"),
    ("BOMB", "over the limit"),
])
def test_a_bad_image_is_a_400_naming_the_part(app, url, words):
    url = {"TRUNCATED": _truncated, "BOMB": _bomb}.get(url, lambda: url)()
    status, answer = ask(app, [{"type": "text", "text": "Hi"},
                               {"type": "image_url", "image_url": {"url": url}}])
    assert status == 400, answer
    err = answer["error"]
    assert words in err["message"] and err["param"] == "messages[0].content[1].image_url"
    assert err["type"] == "invalid_request_error"
    status, answer = ask(app, "Hello")   # nothing else disturbed
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None


def test_too_many_images_and_a_receipt_are_refused(app):
    part = {"type": "image_url", "image_url": {"url": data_url(png(4, 4, 5))}}
    status, answer = ask(app, [part] * 100)
    assert status == 400 and "limit is 16" in answer["error"]["message"]
    status, answer = ask(app, [part], receipt=True)
    assert status == 400 and answer["error"]["param"] == "receipt"


def test_kinetic_run_reads_images(files, tmp_path, capsys):
    """`kinetic run TEXT PROMPT --mmproj MMPROJ --image FILE` prints what the Python API gives
    for the same prompt; --image without --mmproj stops with one line."""
    import kinetic
    from kinetic.cli import main
    image = png(40, 30, 7)
    (tmp_path / "i.png").write_bytes(image)
    argv = ["run", str(files[0]), "Describe: <__media__> Answer:", "-n", "6",
            "--mmproj", str(files[1]), "--image", str(tmp_path / "i.png")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    model = kinetic.load(files[0], mmproj=files[1], n_ctx=4096)
    try:
        ids, rows = model.image_prompt("Describe: <__media__> Answer:", [image])
        want = "".join(d.text for d in model.stream(ids, 6, images=rows))
    finally:
        model.close()
    assert printed == want + "\n"
    assert main(["run", str(files[0]), "hi", "--image", str(tmp_path / "i.png")]) == 2
    assert "--mmproj" in capsys.readouterr().err
    # a file without end is read only past the bound (it was read until memory ran out)
    assert main(argv[:-1] + ["/dev/zero"]) == 1
    assert "larger than 20 MiB" in capsys.readouterr().err


def test_ollama_chat_images_and_what_the_server_says_it_reads(app):
    """Ollama's message images, as base64 files, answer what the same image part gives on
    /v1/chat/completions; /props, /v1/models and /api/show say the model reads images."""
    image = png(24, 24, 9)
    status, want = ask(app, [{"type": "image_url", "image_url": {"url": data_url(image)}},
                             {"type": "text", "text": "Look."}])   # Ollama's order
    assert status == 200
    body = {"model": "tiny", "stream": False, "options": {"temperature": 0, "num_predict": 8},
            "messages": [{"role": "user", "content": "Look.",
                          "images": [base64.b64encode(image).decode()]}]}
    status, got = app.post("/api/chat", json.dumps(body).encode())
    assert status == 200, got
    assert got["message"]["content"] == want["choices"][0]["message"]["content"]
    body["messages"][0]["images"] = [body["messages"][0]["images"][0], "not base64!"]
    status, bad = app.post("/api/chat", json.dumps(body).encode())
    assert status == 400 and "base64" in bad["error"]
    # named as the client sent it, once: Ollama's field, not the OpenAI part it became
    assert bad["error"].startswith("messages[0].images[1]: ") and "content" not in \
        bad["error"] and bad["error"].count("images[1]") == 1, bad
    status, props = app.get("/props")
    assert props["modalities"]["vision"] is True
    status, models = app.get("/v1/models")
    assert "vision" in models["data"][0]["capabilities"]
    status, show = app.post("/api/show", json.dumps({"model": "tiny"}).encode())
    assert "vision" in show["capabilities"]


def test_ollama_generate_takes_images_as_its_chat_does(app):
    """/api/generate's `images` go with the prompt, as /api/chat's message images (it said
    the server had no --mmproj); a raw prompt has no place for them. Base64 wrapped at 76
    columns, as `base64` writes it, is base64 too."""
    image = png(24, 24, 11)
    wrapped = base64.encodebytes(image).decode()   # a newline every 76 characters
    assert "\n" in wrapped.strip()
    options = {"temperature": 0, "num_predict": 6}
    status, chat = app.post("/api/chat", json.dumps({
        "model": "tiny", "stream": False, "options": options,
        "messages": [{"role": "user", "content": "Look.", "images": [wrapped]}]}).encode())
    assert status == 200, chat
    status, gen = app.post("/api/generate", json.dumps({
        "model": "tiny", "stream": False, "options": options, "prompt": "Look.",
        "images": [base64.b64encode(image).decode()]}).encode())
    assert status == 200, gen
    assert gen["response"] == chat["message"]["content"]
    status, raw = app.post("/api/generate", json.dumps({
        "model": "tiny", "stream": False, "prompt": "Look.", "raw": True,
        "images": [base64.b64encode(image).decode()]}).encode())
    assert status == 400 and "raw prompt takes no images" in raw["error"], raw


def test_requests_with_images_take_turns(app, monkeypatch):
    """At most IMAGE_REQUESTS requests decode and lay out images at once (each image can be
    96 MB of pixels, 16 to a request): the others wait, holding nothing, and every one
    answers what it answers alone. A text request does not wait for them."""
    import threading
    from kinetic.api import offload
    from kinetic.vision import images as vision_images
    inside, most, lock = [0], [0], threading.Lock()
    crowded = threading.Event()   # set when two requests decode at once
    real = vision_images.from_bytes

    def counted(data):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] > 1:
                crowded.set()
        try:
            # give another request every chance to come in beside this one (ungated, the
            # parse workers would let it): the wait ends early only if one does
            crowded.wait(1.0)
            return real(data)
        finally:
            with lock:
                inside[0] -= 1
    monkeypatch.setattr(vision_images, "from_bytes", counted)
    parts = [[{"type": "image_url", "image_url": {"url": data_url(png(48, 48, 20 + i))}},
              {"type": "text", "text": "Look."}] for i in range(3)]
    alone = [ask(app, p) for p in parts]
    most[0] = 0
    answers = [None] * 3

    def send(i):
        answers[i] = ask(app, parts[i])
    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    def content(answer):
        status, body = answer
        assert status == 200, body
        return body["choices"][0]["message"]["content"]
    assert [content(a) for a in answers] == [content(a) for a in alone]
    assert 1 <= most[0] <= offload.IMAGE_REQUESTS, most[0]


def test_the_python_api_takes_messages_with_image_parts(files):
    """Model.generate / stream with messages holding image_url parts: the answer of
    image_prompt's ids and rows for the same rendered conversation."""
    import kinetic
    image = png(30, 20, 11)
    model = kinetic.load(files[0], mmproj=files[1], n_ctx=1024)
    try:
        messages = [{"role": "user", "content": [
            {"type": "text", "text": "What is it?"},
            {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
        got = "".join(model.generate(messages, max_tokens=6))
        ids, rows = model.image_prompt(model.apply_chat_template(messages), [image])
        want = "".join(d.text for d in model.stream(ids, 6, images=rows))
    finally:
        model.close()
    assert got == want and ids.count(0) == sum(len(r.embeddings) for r in rows)
