"""The transparent part: what goes through unchanged, what is refused, what fails cleanly."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvproxy.edge.app import SERVICE
from kvproxy.server.managed import free_port

from .conftest import RunningProxy, start_proxy
from .fakeserver import fingerprinting
from .standin_server import RawUpstream


class EchoUpstream:
    """A stand-in server that records what arrives and answers in controlled ways."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.sent_at: list[float] = []
        self.cancelled = asyncio.Event()
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/props", self.props)
        app.router.add_get("/sse", self.sse)
        app.router.add_get("/hang", self.hang)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        self.runner = web.AppRunner(app, handler_cancellation=True)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def slots(self, request: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "n_ctx": 100, "is_processing": False}])

    async def props(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "/m.gguf", "total_slots": 1})

    async def echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        if fingerprinting(request.method, request.path_qs, body):
            return web.Response(status=404)  # as a server without these routes
        self.seen.append(
            {
                "method": request.method,
                "path_qs": request.path_qs,
                "headers": dict(request.headers),
                "body": body,
            }
        )
        return web.Response(
            status=207, body=b"echo:" + body, headers={"X-Custom": "yes", "Content-Type": "text/x"}
        )

    async def sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            self.sent_at.append(time.monotonic())
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.3)
        await resp.write_eof()
        return resp

    async def hang(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


@pytest.fixture
async def echo() -> AsyncIterator[EchoUpstream]:
    upstream = EchoUpstream()
    await upstream.start()
    yield upstream
    await upstream.runner.cleanup()


@pytest.fixture
async def eproxy(echo: EchoUpstream, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    # The stand-in's own routes are not llama-server's: the operator allows them.
    running = await start_proxy(
        echo.url,
        tmp_path / "cache",
        upstream_api_key="server-key",
        max_body="1MiB",
        allow_route=["/some/*", "/sse", "/hang", "/anything"],
    )
    yield running
    await running.stop()


async def test_methods_paths_queries_headers_and_bodies_pass_through(
    echo: EchoUpstream, eproxy: RunningProxy
) -> None:
    async with aiohttp.ClientSession() as s:
        for method in ("GET", "PUT", "DELETE", "PATCH", "POST"):
            async with s.request(
                method,
                eproxy.url + "/some/path?a=1&b=x%20y",
                data=b"payload-" + method.encode(),
                headers={"X-Client": "c1", "Connection": "keep-alive, X-Drop", "X-Drop": "1"},
            ) as resp:
                assert resp.status == 207
                assert resp.headers["X-Custom"] == "yes"
                assert await resp.read() == b"echo:payload-" + method.encode()
    assert [s["method"] for s in echo.seen] == ["GET", "PUT", "DELETE", "PATCH", "POST"]
    first = echo.seen[0]
    assert first["path_qs"] == "/some/path?a=1&b=x%20y"
    assert first["headers"]["X-Client"] == "c1"
    assert "X-Drop" not in first["headers"]  # named in Connection: hop-by-hop
    assert first["headers"]["Authorization"] == "Bearer server-key"


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
@pytest.mark.parametrize(
    "path",
    [
        "/slots",
        "/slots/0?action=erase",
        "/slots/1?action=save",
        "//slots/0",
        "/v1/../slots/0",
        "/%73lots/0",
        # A server started with --api-prefix serves its routes under the prefix.
        "/llm/slots/0?action=restore",
        "/a/b/slots",
    ],
)
async def test_slots_routes_are_refused(
    echo: EchoUpstream, eproxy: RunningProxy, method: str, path: str
) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, eproxy.url + path) as resp:
        assert resp.status == 403
        body = await resp.json()
        assert body["error"]["type"] == "permission_error"
        assert "/slots" in body["error"]["message"]
    assert not echo.seen


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/llm/models/load"), ("POST", "/llm/props"), ("POST", "/llm/predict")],
)
async def test_admin_routes_under_an_api_prefix_are_refused(
    echo: EchoUpstream, eproxy: RunningProxy, method: str, path: str
) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, eproxy.url + path) as resp:
        assert resp.status == 403
    assert not echo.seen


async def test_sse_events_are_not_buffered(echo: EchoUpstream, eproxy: RunningProxy) -> None:
    received: list[float] = []
    async with aiohttp.ClientSession() as s, s.get(eproxy.url + "/sse") as resp:
        async for _chunk in resp.content.iter_any():
            received.append(time.monotonic())
            if len(received) == 1:
                assert len(echo.sent_at) == 1, "second event was already sent"
    assert received[0] < echo.sent_at[1]


async def test_client_disconnect_cancels_upstream(echo: EchoUpstream, eproxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s:
        resp = await s.get(eproxy.url + "/hang")
        assert await resp.content.readline() == b"data: first\n"
        resp.close()
    await asyncio.wait_for(echo.cancelled.wait(), 5)


async def test_dead_upstream_is_a_502_and_the_proxy_keeps_serving(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    running = await start_proxy(dead, tmp_path)
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/health", "/v1/models"):
                async with s.get(running.url + path) as resp:
                    assert resp.status == 502
                    body = await resp.json()
                    assert body["error"]["code"] == "upstream_unreachable"
            async with s.post(
                running.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}]},
            ) as resp:
                assert resp.status == 502
                assert "unreachable" in (await resp.json())["error"]["message"]
    finally:
        await running.stop()


async def test_oversized_body_is_413(echo: EchoUpstream, eproxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/chat/completions", "/anything"):
            async with s.post(eproxy.url + path, data=b"x" * (2 << 20)) as resp:
                assert resp.status == 413
                assert "--max-body" in (await resp.json())["error"]["message"]
    assert not echo.seen


async def test_malformed_chat_json_is_a_clear_400(echo: EchoUpstream, eproxy: RunningProxy) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            eproxy.url + "/v1/chat/completions",
            data=b'{"messages": [',
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        assert resp.status == 400
        body = await resp.json()
        assert body["error"]["type"] == "invalid_request_error"
        assert "JSON" in body["error"]["message"]


async def test_cookies_the_server_sets_never_ride_along_on_other_requests(
    tmp_path: Path,
) -> None:
    """A transparent proxy keeps no cookie jar: a Set-Cookie reaches its client, and no later
    request (another client's) carries it to the server."""

    async def set_cookie(_request: web.Request) -> web.Response:
        resp = web.Response(text="set")
        resp.set_cookie("session", "tenant-a-secret")
        return resp

    async def echo_cookie(request: web.Request) -> web.Response:
        return web.Response(text=request.headers.get("Cookie", "none"))

    app = web.Application()
    app.router.add_get("/set", set_cookie)
    app.router.add_get("/echo", echo_cookie)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    # A host name, not an IP address: aiohttp's default jar ignores cookies from IP addresses.
    proxy = await start_proxy(f"http://localhost:{port}", cache, allow_route=["/set", "/echo"])
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as s:
            async with s.get(proxy.url + "/set") as r:
                assert "tenant-a-secret" in r.headers.get("Set-Cookie", "")
            async with s.get(proxy.url + "/echo") as r:
                assert await r.text() == "none"
    finally:
        await proxy.stop()
        await runner.cleanup()


# llama-server's /cors-proxy answers a 204 with `Transfer-Encoding: chunked` and a `0` chunk.
LOOSE_204 = (
    b"HTTP/1.1 204 No Content\r\nServer: llama.cpp\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
)
LOOSE_304 = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\nETag: x\r\n\r\nhello"


async def test_a_loosely_framed_bodiless_reply_passes_as_it_would_direct(tmp_path: Path) -> None:
    """A 204 or 304 with body bytes after it reaches the client as the server's status (not
    a 502 "unreachable"), and what follows on the connection is not read as a next reply."""
    raw = RawUpstream({"/loose": LOOSE_204, "/cached": LOOSE_304})
    await raw.start()
    # Routes of no llama-server build (kvproxy refuses /cors-proxy itself): allowed for this.
    running = await start_proxy(raw.url, tmp_path, allow_route=["/loose", "/anything", "/cached"])
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.get(running.url + "/loose?url=http://x") as resp:
                    assert resp.status == 204 and await resp.read() == b""
                async with s.get(running.url + "/anything") as resp:
                    assert resp.status == 200 and await resp.read() == b"ok"
                async with s.get(running.url + "/cached") as resp:
                    assert resp.status == 304 and resp.headers["ETag"] == "x"
                async with s.get(running.url + "/anything") as resp:
                    assert resp.status == 200 and await resp.read() == b"ok"
        # JSON calls of kvproxy's own use the same client.
        assert await running.app[SERVICE].upstreams[0].get_json("/loose") is None
        assert await running.app[SERVICE].upstreams[0].get_json("/anything") == "ok"
    finally:
        await running.stop()
        await raw.stop()
