"""Errors in the OpenAI shape, for every route of every dialect.

    {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": null}}

A route raises `APIError`; the app's error handler (kinetic/api/access.py) writes it with its
HTTP status. `param` names the request field at fault, so that a client can point at it.
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
    """An error answer: status, message and the OpenAI type/param/code. `close` asks the
    server to close the connection after answering (a client it will not serve further)."""

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error" if status < 500
                                            else "server_error")
        self.close = close

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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
