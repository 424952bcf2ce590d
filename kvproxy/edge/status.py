"""The status page (`GET /kvproxy/`): one self-contained HTML file (status.html, shipped as
package data: inline CSS and JS, nothing fetched from elsewhere, so it works offline) that
polls `GET /kvproxy/status.json` every 2 s, and in managed mode the server's log tail
(`GET /kvproxy/server-log?lines=N`). Same access rule as `/kvproxy/stats`."""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, NoReturn

from aiohttp import web

from kvproxy.config import Settings
from kvproxy.http.errors import error_response
from kvproxy.server.managed import LOG_TAIL_LINES as MAX_LOG_LINES

LOG_LINES = 200  # what the page shows


@functools.cache
def page() -> bytes:
    return resources.files("kvproxy.edge").joinpath("status.html").read_bytes()


def _hashes(tag: str, html: bytes) -> str:
    blocks = re.findall(rb"<%s>(.*?)</%s>" % (tag.encode(), tag.encode()), html, re.S)
    return " ".join(
        f"'sha256-{base64.b64encode(hashlib.sha256(b).digest()).decode()}'" for b in blocks
    )


@functools.cache
def headers() -> dict[str, str]:
    """Only the page's own script and style run (by hash); it fetches only from kvproxy,
    and no other page may frame it. It writes client text (keys, miss excerpts) as text."""
    html = page()
    policy = (
        f"default-src 'none'; script-src {_hashes('script', html)}; "
        f"style-src {_hashes('style', html)}; connect-src 'self'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
    )
    return {
        "Content-Type": "text/html; charset=utf-8",
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cache-Control": "no-store",
    }


def page_response() -> web.Response:
    return web.Response(body=page(), headers=headers())


def to_page() -> NoReturn:
    """`/kvproxy` without its slash: the page's relative `status.json` needs it."""
    raise web.HTTPFound("/kvproxy/")


async def server_log_response(
    request: web.Request, tail: Callable[[int], Awaitable[list[str]]] | None
) -> web.Response:
    """`{"managed": bool, "lines": [...]}`, the last `?lines=N` (1-1000, default 200) lines of
    the managed servers' log; in sidecar mode kvproxy has none (`managed: false`)."""
    raw = request.query.get("lines", str(LOG_LINES))
    # ASCII digits only, and few of them: int() refuses "²" and 5,000-digit strings.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 6 and 1 <= int(raw) <= MAX_LOG_LINES):
        return error_response(
            400, f"lines must be a whole number from 1 to {MAX_LOG_LINES}", "invalid_lines"
        )
    lines = await tail(int(raw)) if tail is not None else []
    return web.json_response(
        {"managed": tail is not None, "lines": lines}, headers={"Cache-Control": "no-store"}
    )


def root_answer() -> web.Response:
    """`GET /`: what a browser opening kvproxy's address finds. kvproxy forwards no web UI
    (llama-server's assets have build-hashed names no route table can list)."""
    return error_response(
        404,
        "This is kvproxy: point OpenAI clients at /v1 (e.g. POST /v1/chat/completions); its "
        "status page is /kvproxy/. llama-server's web UI, where its build has one, is on the "
        "server's own port.",
        "not_found",
    )


def shown_settings(s: Settings) -> dict[str, Any]:
    """What the page names besides the servers and their models (status.json `settings`)."""
    return {
        "mode": "managed" if s.model or s.models_dir else "sidecar",
        "min_tokens": s.min_tokens,
        "idle_save_after": s.effective_idle_save_after,
        "write_through": s.write_through,
        "ttl": s.ttl,
    }
