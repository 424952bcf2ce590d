"""The connection to llama-server: an idle connection the server is about to close is never
reused. cpp-httplib closes a keep-alive connection after 5 s idle; a request written to it as
it closes is lost. The stand-in below answers the first request on each connection and drops
the connection when a second one arrives, as llama-server does when its idle timer runs out
just as the request comes. (aiohttp retries an idempotent request on such a connection by
itself; a chat completion is a POST, so these use POST.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvproxy.http.session import IDLE_REUSE_S, Upstream, UpstreamError

BODY = b'{"prompt":"hi"}'
REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
# A streamed reply as llama-server sends it: chunked, its head promising Keep-Alive, after which
# the server closes the connection.
STREAMED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n\r\n6\r\ndata:\n\r\n0\r\n\r\n"
)


async def _one_request_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(BODY))
        writer.write(STREAMED if head.startswith(b"POST /stream") else REPLY)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # the next request on this connection: dropped
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


@pytest.fixture
async def closing_server() -> AsyncIterator[str]:
    server = await asyncio.start_server(_one_request_each, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_a_connection_idle_past_the_limit_is_not_reused(closing_server: str) -> None:
    upstream = Upstream(closing_server, idle_reuse_s=0.2)
    await upstream.start()
    try:
        assert await upstream.post_json("/completion", {"prompt": "hi"}) == {}
        await asyncio.sleep(0.4)
        assert await upstream.post_json("/completion", {"prompt": "hi"}) == {}
    finally:
        await upstream.close()


async def test_the_stand_in_does_drop_a_reused_connection(closing_server: str) -> None:
    """The control: reused within the limit, the same stand-in loses the request."""
    upstream = Upstream(closing_server, idle_reuse_s=60)
    await upstream.start()
    try:
        assert await upstream.post_json("/completion", {"prompt": "hi"}) == {}
        with pytest.raises(UpstreamError, match="disconnected"):
            await upstream.post_json("/completion", {"prompt": "hi"})
    finally:
        await upstream.close()


def test_the_limit_is_under_llama_servers_idle_close() -> None:
    assert IDLE_REUSE_S < 5.0  # CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND in the vendored httplib


async def test_a_connection_a_streamed_reply_came_on_is_not_reused(closing_server: str) -> None:
    """llama-server closes the connection after every streamed reply: a request sent on it
    next, however soon, would be lost (a client's 502 right after another's stream)."""
    upstream = Upstream(closing_server, idle_reuse_s=60)
    await upstream.start()
    try:
        async with upstream.session.post(upstream.url("/stream"), data=BODY) as r:
            assert await r.read() == b"data:\n"
        assert await upstream.post_json("/completion", {"prompt": "hi"}) == {}
    finally:
        await upstream.close()
