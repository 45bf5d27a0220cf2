"""The web page's Markdown renderer (kinetic/api/webui/markdown.js), run under node: an
answer is untrusted text, so what it renders is a tree of tags and text (never HTML it
parsed), links only to http(s) and mailto addresses; and the page's script asks for the
figures it shows. Skipped, saying so, where node is not installed (the Debian package
`nodejs`)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from importlib.resources import files

import pytest

from tests import browser
from tests.browser import needs_browser
from tests.serve_process import ServeProcess
from tests.tiny_models import write_tiny_model

WEBUI = files("kinetic.api").joinpath("webui")
NODE = shutil.which("node")
needs_node = pytest.mark.skipif(NODE is None, reason="node is not installed (Debian's nodejs "
                                "package runs these checks of the page's JavaScript)")


def parse(*texts: str) -> list:
    """markdown.js's parse of each text, as JSON."""
    script = (f"const md = require({json.dumps(str(WEBUI.joinpath('markdown.js')))});"
              f"const texts = JSON.parse(process.argv[1]);"
              f"process.stdout.write(JSON.stringify(texts.map(md.parse)));")
    out = subprocess.run([NODE, "-e", script, json.dumps(list(texts))], capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(out.stdout)


@needs_node
def test_markdown_blocks_and_inline_forms():
    [doc] = parse("# Title\n\nSome **bold**, *it*, `x < y` and [a link](https://example.org).\n"
                  "\n- one\n- two\n\n1. first\n2. second\n\n```python\nprint('<b>')\n```\n"
                  "> quoted\n\n---")
    assert [b["tag"] for b in doc] == ["h1", "p", "ul", "ol", "pre", "blockquote", "hr"]
    para = doc[1]["children"]
    assert {"tag": "strong", "children": ["bold"]} in para
    assert {"tag": "em", "children": ["it"]} in para
    assert {"tag": "code", "children": ["x < y"]} in para
    assert {"tag": "a", "href": "https://example.org", "children": ["a link"]} in para
    assert [li["children"] for li in doc[2]["children"]] == [["one"], ["two"]]
    assert doc[4] == {"tag": "pre", "children": [
        {"tag": "code", "lang": "python", "children": ["print('<b>')"]}]}


@needs_node
def test_html_in_an_answer_stays_text():
    texts = ['<img src=x onerror="alert(1)">', "<script>alert(1)</script> **hi**",
             "[click](javascript:alert(1))", "[mail](mailto:a@b.c)"]
    docs = parse(*texts)

    def strings(node):
        if isinstance(node, str):
            return [node]
        return [s for child in node.get("children", []) for s in strings(child)]
    assert "".join(strings(docs[0][0])) == texts[0]        # the very characters, as text
    assert strings(docs[1][0])[0] == "<script>alert(1)</script> "
    assert "".join(docs[2][0]["children"]) == texts[2]   # no such link: its text as it is
    assert docs[3][0]["children"][0]["href"] == "mailto:a@b.c"
    tags = json.dumps(docs)
    assert '"tag": "img"' not in tags and '"tag": "script"' not in tags


@needs_node
def test_an_unclosed_fence_is_code_to_the_end():
    """A streamed answer is rendered as it grows: a fence not closed yet is code so far."""
    [doc] = parse("Here:\n```js\nlet a = 1;\nlet b")
    assert doc[1]["children"][0]["children"] == ["let a = 1;\nlet b"]


def test_the_page_renders_markdown_and_shows_its_figures():
    script = WEBUI.joinpath("bundle.js").read_text()
    assert "md.toDom(md.parse(" in script and "render(answer, reply)" in script
    assert "include_usage: true" in script and "predicted_per_second" in script
    assert "innerHTML" not in script and "innerHTML" not in WEBUI.joinpath(
        "markdown.js").read_text()


# --- the page itself, in a browser ----------------------------------------------------------

@needs_browser
def test_the_page_in_a_browser(tmp_path):
    """A real server and headless Chromium: a wrong API key's error in the header is cleared
    once the right key answers, a message streams an answer with its token figures under it,
    the favicon is served, and markdown.js builds DOM nodes (never parsed HTML) in the
    browser itself."""
    model = write_tiny_model(tmp_path / "tiny.gguf", "llama", qtype="Q4_0")
    serve = ServeProcess(str(model), "--api-key", "sekret", "-c", "256", "-np", "1",
                         "--draft-max", "0")
    try:
        serve.wait_ready()
        with browser.page() as tab:
            tab.goto(serve.url + "/")
            tab.wait_for_function("document.getElementById('model').className === 'bad'")
            assert "key" in tab.text_content("#model").lower()
            tab.fill("#key", "nope")
            tab.dispatch_event("#key", "change")
            tab.wait_for_function("document.getElementById('model').textContent"
                                  ".toLowerCase().includes('key')")
            assert tab.get_attribute("#model", "class") == "bad"
            tab.fill("#key", "sekret")
            tab.dispatch_event("#key", "change")
            tab.wait_for_function("document.getElementById('model').className === ''")
            assert "tiny" in tab.text_content("#model")
            assert tab.is_hidden("#models")   # one model: no picker
            tab.fill("#max", "8")
            tab.fill("#text", "hello")
            tab.click("#send")
            tab.wait_for_selector(".figures:not([hidden])")
            assert re.fullmatch(r"\d+ tokens?(, [\d.]+ tokens/s)?",
                                tab.text_content(".figures"))
            assert tab.locator(".msg.error").count() == 0
            icon = tab.request.get(serve.url + "/favicon.ico")
            assert icon.status == 200 and icon.headers["content-type"] == "image/x-icon"
            tags = tab.evaluate("""() => {
                const md = window.kineticMarkdown, box = document.createElement('div');
                box.replaceChildren(md.toDom(md.parse(
                    '**bold** <img src=x onerror="window.hit=1">\\n\\n```\\n<b>x</b>\\n```'),
                    document));
                return [[...box.querySelectorAll('*')].map(e => e.tagName), box.textContent,
                        window.hit === undefined];
            }""")
            names, shown, no_hit = tags
            assert "STRONG" in names and "PRE" in names and "IMG" not in names
            assert "B" not in names and "<b>x</b>" in shown and "<img" in shown and no_hit
    finally:
        serve.close()
