"""Errors in the OpenAI shape, for every route of every dialect.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

A route raises `APIError`; the app's error handler (kinetic/api/access.py) writes it with its
HTTP status. `param` names the request field at fault, so that a client can point at it.
`extra` adds fields to the error object where llama-server's clients read some: a prompt
longer than the context is type `exceed_context_size_error` with `n_prompt_tokens` and `n_ctx`.
"""

from __future__ import annotations

from typing import Any

# HTTP status -> the OpenAI error type it is reported as (llama-server's names for 501/503).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
}


class APIError(Exception):
    """An error answer: status, message and the OpenAI type/param/code, and `extra` fields
    for the error object. `close` asks the server to close the connection after answering
    (a client it will not serve further)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None, close: bool = False,
                 extra: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                            else "server_error")
        self.close, self.extra = close, extra or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code, self.extra)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code,
                      **(extra or {})}}


def context_exceeded(n_tokens: int, n_ctx: int, param: str, at_least: bool = False) -> APIError:
    """400 for a prompt that leaves no room in the context, in llama-server's shape (its type,
    `n_prompt_tokens` and `n_ctx`) with OpenAI's code for the same error. at_least: the
    prompt was refused before it was wholly tokenized (kinetic/api/offload.py), and
    `n_tokens` is what is known of its count."""
    count = f"at least {n_tokens}" if at_least else f"{n_tokens}"
    return APIError(400, f"the request ({count} tokens) exceeds the available context size "
                    f"({n_ctx} tokens); start the server with a larger -c",
                    type="exceed_context_size_error", param=param,
                    code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_tokens, "n_ctx": n_ctx})


def bad_request(message: str, param: str | None = None) -> APIError:
    """400: the request is invalid or cannot be served."""
    return APIError(400, message, param=param)


def not_supported(what: str, param: str, later: str = "") -> APIError:
    """400 for a field kinetic does not serve yet; `later` says which work will bring it."""
    return APIError(400, f"{what} is not supported yet{'; ' + later if later else ''}",
                    param=param)


def engine_error(last) -> APIError:
    """The error of a generation that ended with `last` (a Delta with finish_reason "error",
    or None if the engine stopped without one): 503 when the request alone overran a budget
    of its own (its grammar's masks; the server is fine), else 500."""
    if last is None:
        return APIError(500, "the engine stopped")
    return APIError(503 if last.busy else 500, last.error or "the engine failed")


def unavailable(message: str, close: bool = False) -> APIError:
    """503: the server cannot take the request now (loading, too many connections)."""
    return APIError(503, message, close=close)
