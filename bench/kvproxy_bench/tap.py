"""A recording pass-through in front of an arm: the agent talks to it, it forwards every
request unchanged and relays the reply as it streams, and it keeps each completion request's
body and reply bytes. The same layer sits in front of kvproxy and in front of llama-server
alone, so both arms are read the same way (the server's own numbers, from its replies).

A client that hangs up is passed on: the tap stops reading and closes its upstream connection,
as the client's own would have been, so what is behind it sees the interruption."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from kvproxy.http.relay import send
from kvproxy.server.managed import free_port

# The routes whose requests are conversations (what the benchmark measures).
RECORDED = frozenset(
    {
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/responses",
        "/responses",
        "/v1/messages",
    }
)
# Hop-by-hop and framing headers: aiohttp writes its own.
_DROP = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass
class Exchange:
    """One recorded request and what came back."""

    path: str
    body: bytes
    status: int
    headers: dict[str, str]
    reply: bytes


@dataclass
class Tap:
    upstream: str = ""
    url: str = ""
    exchanges: list[Exchange] = field(default_factory=list)
    # Set when a recorded request's reply starts to stream (what an interruption waits for).
    replying: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: int = 0  # requests being relayed
    _runner: web.AppRunner | None = None
    _session: aiohttp.ClientSession | None = None

    def take(self) -> list[Exchange]:
        out, self.exchanges = self.exchanges, []
        return out

    async def settled(self, timeout: float = 60.0) -> None:
        """Until no request is being relayed: a client that hung up has gone on before the
        tap noticed (at its next write), and its exchange is recorded only then."""
        for _ in range(int(timeout / 0.05)):
            if not self.in_flight:
                return
            await asyncio.sleep(0.05)

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=1 << 28)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        try:
            return await self._relay(request)
        finally:
            self.in_flight -= 1

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        # The upstream changes on a restart: read it per request.
        url = self.upstream + request.path_qs
        async with self._session.request(request.method, url, data=body, headers=headers) as r:
            resp = web.StreamResponse(status=r.status)
            for name, value in r.headers.items():
                if name.lower() not in _DROP and name.lower() != "content-encoding":
                    resp.headers[name] = value
            recorded = request.method == "POST" and request.path in RECORDED
            raw = bytearray()
            gone = False
            try:
                await resp.prepare(request)
            except ConnectionError:  # the client hung up before the reply began
                r.close()
                return resp
            async for chunk in r.content.iter_any():
                raw += chunk
                if recorded and chunk:
                    self.replying.set()
                if not await send(resp, chunk):
                    gone = True
                    r.close()  # the client hung up: so does the tap, upstream
                    break
            if not gone:
                await send(resp, b"", eof=True)
        if recorded:
            self.exchanges.append(
                Exchange(request.path, body, r.status, dict(r.headers), bytes(raw))
            )
        return resp
