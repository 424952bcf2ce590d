"""A byte budget for the request bodies kvproxy holds at once (`--max-body-memory`).

`--max-queue` bounds how many requests wait for a slot, not how big they are: 64 queued bodies
of 30 MiB held over 4 GiB. So every body is counted from before it is read until its answer
ends (queued or served, it is in memory all that while) and one that would take the total
past the budget is answered 503 with `Retry-After` before it is read. A body whose size the
head does not give (chunked) counts as `--max-body`, the most it can be. With nothing held,
one body always passes, so a budget under `--max-body` never refuses every large request.
"""

from __future__ import annotations


class HeldBodies:
    """Bytes of request bodies held now, against `limit` (0: no bound)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refused = 0

    def take(self, size: int) -> bool:
        """Counts a body of `size` bytes in, if the budget has room; False (and counted as
        refused) if not."""
        if self.limit and self.held and self.held + size > self.limit:
            self.refused += 1
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        self.held = max(0, self.held - size)
