"""Slow clients for `chaos` (slowloris): many connections that trickle a request, a few bytes
at a time, and never finish it, while other clients are served.

Half of them trickle the request's head (one more header line every `interval`), half send
a whole head announcing a large body and trickle the body, to a pass-through route
(`/tokenize`, which kvproxy forwards to the server) and to a keyed one (chat). A connection
the other side closes, or answers, is counted and opened again after a pause, as an
attacker would; so is one refused while kvproxy is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ROUTES = ("/tokenize", "/v1/chat/completions")
BODY_BYTES = 1_000_000  # announced, never sent


@dataclass
class SlowEffect:
    """Other clients' latencies (s), by request, without slow clients and with them."""

    without: dict[str, list[float]] = field(default_factory=dict)
    with_slow: dict[str, list[float]] = field(default_factory=dict)
    held: int = 0  # slow connections open when the second phase began

    def ratio(self, kind: str) -> float | None:
        a, b = self.without.get(kind), self.with_slow.get(kind)
        if not a or not b:
            return None
        return statistics.median(b) / statistics.median(a)

    def worst(self) -> float | None:
        ratios = [r for k in self.without if (r := self.ratio(k)) is not None]
        return max(ratios) if ratios else None

    def rows(self) -> list[list[object]]:
        out: list[list[object]] = []
        for kind, before in self.without.items():
            after = self.with_slow.get(kind) or []
            r = self.ratio(kind)
            out.append(
                [
                    kind,
                    f"{len(before)} / {len(after)}",
                    f"{statistics.median(before) * 1000:.0f}",
                    f"{statistics.median(after) * 1000:.0f}" if after else "-",
                    "-" if r is None else f"{r:.2f}×",
                ]
            )
        return out


@dataclass
class SlowStats:
    opened: int = 0
    refused: int = 0  # connections refused (kvproxy down, or over its cap)
    closed: int = 0  # ended by kvproxy while still trickling, without an answer
    answered: dict[str, int] = field(default_factory=dict)  # kvproxy's answers, by status line
    held_now: int = 0
    held_max: int = 0
    longest_s: float = 0.0  # the longest a trickling connection was kept open

    def summary(self) -> str:
        answers = ", ".join(f"{n}× {s}" for s, n in self.answered.items()) or "none"
        return (
            f"{self.opened} slow connections opened ({self.held_max} at once at most), "
            f"{self.closed} closed by kvproxy, {self.refused} refused, answered: {answers}; "
            f"the longest one held {self.longest_s:.0f} s"
        )


class Slowloris:
    def __init__(
        self,
        address: Callable[[], tuple[str, int]],
        connections: int,
        interval: float,
        up: asyncio.Event,
        key: str = "chaos-slow",
        source: str | None = "127.0.0.2",
    ) -> None:
        self.address = address  # where kvproxy listens now
        # One client of its own (kvproxy shares --max-connections fairly among client
        # addresses): another loopback address than the well-behaved clients' 127.0.0.1.
        self.source = source
        self.connections = connections
        self.interval = interval
        self.up = up  # set while kvproxy runs: no reconnection storm while it is down
        self.key = key
        self.stats = SlowStats()
        self.tasks: list[asyncio.Task[None]] = []
        self.changed = asyncio.Event()  # a connection started or stopped trickling

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._loop(i)) for i in range(self.connections)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks = []

    async def held(self, at_least: int, within: float) -> int:
        """Waits until `at_least` connections are open and trickling (or `within` s)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while self.stats.held_now < at_least:
                    self.changed.clear()
                    await self.changed.wait()
        return self.stats.held_now

    async def _loop(self, i: int) -> None:
        route = ROUTES[(i // 2) % len(ROUTES)]
        while True:
            await self.up.wait()
            host, port = self.address()
            try:
                local = (self.source, 0) if self.source else None
                reader, writer = await asyncio.open_connection(host, port, local_addr=local)
            except OSError:
                self.stats.refused += 1
                await asyncio.sleep(0.5)
                continue
            self.stats.opened += 1
            try:
                await self._trickle(reader, writer, route, head_only=i % 2 == 0)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
            await asyncio.sleep(0.5)

    async def _trickle(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        route: str,
        head_only: bool,
    ) -> None:
        head = (
            f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
        )
        if not head_only:
            head += f"Content-Length: {BODY_BYTES}\r\n\r\n" + '{"content": "'
        answer = asyncio.create_task(reader.read(200))
        started = time.monotonic()
        self.stats.held_now += 1
        self.stats.held_max = max(self.stats.held_max, self.stats.held_now)
        self.changed.set()
        try:
            writer.write(head.encode())
            n = 0
            while not answer.done():
                await asyncio.wait({answer}, timeout=self.interval)
                if answer.done():
                    break
                n += 1
                writer.write(f"X-Slow-{n}: {n}\r\n".encode() if head_only else b"a")
                await writer.drain()
        except (ConnectionError, OSError):
            # Written into a closed connection: an answer may be there to read.
            await asyncio.wait({answer}, timeout=1.0)
        finally:
            self.stats.held_now -= 1
            self.stats.longest_s = max(self.stats.longest_s, time.monotonic() - started)
            if not answer.done():
                answer.cancel()
        self._ended(answer)

    def _ended(self, answer: asyncio.Task[bytes]) -> None:
        if not answer.done() or answer.cancelled() or answer.exception() is not None:
            self.stats.closed += 1
            return
        first = answer.result().split(b"\r\n", 1)[0].decode("latin-1")
        if first:
            status = first.removeprefix("HTTP/1.1 ")
            self.stats.answered[status] = self.stats.answered.get(status, 0) + 1
        else:
            self.stats.closed += 1
