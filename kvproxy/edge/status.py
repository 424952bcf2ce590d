"""The status page (`GET /kvproxy/`): one self-contained HTML file (status.html, shipped as
package data: inline CSS and JS, nothing fetched from elsewhere, so it works offline) that
polls `GET /kvproxy/status.json` every 2 s. Same access rule as `/kvproxy/stats`."""

from __future__ import annotations

import functools
from importlib import resources
from typing import NoReturn

from aiohttp import web

# The page builds its DOM with textContent only; no other origin, frame or plugin.
HEADERS = {
    "Content-Type": "text/html; charset=utf-8",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


@functools.cache
def page() -> bytes:
    return resources.files("kvproxy.edge").joinpath("status.html").read_bytes()


def page_response() -> web.Response:
    return web.Response(body=page(), headers=HEADERS)


def to_page() -> NoReturn:
    """`/kvproxy` without its slash: the page's relative `status.json` needs it."""
    raise web.HTTPFound("/kvproxy/")
