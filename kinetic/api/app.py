"""The HTTP app: the dialects' blueprints over the shared core.

core.py holds what every route shares (the server's state, bodies, answers, the bridge to the
engine); access.py the checks every request passes before its route runs and the handlers
that write every error in the OpenAI shape. The dialects (kinetic/api/dialects/) are
blueprints: `openai` (openai.py), `llama_server` (llama_server.py, health included), `slot_actions`
(slot_actions.py: /slots/N?action=..., /apply-template), `prefill` (prefill.py) and
`ollama` (ollama.py: /api/*).
"""

from __future__ import annotations

from quart import Quart
from werkzeug.exceptions import HTTPException

from kinetic.api import access, webui
from kinetic.api.core import ServerState
from kinetic.api.dialects import llama_server, ollama, openai, prefill, slot_actions
from kinetic.api.errors import APIError


def create_app(state: ServerState) -> Quart:
    """The Quart app over `state`: shared checks, error handlers, the dialects."""
    app = Quart("kinetic")
    app.extensions["kinetic"] = state
    app.config.update(MAX_CONTENT_LENGTH=state.config.max_body_bytes,
                      BODY_TIMEOUT=state.config.request_timeout)
    app.before_request(access.guard)
    app.after_request(access.cors_headers)
    app.after_request(access.log_request)
    app.errorhandler(APIError)(access.api_error)
    app.errorhandler(HTTPException)(access.http_error)
    app.errorhandler(Exception)(access.internal_error)
    app.register_blueprint(openai.blueprint)
    app.register_blueprint(prefill.blueprint)
    app.register_blueprint(llama_server.blueprint)
    app.register_blueprint(slot_actions.blueprint)
    app.register_blueprint(ollama.blueprint)
    app.register_blueprint(webui.blueprint)
    return app
