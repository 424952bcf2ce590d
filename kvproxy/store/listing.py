"""`kvproxy ls`'s query: which entries, in which order, and how many it selects in all."""

from __future__ import annotations

import math
import sqlite3
from dataclasses import dataclass

from kvproxy.store.entry import Entry
from kvproxy.store.schema import COLUMNS, FROM, entry_of


@dataclass(frozen=True)
class Totals:
    entries: int
    bytes: int
    # The least recent `last_used` (inf when empty): nothing can have outlived the TTL
    # before `oldest + ttl`, so until then housekeeping has nothing to ask the index.
    oldest: float = math.inf


# `kvproxy ls --sort`: name -> (column, descending); the default direction puts the most
# interesting first.
SORTS: dict[str, tuple[str, bool]] = {
    "last-used": ("e.last_used", True),
    "age": ("e.created", False),  # oldest first
    "size": ("e.state_bytes + e.msgs_bytes", True),
    "tokens": ("e.n_tokens", True),
    "hits": ("e.hits", True),
}


@dataclass(frozen=True)
class Listing:
    """What `kvproxy ls` asks for."""

    sort: str = "last-used"
    reverse: bool = False
    limit: int | None = None
    min_size: int = 0
    created_before: float = float("inf")
    used_before: float = float("inf")

    @property
    def filtered(self) -> bool:
        return (
            self.min_size > 0
            or self.created_before != float("inf")
            or self.used_before != float("inf")
        )


def totals(conn: sqlite3.Connection) -> Totals:
    """The totals row and the least recent use (the first entry of the LRU index)."""
    n, b, oldest = conn.execute(
        "SELECT n, bytes, (SELECT MIN(last_used) FROM entries) FROM totals WHERE id = 0"
    ).fetchone()
    return Totals(int(n), int(b), math.inf if oldest is None else float(oldest))


def listing(conn: sqlite3.Connection, query: Listing) -> tuple[list[Entry], Totals]:
    """The entries `query` selects, in its order, at most its limit, and the count and bytes
    of all it selects. Sorting by last use is an index walk; without a filter the count is
    the totals row, so `ls --limit 20` reads 21 rows however many entries there are."""
    where = "e.state_bytes + e.msgs_bytes >= ? AND e.created <= ? AND e.last_used <= ?"
    params = (query.min_size, query.created_before, query.used_before)
    column, descending = SORTS[query.sort]
    direction = "DESC" if descending != query.reverse else "ASC"
    sql = f"SELECT {COLUMNS} FROM {FROM} WHERE {where} ORDER BY {column} {direction}"
    if query.limit is not None:
        sql += f" LIMIT {max(0, int(query.limit))}"
    rows = [entry_of(r) for r in conn.execute(sql, params).fetchall()]
    if not query.filtered:
        return rows, totals(conn)
    n, b = conn.execute(
        f"SELECT COUNT(*), COALESCE(SUM(e.state_bytes + e.msgs_bytes), 0) FROM entries e "
        f"WHERE {where}",
        params,
    ).fetchone()
    return rows, Totals(int(n), int(b))
