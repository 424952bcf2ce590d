"""The llama-servers managed mode runs (`--servers N`, one by default): one model, a port
each, one cache dir. A server that dies is started again on its port after a back-off, while
kvproxy keeps serving with the others (or, with one, answers 503 with Retry-After meanwhile:
down_for); what it had not saved is lost, as with any crash. A server that keeps dying at
start is given up on.

A server that came up healthy and then died is not a failed start: a client's request may
have crashed it (a grammar nested deep enough segfaults llama-server), and ending kvproxy
then would let one client stop the service. It is started again, with the same back-off
between deaths in quick succession (capped), as long as it comes up; only starts that never
reach a healthy server count toward giving up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvproxy.server import leftover
from kvproxy.server.managed import ManagedServer, ServerError, Waiting

log = logging.getLogger("kvproxy.managed")

# A server that ran this long before it died starts again after the first delay.
HEALTHY_RUN_S = 60.0


@dataclass(frozen=True)
class Backoff:
    """Seconds to wait before the next start, by failures in a row: 1, 2, 4 … `most`.
    After `give_up` starts in a row that fail, the server is not started again."""

    first: float = 1.0
    most: float = 30.0
    give_up: int = 5

    def delay(self, failures: int) -> float:
        return float(min(self.most, self.first * 2 ** max(0, failures - 1)))


@dataclass
class Streak:
    """One server's recent history, on plain data: deaths of a server that had come up
    (each within HEALTHY_RUN_S of its start) set the back-off; only starts that failed, in a
    row, count toward giving up."""

    backoff: Backoff
    deaths: int = 0  # in a row, each soon after the start before it
    failed_starts: int = 0  # in a row

    def died(self, ran_s: float) -> float:
        """A server that was up died after `ran_s`: the delay before starting it again."""
        self.deaths = 1 if ran_s >= HEALTHY_RUN_S else self.deaths + 1
        return self.backoff.delay(self.deaths)

    def start_failed(self) -> float | None:
        """A start did not reach a healthy server: the delay before the next, None to give
        up."""
        self.failed_starts += 1
        if self.failed_starts >= self.backoff.give_up:
            return None
        return self.backoff.delay(self.deaths + self.failed_starts)

    def started(self) -> None:
        self.failed_starts = 0


class Fleet:
    def __init__(
        self,
        servers: Sequence[ManagedServer],
        cache_dir: Path,
        backoff: Backoff | None = None,
    ) -> None:
        self.servers = list(servers)
        self.cache_dir = cache_dir
        self.backoff = backoff or Backoff()
        self.restarts = 0  # starts after a death, over the fleet's life
        # Told the name of a server that came up and died (kvproxy serve names the requests
        # that were in flight then).
        self.on_death: Callable[[str], object] | None = None
        # Port -> time.monotonic() of the next start of a server that died (until it is up).
        self._next_start: dict[int, float] = {}

    def down_for(self) -> float | None:
        """While every server is dead and waiting to start again: the seconds until the
        next start (a client's Retry-After); None while one runs."""
        if len(self._next_start) < len(self.servers):
            return None
        return max(0.0, min(self._next_start.values()) - time.monotonic())

    @property
    def urls(self) -> list[str]:
        return [server.url for server in self.servers]

    async def start(
        self, timeout: float, waiting: Callable[[int], Waiting | None] | None = None
    ) -> None:
        """Start every server, one after another (the first learns what flags this CPU needs
        for the rest), and write them down for a kvproxy started after a SIGKILL of this one."""
        try:
            for i, server in enumerate(self.servers):
                await server.start(timeout, waiting(i) if waiting is not None else None)
                await self._record()
        except BaseException:
            await self.stop()
            raise

    async def supervise(self) -> ServerError:
        """Runs while the servers do, starting again any that dies; returns (the reason to
        exit) only when a server cannot be started any more."""
        watches = [asyncio.create_task(self._watch(server)) for server in self.servers]
        try:
            done, _ = await asyncio.wait(watches, return_when=asyncio.FIRST_COMPLETED)
            return next(iter(done)).result()
        finally:
            for task in watches:
                task.cancel()
            for task in watches:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _watch(self, server: ManagedServer) -> ServerError:
        streak = Streak(self.backoff)
        while True:
            began = time.monotonic()
            await server.wait()
            delay: float | None = streak.died(time.monotonic() - began)
            if self.on_death is not None:
                self.on_death(f"on port {server.port}")
            log.error(
                "%s\nstarting it again in %.0f s (what it had not saved is lost)",
                server.death_message(),
                delay,
            )
            while delay is not None:
                self._next_start[server.port] = time.monotonic() + delay
                await asyncio.sleep(delay)
                try:
                    await server.start(server.start_timeout)
                except ServerError as exc:
                    delay = streak.start_failed()
                    log.error("llama-server on port %d did not start: %s", server.port, exc)
                    if delay is None:
                        return ServerError(
                            f"llama-server on port {server.port} failed to start "
                            f"{streak.failed_starts} times in a row; not starting it again. "
                            f"{server.death_message()}"
                        )
                    continue
                streak.started()
                self._next_start.pop(server.port, None)
                self.restarts += 1
                await self._record()
                break

    async def _record(self) -> None:
        running = [
            (s.process.pid, s.command)
            for s in self.servers
            if s.process is not None and s.process.returncode is None
        ]
        try:
            await asyncio.to_thread(leftover.record_many, self.cache_dir, running)
        except OSError as exc:  # only a kvproxy SIGKILLed later would leave its server behind
            log.warning("cannot write down the servers started in %s: %s", self.cache_dir, exc)

    async def recent_log(self, n: int) -> list[str]:
        """The servers' last `n` lines; with several, each one's in turn, tagged with its port."""
        if len(self.servers) == 1:
            return await self.servers[0].recent_log(n)
        lines: list[str] = []
        for server in self.servers:
            lines += [f"[{server.port}] {line}" for line in await server.recent_log(n)]
        return lines

    async def stop(self, grace: float = 10.0) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self.servers))
        try:
            await asyncio.to_thread(leftover.forget, self.cache_dir)
        except OSError as exc:
            log.warning("cannot update the record of llama-servers in %s: %s", self.cache_dir, exc)
