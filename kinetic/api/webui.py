"""The web page: a chat over /v1/chat/completions, at / (index.html, bundle.js, markdown.js,
bundle.css, favicon.ico).

Static files shipped in kinetic/api/webui/, served without an API key (the page asks for the
key and sends it with its requests, as llama-server's page does); --no-webui turns them off
(404). The page talks to its own origin only, so the Origin rule (access.py) serves it from a
browser on this computer and refuses it elsewhere, like any other web page.
"""

from __future__ import annotations

from importlib.resources import files

from quart import Blueprint, Response

from kinetic.api.core import server_state
from kinetic.api.errors import APIError

blueprint = Blueprint("webui", __name__)

PAGES = {"index.html": "text/html", "bundle.js": "text/javascript",
         "markdown.js": "text/javascript", "bundle.css": "text/css",
         "favicon.ico": "image/x-icon"}


@blueprint.get("/")
@blueprint.get("/<any(index.html, bundle.js, markdown.js, bundle.css, favicon.ico):name>")
async def page(name: str = "index.html"):
    if not server_state().config.webui:
        raise APIError(404, "the web page is off (--no-webui)")
    data = files("kinetic.api").joinpath("webui", name).read_bytes()
    return Response(data, mimetype=PAGES[name], headers={"Cache-Control": "no-cache"})
