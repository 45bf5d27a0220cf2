"""The web page's Markdown renderer (kinetic/api/webui/markdown.js), run under node: an
answer is untrusted text, so what it renders is a tree of tags and text (never HTML it
parsed), links only to http(s) and mailto addresses; and the page's script asks for the
figures it shows. Skipped, saying so, where node is not installed (the Debian package
`nodejs`)."""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib.resources import files

import pytest

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
