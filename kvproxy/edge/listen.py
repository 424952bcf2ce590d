"""Where kvproxy listens, and what a client connection may hold.

Slow clients (slowloris) cost an asyncio server little each, but nothing else bounds them:
aiohttp keeps a connection whose request head never ends for an hour, and any number of
them. So: a connection held at once beyond `--max-connections` is answered 503 and closed
before its request is read (file descriptors and memory stay for the others); a request head
must arrive within `--client-timeout` of the connection opening or of the previous answer
(aiohttp's keep-alive timer, which also closes idle connections then); its body has as long
again (edge/app.py reads it whole before anything is forwarded, so a slow body never holds
one of llama-server's few HTTP threads).

One pool for all would let a single client that re-opens slow connections hold every one of
them while everybody else gets 503s; so a client (its address: the only name a connection has
before its request is read) holds at most a fair share, `--max-connections` divided among the
clients holding connections (itself counted, at least two, so one alone leaves half free).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
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


class Admission(enum.Enum):
    ADMIT = "admit"
    FULL = "full"  # --max-connections held in all
    OVER_SHARE = "over_share"  # this client holds its fair share of them


def fair_share(limit: int, clients: int) -> int:
    """Connections one client may hold when `clients` (the one connecting included) hold
    some: never under one, never more than half while it is alone (room for a newcomer)."""
    return max(1, limit // max(2, clients))


def admit(held_by_client: int, held: int, clients: int, limit: int) -> Admission:
    """Whether a new connection of a client holding `held_by_client` is served, with `held`
    connections held in all by `clients` clients (the one connecting included)."""
    if held >= limit:
        return Admission.FULL
    if held_by_client >= fair_share(limit, clients):
        return Admission.OVER_SHARE
    return Admission.ADMIT


def _busy_answer(message: str) -> bytes:
    body = orjson.dumps({"error": {"code": 503, "message": message, "type": "unavailable_error"}})
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY_ANSWER = _busy_answer(
    "kvproxy holds as many client connections as it may (--max-connections); try again."
)
SHARE_ANSWER = _busy_answer(
    "This client holds its share of kvproxy's client connections (--max-connections divided "
    "among the clients connected); close one or try again."
)


def _client(transport: asyncio.BaseTransport | None) -> str | None:
    """A connection's client: its peer address without the port (None for a Unix socket)."""
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


class _Gate(asyncio.Protocol):
    """Decides on a new connection once its peer is known (a protocol factory is called
    before that): a refused one gets one 503 and is closed, its request never read; an
    admitted one is handed to the app's server, which then receives everything."""

    def __init__(self, site: CappedSite) -> None:
        self.site = site

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        server = self.site._runner.server
        assert server is not None
        client = _client(transport)
        clients: dict[str | None, int] = {}
        for handler in server.connections:
            peer = _client(handler.transport)
            clients[peer] = clients.get(peer, 0) + 1
        mine = clients.get(client, 0)
        decision = admit(mine, len(server.connections), len(clients | {client: 0}), self.site.limit)
        if decision is Admission.ADMIT:
            handler = server()
            transport.set_protocol(handler)
            handler.connection_made(transport)
            return
        self.site.refused(decision, client)
        transport.write(BUSY_ANSWER if decision is Admission.FULL else SHARE_ANSWER)
        transport.close()


class CappedSite(web.TCPSite):
    """A TCP site that hands at most `limit` connections at once to the app's server, on a
    socket bound beforehand (`reserve`)."""

    def __init__(
        self, runner: web.BaseRunner, sock: socket.socket, host: str, port: int, limit: int
    ) -> None:
        super().__init__(runner, host, port)
        self.sock = sock
        self.limit = limit
        self.refusals = 0
        self._warned: set[str | None] = set()  # clients named once in the log as over share

    def refused(self, decision: Admission, client: str | None) -> None:
        if decision is Admission.FULL and self.refusals == 0:
            log.warning(
                "%d client connections held: more are answered 503 (--max-connections)",
                self.limit,
            )
        elif decision is Admission.OVER_SHARE and client not in self._warned:
            if len(self._warned) < 1024:  # a bounded memory of whom the log named
                self._warned.add(client)
                log.warning(
                    "client %s holds its share of --max-connections (%d): its further "
                    "connections are answered 503",
                    client,
                    self.limit,
                )
        self.refusals += 1

    def _protocol(self) -> asyncio.Protocol:
        return _Gate(self)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site (TCPSite.start would listen too)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, sock=self.sock, backlog=self._backlog
        )


def reserve(settings: Settings) -> list[tuple[str, socket.socket]]:
    """The port on each address of `--host` (a comma list, as llama-server's), bound now and
    listened on later (`listen`): before kvproxy starts anything, so a port another process
    holds stops it at once, and nothing takes the port meanwhile. Bound as asyncio's
    create_server binds (every address a name resolves to, SO_REUSEADDR, IPv6 only on IPv6
    sockets); connections are refused until `listen`. Raises OSError (all closed then)."""
    bound: list[tuple[str, socket.socket]] = []
    try:
        for host in settings.hosts:
            infos = socket.getaddrinfo(
                host or None,
                settings.port,
                type=socket.SOCK_STREAM,
                flags=socket.AI_PASSIVE,
            )
            for family, kind, proto, _, address in dict.fromkeys(infos):
                sock = socket.socket(family, kind, proto)
                bound.append((host, sock))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
    except OSError:
        close(bound)
        raise
    return bound


def close(bound: list[tuple[str, socket.socket]]) -> None:
    for _, sock in bound:
        with contextlib.suppress(OSError):
            sock.close()


async def listen(
    runner: web.BaseRunner,
    settings: Settings,
    bound: list[tuple[str, socket.socket]] | None = None,
) -> None:
    """A site on each socket `reserve` bound (bound now when none are given)."""
    for host, sock in reserve(settings) if bound is None else bound:
        await CappedSite(runner, sock, host, settings.port, settings.max_connections).start()
