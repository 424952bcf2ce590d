"""Which requests were in flight when a managed llama-server died, so the log and
`/kvproxy/stats` name the request that may have killed it (a body that crashes the server,
sent again and again, would otherwise only show as restarts).

A request is named by its route, its body's size and a hash of the body (never its text: a
prompt is the client's), so an operator can match it against a client's logs or a repeat.
The body is hashed as the request starts (xxh3, a small fraction of parsing it), not kept:
a reference here would keep every body's raw bytes alive after kvproxy let them go, a
second copy of each queued body (edge/heldbodies.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import asdict, dataclass

import xxhash

log = logging.getLogger("kvproxy.proxy")

# Deaths /kvproxy/stats keeps, newest last.
DEATHS_KEPT = 8
# Requests one death names at most (the oldest in flight first).
NAMED_PER_DEATH = 16


@dataclass(frozen=True)
class Named:
    """A request as a death names it."""

    method: str
    path: str
    body_bytes: int
    body_hash: str  # xxh3-64 of the body, hex


@dataclass(frozen=True)
class Flight(Named):
    started: float  # time.monotonic()


@dataclass(frozen=True)
class Suspect(Named):
    running_s: float


@dataclass(frozen=True)
class Death:
    server: str  # the server's name (its port, or URL)
    at: float  # time.time()
    in_flight: list[Suspect]


class InFlight:
    """Requests with a body between its read and their answer, by a running number."""

    def __init__(self) -> None:
        self._flights: dict[int, Flight] = {}
        self._ids = itertools.count()
        self.deaths: deque[Death] = deque(maxlen=DEATHS_KEPT)

    def start(self, method: str, path: str, body: bytes) -> int:
        ticket = next(self._ids)
        digest = xxhash.xxh3_64_hexdigest(body)
        self._flights[ticket] = Flight(method, path, len(body), digest, time.monotonic())
        return ticket

    def end(self, ticket: int) -> None:
        self._flights.pop(ticket, None)

    def server_died(self, server: str) -> Death:
        """A server died: what was in flight (on it or another: kvproxy relays bytes, it does
        not attribute them here), logged and kept for /kvproxy/stats."""
        now = time.monotonic()
        flights = sorted(self._flights.values(), key=lambda f: f.started)[:NAMED_PER_DEATH]
        suspects = [
            Suspect(f.method, f.path, f.body_bytes, f.body_hash, round(now - f.started, 3))
            for f in flights
        ]
        death = Death(server, time.time(), suspects)
        self.deaths.append(death)
        if suspects:
            log.error(
                "llama-server %s died with %d request(s) in flight: %s",
                server,
                len(self._flights),
                "; ".join(
                    f"{s.method} {s.path} body {s.body_bytes} B xxh3 {s.body_hash} "
                    f"running {s.running_s:.1f} s"
                    for s in suspects
                ),
            )
        else:
            log.error("llama-server %s died with no request with a body in flight", server)
        return death

    def snapshot(self) -> list[dict[str, object]]:
        return [asdict(d) for d in self.deaths]
