"""Where kvproxy listens, and what a client connection may hold.

Slow clients (slowloris) cost an asyncio server little each, but nothing else bounds them:
aiohttp keeps a connection whose request head never ends for an hour, and any number of
them. So: a connection held at once beyond `--max-connections` is answered 503 and closed
before its request is read (file descriptors and memory stay for the others); a request head
must arrive within `--client-timeout` of the connection opening or of the previous answer
(aiohttp's keep-alive timer, which also closes idle connections then); its body has as long
again (edge/app.py reads it whole before anything is forwarded, so a slow body never holds
one of llama-server's few HTTP threads).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson
from aiohttp import web

from kvproxy.config import Settings

log = logging.getLogger("kvproxy.proxy")


def runner_options(settings: Settings) -> dict[str, Any]:
    """How the app is served. `auto_decompress` off: aiohttp would inflate a compressed
    request body (under its original headers, past --max-body) or refuse one it cannot
    inflate with a plain-text 400 before dispatch; kvproxy refuses them itself
    (http/bodies.py refused_encoding)."""
    return {
        "handler_cancellation": True,
        "access_log": None,
        "auto_decompress": False,
        "keepalive_timeout": settings.client_timeout,
    }


def _busy_answer() -> bytes:
    body = orjson.dumps(
        {
            "error": {
                "code": 503,
                "message": "kvproxy holds as many client connections as it may "
                "(--max-connections); try again.",
                "type": "unavailable_error",
            }
        }
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY_ANSWER = _busy_answer()


class _Refusal(asyncio.Protocol):
    """A connection over the cap: one 503, then closed, its request never read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY_ANSWER)
        transport.close()


class CappedSite(web.TCPSite):
    """A TCP site that hands at most `limit` connections at once to the app's server."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, limit: int) -> None:
        super().__init__(runner, host, port)
        self.limit = limit
        self.refused = 0

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        assert server is not None
        if len(server.connections) >= self.limit:
            if self.refused == 0:
                log.warning(
                    "%d client connections held: more are answered 503 (--max-connections)",
                    self.limit,
                )
            self.refused += 1
            return _Refusal()
        return server()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site (TCPSite.start would listen too)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


async def listen(runner: web.BaseRunner, settings: Settings) -> None:
    """A site on each address of `--host` (a comma list, as llama-server's), one port."""
    for host in settings.hosts:
        await CappedSite(runner, host, settings.port, settings.max_connections).start()
