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

from kinetic.api import access, webui
from kinetic.api.core import ServerState
from kinetic.api.dialects import llama_server, ollama, openai, prefill, slot_actions


def create_app(state: ServerState) -> Quart:
    """The Quart app over `state`: shared checks, error handlers, the dialects."""
    return access.guarded_app("kinetic", state, (
        openai.blueprint, prefill.blueprint, llama_server.blueprint, slot_actions.blueprint,
        ollama.blueprint, webui.blueprint))
