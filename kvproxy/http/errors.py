"""OpenAI-style error bodies: what every client library already knows how to show."""

from __future__ import annotations

import orjson
from aiohttp import web

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def error_body(status: int, message: str, code: str | None = None) -> bytes:
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "server_error"),
                "code": code or status,
            }
        }
    )


def error_response(
    status: int, message: str, code: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code),
        content_type="application/json",
        headers=headers,
    )


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """The last event of a stream the server broke off: clients see an error, not a silent end."""
    return b"data: " + error_body(502, message, code) + b"\n\n"


def loading_response(message: str = "Loading model") -> web.Response:
    """What llama-server itself answers before it is ready (server-http.cpp, its server-state
    middleware): a 503 clients and health checks already wait on."""
    body = {"error": {"message": message, "type": "unavailable_error", "code": 503}}
    return web.Response(status=503, body=orjson.dumps(body), content_type="application/json")


class Unreachable(web.Response):
    """A 502 for a server that could not be reached before any byte of a reply: with several
    servers, the request may go to another one instead (lanes/dispatch.py)."""


def unreachable_response(exc: BaseException) -> web.Response:
    message = f"llama-server is unreachable: {str(exc) or type(exc).__name__}"
    return Unreachable(
        status=502,
        body=error_body(502, message, "upstream_unreachable"),
        content_type="application/json",
    )
