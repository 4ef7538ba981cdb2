"""vLLM/OpenAI error bodies.

vLLM answers errors as ``{"error": {"message", "type", "param", "code"}}`` with
``code`` the HTTP status. :func:`error_body` builds that shape; :func:`error_message`
reads a message back out of it (or out of the older flat
``{"object": "error", "message", ...}`` shape some servers still send).
:func:`echoed` is how an error message quotes a client's value (cut short).
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

__all__ = ["ECHO_CHARS", "echoed", "error_body", "error_message", "error_type_for"]

ECHO_CHARS = 256
"""The most characters of a client's value an error message quotes."""

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "BadRequestError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_type_for(status: int) -> str:
    """The error ``type`` string vLLM uses for an HTTP status."""
    if status in _TYPES:
        return _TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase.replace(" ", "")
    except ValueError:
        phrase = "Unknown"
    return f"{phrase}Error"


def error_body(message: str, status: int, *, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error answer with HTTP ``status``."""
    return {
        "error": {
            "message": message,
            "type": error_type_for(status),
            "param": param,
            "code": status,
        }
    }


def error_message(body: Any) -> str | None:
    """The message of an error body in either vLLM shape, or None if it is not one."""
    if not isinstance(body, dict):
        return None
    inner = body.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return str(inner["message"])
    if body.get("object") == "error" and isinstance(body.get("message"), str):
        return str(body["message"])
    return None


def echoed(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` (a string as it is, anything else as its ``repr``) as an error message
    quotes it: its first ``limit`` characters, then ``...`` when it was longer (a
    client's 1 MB model name is not sent back to it)."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
