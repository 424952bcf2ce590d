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


async def _one_request_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(len(BODY))
        writer.write(REPLY)
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
