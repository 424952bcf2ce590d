"""Who may use a route: the Host header (DNS rebinding), the admin token, client keys."""

from __future__ import annotations

import hmac
from collections.abc import Mapping

from aiohttp import web

from kvproxy.config import Settings
from kvproxy.edge.routes import normal_path
from kvproxy.http.errors import error_response
from kvproxy.keys import header_bytes

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def host_refusal(request: web.Request, settings: Settings) -> str | None:
    """Bound to loopback, only loopback names may appear in Host: a browser page on another
    origin can resolve its own name to 127.0.0.1 (DNS rebinding) but cannot forge Host."""
    if not settings.loopback:
        return None
    host, name = _host(request)
    if name in LOOPBACK_NAMES or name in settings.allowed_hosts:
        return None
    return (
        f"Host {host!r} is not a loopback name; refused to guard against DNS rebinding "
        "(allow it with --allowed-hosts)"
    )


def _host(request: web.Request) -> tuple[str, str]:
    """The Host header as sent (lowercased), and the name in it without the port."""
    host = (request.headers.get("Host") or "").strip().lower()
    return host, host.rsplit(":", 1)[0] if not host.endswith("]") else host


def admin_refusal(request: web.Request, settings: Settings) -> web.Response | None:
    """kvproxy's own routes (/kvproxy/*, /metrics) need the admin token off loopback, under
    a name of --allowed-hosts (a reverse proxy brings anyone there), and whenever client API
    keys are set: every tenant reaches loopback alike, and these routes show every tenant's
    slots and the status page quotes prompts."""
    if settings.loopback and not settings.client_api_keys and _host(request)[1] in LOOPBACK_NAMES:
        return None
    token = settings.admin_token.get_secret_value() if settings.admin_token else None
    given = header_bytes(request.headers.get("Authorization", ""))
    if token is None or not hmac.compare_digest(given, f"Bearer {token}".encode()):
        unset = " (set --admin-token to read them)" if token is None else ""
        return error_response(
            401,
            f"kvproxy admin routes need `Authorization: Bearer <--admin-token>`{unset}.",
            "admin_token_required",
        )
    return None


# What llama-server answers without its API key (server-http.cpp, the API key middleware
# and the pre-routing handler before it): health checks, its UI's root, and every CORS
# preflight (`OPTIONS`, which browsers send without credentials).
HEALTH_PATHS = frozenset({"/health", "/v1/health"})
KEYLESS_PATHS = HEALTH_PATHS | {"/"}


def client_key(headers: Mapping[str, str]) -> bytes:
    """The key a client sends as llama-server reads it: `Authorization`, else `X-Api-Key`
    (Anthropic's header), a leading `Bearer ` removed."""
    raw = headers.get("Authorization") or headers.get("X-Api-Key") or ""
    return header_bytes(raw).removeprefix(b"Bearer ")


def client_refusal(request: web.Request, settings: Settings) -> web.Response | None:
    """With --client-api-keys, every route the server guards with its key needs one of them:
    kvproxy sends llama-server its own key, so the server cannot tell clients apart any more."""
    if not settings.client_api_keys or request.method == "OPTIONS":
        return None
    if normal_path(request.path) in KEYLESS_PATHS:
        return None
    given = client_key(request.headers)
    ok = False
    for key in settings.client_api_keys:
        # Every key is compared, so the time taken does not tell which one nearly matched.
        ok |= hmac.compare_digest(given, key.get_secret_value().encode())
    if ok:
        return None
    return error_response(
        401,
        "Missing or wrong API key (Authorization: Bearer …, or X-Api-Key).",
        "invalid_api_key",
    )
