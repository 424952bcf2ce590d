"""A memory budget for the request bodies kvproxy holds at once (`--max-body-memory`).

`--max-queue` bounds how many requests wait for a slot, not how big they are: 64 queued bodies
of 30 MiB held over 4 GiB. So every body is counted from before it is read until its answer
ends (queued or served, it is in memory all that while) and one that would take the total
past the budget is answered 503 with `Retry-After` before it is read. A body whose size the
head does not give (chunked) counts as `--max-body`, the most it can be. With nothing held,
one body always passes, so a budget under `--max-body` never refuses every large request.

A body is counted at what holding it costs, not at its size (COST).
"""

from __future__ import annotations

import math

# What a held body costs kvproxy per byte of it, measured on 30 MiB bodies: a queued chat
# holds its parse only (tracemalloc 1.0x, RSS 1.16x with the allocator's slack; the raw bytes
# are let go, handlers/keyed.py), a queued completion its parse and its 256-character blocks'
# keys (1.35x), a body on its way out its parse and the copy sent (briefly 2x). Before the
# raw bytes were let go, a queued chat held 2.0x (RSS 2.3x).
COST = 1.5


class HeldBodies:
    """What the request bodies held now cost, against `limit` bytes (0: no bound)."""

    def __init__(self, limit: int, cost: float = COST) -> None:
        self.limit = limit
        self.cost = cost
        self.held = 0
        self.refused = 0

    def take(self, size: int) -> bool:
        """Counts a body of `size` bytes in, if the budget has room; False (and counted as
        refused) if not."""
        weight = self._weight(size)
        if self.limit and self.held and self.held + weight > self.limit:
            self.refused += 1
            return False
        self.held += weight
        return True

    def give_back(self, size: int) -> None:
        self.held = max(0, self.held - self._weight(size))

    def _weight(self, size: int) -> int:
        return math.ceil(size * self.cost)
