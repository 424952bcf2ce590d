"""The one HTTP client to llama-server: raw forwarding for the proxy, JSON calls for the cache."""

from __future__ import annotations

import functools
from typing import Any

import aiohttp
import orjson
from aiohttp.client_proto import ResponseHandler

# The deadline of kvproxy's own POSTs whose length does not grow with tokens (templates,
# tokenising, probes). Evaluations, saves and restores have none (api.py).
POST_TIMEOUT = 300.0


class UpstreamError(Exception):
    """llama-server could not be reached, or answered a JSON call with an error."""

    def __init__(self, message: str, status: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


# llama-server (cpp-httplib) closes a connection idle for 5 s
# (CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND). A request sent on it as the server closes it is lost
# with "Server disconnected": an agent's turn after a 5-second tool call would get a 502.
# Connections idle longer than this are not reused, so the server never closes one under us.
IDLE_REUSE_S = 4.0


# Replies that have no body whatever their headers say (RFC 9110 §6.4.1).
BODILESS_STATUSES = frozenset({b"204", b"304"})
_CHUNKED = b"transfer-encoding: chunked"
# Longest reply head buffered while looking for its status (aiohttp's own limits are below).
_HEAD_LIMIT = 64 * 1024


class LenientReplies(ResponseHandler):
    """aiohttp's client protocol, as lenient as llama-server's other clients with a bodiless
    reply framed loosely: the server's /cors-proxy answers `204` with `Transfer-Encoding:
    chunked` and a `0` chunk, which aiohttp (rightly giving a 204 no body) reads as the start
    of a next reply, "Bad status line", failing the 204 itself. Here the bytes after a 204 or
    304 head are dropped and the connection is not reused (no pipelining: nothing else can
    follow on it).

    A chunked reply's connection is not reused either: llama-server closes the connection
    after every streamed reply (its chunk provider ends the stream by returning false, which
    cpp-httplib takes as the end of the connection), though its head says `Keep-Alive`. Put
    back in the pool, the next request sent on it before the close arrives is lost with
    "Server disconnected": a client's 502 right after another's stream ended."""

    _head: bytes | None = b""
    _dropping = False

    def set_response_params(self, **kwargs: Any) -> None:
        self._head = b""  # a new reply's head is next
        self._dropping = False
        super().set_response_params(**kwargs)

    def data_received(self, data: bytes) -> None:
        if self._dropping:
            return
        if self._head is None or not data:
            super().data_received(data)
            return
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0 and len(head) <= _HEAD_LIMIT:
            self._head = head  # the status line and headers are not all in yet
            return
        self._head = None
        status_line = head.split(b"\r\n", 1)[0].split(b" ")
        status = status_line[1] if len(status_line) > 1 else b""
        if end >= 0 and status in BODILESS_STATUSES:
            self._dropping = True
            self.force_close()
            super().data_received(head[: end + 4])
            return
        if _CHUNKED in head[: max(end, 0)].lower():
            self.force_close()
        super().data_received(head)


class LenientConnector(aiohttp.TCPConnector):
    """A TCPConnector whose connections read replies with LenientReplies."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._factory = functools.partial(LenientReplies, loop=self._loop)  # type: ignore[assignment]


class Upstream:
    def __init__(
        self, base_url: str, api_key: str | None = None, idle_reuse_s: float = IDLE_REUSE_S
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.idle_reuse_s = idle_reuse_s
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # No total timeout: a long prefill or generation is normal. Reads may pause for a long
        # prefill too, so only the connect phase is bounded.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, connect=30)
        connector = LenientConnector(
            limit=0, ttl_dns_cache=300, keepalive_timeout=self.idle_reuse_s
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=connector,
            auto_decompress=False,  # bytes pass through exactly as the server sent them
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            # A proxy keeps no cookies: one the server set must never ride along on another
            # client's request (and the jar is work on every request and reply).
            cookie_jar=aiohttp.DummyCookieJar(),
            json_serialize=lambda obj: orjson.dumps(obj).decode(),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Upstream.start() was not awaited"
        return self._session

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path_qs: str) -> str:
        return self.base_url + path_qs

    async def call(
        self,
        method: str,
        path_qs: str,
        body: Any = None,
        timeout: float | None = 120.0,
    ) -> Any:
        """A JSON request of the proxy's own; raises UpstreamError unless the reply is 2xx JSON.
        `timeout` None: no deadline but the connection's (work whose length grows with its
        tokens, on a server whose speed kvproxy does not know; a server that dies closes the
        connection)."""
        data = orjson.dumps(body) if body is not None else None
        headers = self.auth_headers()
        if data is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.session.request(
                method,
                self.url(path_qs),
                data=data,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=10, connect=30),
            ) as resp:
                raw = await resp.read()
                try:
                    parsed = orjson.loads(raw) if raw else None
                except orjson.JSONDecodeError:
                    parsed = raw.decode("utf-8", "replace")
                if resp.status >= 300:
                    raise UpstreamError(
                        f"{method} {path_qs} -> {resp.status}: {_error_message(parsed)}",
                        resp.status,
                        parsed,
                    )
                return parsed
        except TimeoutError as exc:
            raise UpstreamError(f"{method} {path_qs}: no answer within {timeout} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise UpstreamError(
                f"{method} {path_qs} failed: {str(exc) or type(exc).__name__}"
            ) from exc

    async def get_json(self, path_qs: str, timeout: float | None = 30.0) -> Any:
        return await self.call("GET", path_qs, timeout=timeout)

    async def post_json(self, path_qs: str, body: Any, timeout: float | None = POST_TIMEOUT) -> Any:
        return await self.call("POST", path_qs, body, timeout=timeout)


def _error_message(parsed: Any) -> str:
    if isinstance(parsed, dict):
        err = parsed.get("error")
        if isinstance(err, dict):
            return str(err.get("message", err))
        if err is not None:
            return str(err)
    return str(parsed)[:300]
