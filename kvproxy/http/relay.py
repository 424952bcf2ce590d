"""Byte-exact streaming of one request to llama-server and its reply back to the client."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kvproxy.http.errors import sse_error_event, unreachable_response
from kvproxy.http.session import Upstream, UpstreamError

if TYPE_CHECKING:
    from kvproxy.wire import Translator

log = logging.getLogger("kvproxy.relay")

# RFC 9110 §7.6.1 plus the ones a proxy must recompute itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)


# Request headers the server must not see. `X-Conversation-Id` makes a completion resumable
# (server-stream.cpp): the generation outlives the client's connection, so it goes on in a slot
# kvproxy has given back, and anyone naming the id reads, replaces or stops it.
CLIENT_ONLY = frozenset({"x-conversation-id"})


def request_headers(
    incoming: Mapping[str, str], upstream: Upstream, drop_length: bool
) -> CIMultiDict[str]:
    connection_listed = {
        token.strip().lower() for token in incoming.get("Connection", "").split(",") if token
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        lname = name.lower()
        if lname in HOP_BY_HOP or lname in connection_listed or lname in CLIENT_ONLY:
            continue
        if drop_length and lname == "content-length":
            continue
        out.add(name, value)
    if upstream.api_key:
        out["Authorization"] = f"Bearer {upstream.api_key}"
    return out


def response_headers(incoming: Mapping[str, str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in incoming.items():
        if name.lower() not in HOP_BY_HOP:
            out.add(name, value)
    return out


class _WholeBodyResponse(web.StreamResponse):
    """A reply whose length is known (not an event stream): its headers go out with the first
    body bytes, one write instead of two (as aiohttp's own web.Response does), which is a
    loopback round trip less on every small JSON reply. Streams keep headers going at once."""

    _send_headers_immediately = False


@dataclass
class RelayResult:
    response: web.StreamResponse
    status: int
    complete: bool  # the whole upstream body reached the client


async def relay(
    request: web.Request,
    upstream: Upstream,
    path_qs: str,
    data: bytes | AsyncIterable[bytes] | None,
    *,
    body_replaced: bool,
    extra_headers: Mapping[str, str] | None = None,
    tap: Callable[[bytes], None] | None = None,
    translator: Translator | None = None,
    until_headers: Callable[[Awaitable[aiohttp.ClientResponse]], Awaitable[aiohttp.ClientResponse]]
    | None = None,
) -> RelayResult:
    """Forward `request` (with `data` as its body) and stream the reply back unchanged, or,
    with a `translator`, as it rewrites each chunk (a successful reply only).

    `tap` sees every upstream chunk after the client got it, so capturing a reply never
    delays a byte. `until_headers` wraps the wait for the reply's headers (before any byte
    went to the client): an UpstreamError it raises (the server found hung) makes the
    request unreachable there, its upstream request dropped.
    """
    headers = request_headers(request.headers, upstream, drop_length=body_replaced)
    try:
        upstream_cm = upstream.session.request(
            request.method,
            upstream.url(path_qs),
            headers=headers,
            data=data,
            allow_redirects=False,
            compress=None,
        )
        answered = upstream_cm.__aenter__()
        up = await (answered if until_headers is None else until_headers(answered))
    except (aiohttp.ClientError, OSError, TimeoutError, UpstreamError) as exc:
        log.warning("upstream unreachable for %s %s: %s", request.method, path_qs, exc)
        return RelayResult(unreachable_response(exc), 502, False)

    complete = False
    try:
        if up.status != 200:
            translator = None  # errors are the server's own: the client sees them as they are
        sized = "Content-Length" in up.headers and translator is None
        resp = (_WholeBodyResponse if sized else web.StreamResponse)(
            status=up.status, reason=up.reason
        )
        resp.headers.extend(response_headers(up.headers))
        if translator is not None:
            resp.headers.popall("Content-Length", None)
        if extra_headers:
            resp.headers.update(extra_headers)
        await resp.prepare(request)
        try:
            async for chunk in up.content.iter_any():
                sent = await send(resp, chunk if translator is None else translator.feed(chunk))
                if tap is not None:
                    tap(chunk)  # what the server sent is what its slot holds, read or not
                if not sent:
                    log.info("client hung up during %s %s", request.method, path_qs)
                    return RelayResult(resp, up.status, False)
            if translator is not None and not await send(resp, translator.finish()):
                return RelayResult(resp, up.status, False)
            complete = True
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # The server went away mid-reply. Headers are out, so the status cannot change.
            log.warning("upstream broke off %s %s: %s", request.method, path_qs, exc)
            message = f"llama-server broke off the reply: {exc}"
            if translator is not None:
                last = translator.broke_off(message)
            else:
                last = sse_error_event(message) if _ends_as_error_event(up.headers) else None
            if last is not None and "Content-Length" not in up.headers:
                # An event stream ends with an error event and a properly terminated body:
                # clients show the error instead of failing to read the response.
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await resp.write(last)
                    await resp.write_eof()
                    return RelayResult(resp, up.status, False)
        if complete:
            # Clients may close once they have the last event (Codex does, before the
            # chunked body's end): every byte of the reply reached them, so it is whole.
            await send(resp, b"", eof=True)
        elif request.transport is not None:
            # Any other body is cut short, so no client takes a truncated one for a whole one.
            request.transport.close()
        return RelayResult(resp, up.status, complete)
    finally:
        if not complete:
            # Closing (not releasing) the connection is what tells llama-server to stop
            # generating for a client that has gone.
            up.close()
        await upstream_cm.__aexit__(None, None, None)


async def send(resp: web.StreamResponse, data: bytes, eof: bool = False) -> bool:
    """Pass bytes on to the client; False once it has hung up (a client may close as soon as
    it has the final event: Codex does, before the chunked body's end)."""
    try:
        if eof:
            await resp.write_eof()
        else:
            await resp.write(data)
    except ConnectionError:  # aiohttp's ClientConnectionResetError is one
        return False
    return True


def _ends_as_error_event(headers: Mapping[str, str]) -> bool:
    """An SSE body (relayed chunked: with a Content-Length the client expects exactly that
    many bytes, so an error event would not make the body whole)."""
    return headers.get("Content-Type", "").startswith("text/event-stream")
