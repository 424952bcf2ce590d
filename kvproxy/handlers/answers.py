"""What kvproxy answers itself, in place of the server's reply: every slot busy and the queue
full, a server not ready or not reachable."""

from __future__ import annotations

from aiohttp import web

from kvproxy.cache.servers.slotpool import QueueFull
from kvproxy.http.errors import error_response, loading_response
from kvproxy.http.session import UpstreamError


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


def not_ready_response(down: UpstreamError) -> web.Response:
    """What the server would answer now (Backend.not_ready): loading, or unreachable."""
    if down.status == 503:
        return loading_response()
    return error_response(502, f"llama-server is unreachable: {down}", "upstream_unreachable")
