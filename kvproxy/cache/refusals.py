"""Requests refused before they reach the server: every slot busy and the queue full."""

from __future__ import annotations

from aiohttp import web

from kvproxy.cache.slots import QueueFull
from kvproxy.http.errors import error_response


def busy_response(exc: QueueFull) -> web.Response:
    return error_response(
        503,
        f"All llama-server slots are busy: {exc}. Retry shortly.",
        "slots_busy",
        headers={"Retry-After": str(exc.retry_after)},
    )


def unreachable_response() -> web.Response:
    """The slot could not be made ready (the server did not answer a slot action)."""
    return error_response(502, "llama-server is unreachable", "upstream_unreachable")
