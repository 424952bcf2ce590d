"""The prefix lookup: which stored entries a request could restore, in two or three queries.

Keys are chained hashes, so an entry holding `keys[d-1]` holds `keys[:d]`: "is the prefix of
depth d stored?" falls from yes to no once as d grows, and the deepest stored depth is found
by probing depths. Each probe is one seek in `prefixes` (its order puts the entry ending
closest to the prefix, then the most recently used, first), and one statement probes up to
`PROBES` depths at once, chosen where requests' answers lie: the request's last key (a save
of exactly this conversation), the one before it (a conversation continuing with a new
message) and the first (a new conversation sharing a system prompt), the rest spread between.
A second statement reads the found entry and the entries the request extends (whose key is
one of the request's keys). Every Python-to-SQLite call costs more than the seek it runs, so
the statements are few rather than each simple.
"""

from __future__ import annotations

import sqlite3

from kvproxy.store.entry import Entry
from kvproxy.store.schema import COLUMNS, FROM, entry_of, pkey

PROBES = 8  # depths probed per statement
MAX_PARAMS = 500  # keys per IN (...) query: well under SQLite's parameter limit


def _probe_sql(n: int) -> str:
    seek = "(SELECT eid FROM prefixes WHERE ns = ?1 AND pkey = ? ORDER BY edepth, rank LIMIT 1)"
    return "SELECT " + ", ".join([seek] * n)


_PROBE_SQL = [_probe_sql(n) for n in range(PROBES + 1)]


def _depths_to_probe(lo: int, hi: int) -> list[int]:
    """Up to PROBES depths strictly between `lo` (stored) and `hi` (not stored), ascending:
    the likeliest answers (just below `hi`, just above `lo`) and the rest evenly spread."""
    inside = hi - lo - 1
    if inside <= PROBES:
        return list(range(lo + 1, hi))
    picked = {lo + 1, hi - 1, hi - 2}
    step = inside / (PROBES - len(picked) + 1)
    picked.update(lo + 1 + int(step * i) for i in range(1, PROBES - len(picked) + 1))
    return sorted(picked)[:PROBES]


def deepest(conn: sqlite3.Connection, ns: int, keys: list[str]) -> tuple[int, int] | None:
    """The deepest depth d whose prefix `keys[:d]` an entry of namespace `ns` holds, and the
    row id of the entry holding it that ends closest to it (most recently used first)."""
    lo, hi = 0, len(keys) + 1  # stored at lo (0: trivially), not stored at hi
    found = 0
    while hi - lo > 1:
        depths = _depths_to_probe(lo, hi)
        row = conn.execute(
            _PROBE_SQL[len(depths)], (ns, *(pkey(keys[d - 1]) for d in depths))
        ).fetchone()
        for d, eid in zip(depths, row, strict=True):
            if eid is None:
                hi = d
                break
            lo, found = d, int(eid)
    return (lo, found) if lo else None


def candidates(
    conn: sqlite3.Connection, ns: int, keys: list[str], *, extended: bool = True
) -> list[tuple[Entry, int]]:
    """Entries a request with `keys` could restore, each with the number of keys it shares:
    the one sharing the longest prefix (ending closest to it, then most recently used)
    first, then (with `extended`) every other entry whose key is one of `keys` (the request
    extends it), deepest first. Index seeks only: no pass over the entries that merely share
    a prefix (every conversation of an agent shares its system prompt)."""
    if not keys:
        return []
    best = deepest(conn, ns, keys)
    if best is None:
        return []  # no entry holds even the first key: none can end at any of them
    depth, eid = best
    # An entry ending at keys[d-1] holds keys[:d], so d <= depth; and the one ending at
    # `depth` itself, if any, is the entry found (the probe's order puts the entry ending
    # closest first, and keys are unique). So only keys[:depth-1] are looked up: none for a
    # new conversation on a shared system prompt.
    wanted = keys[: depth - 1] if extended else []
    rows = _read(conn, ns, eid, wanted)
    out: list[tuple[Entry, int]] = []
    found = next((r for r in rows if r.row_id == eid), None)
    chain = (found.chain or [found.key]) if found is not None else []
    if found is not None and len(chain) >= depth and chain[depth - 1] == keys[depth - 1]:
        out.append((found, depth))
    elif extended:
        # A 64-bit collision of `pkey` put another entry first: no match rather than a wrong
        # one, and the entry ending at `depth`, if any, is looked up by its key.
        rows += _read(conn, ns, None, keys[depth - 1 : depth])
    wanted = keys[:depth] if extended else []
    position = {k: i + 1 for i, k in enumerate(wanted)}
    ending = sorted(
        ((r, position[r.key]) for r in rows if r.key in position), key=lambda pair: -pair[1]
    )
    longest = out[0][0].key if out else None
    out += [(r, d) for r, d in ending if r.key != longest]
    return out


def _read(conn: sqlite3.Connection, ns: int, eid: int | None, keys: list[str]) -> list[Entry]:
    """The entry of row `eid` and the entries of namespace `ns` whose key is one of `keys`,
    in one statement (a request of over MAX_PARAMS keys: one more per MAX_PARAMS). Each
    statement is its own read transaction: wrapping the two or three of a lookup in one
    (BEGIN ... COMMIT) cost more CPU than it saved, measured."""
    rows: list[Entry] = []
    for i in range(0, max(1, len(keys)), MAX_PARAMS):
        part = keys[i : i + MAX_PARAMS]
        selects: list[str] = []
        params: list[int | str] = []
        if i == 0 and eid is not None:
            selects.append(f"SELECT {COLUMNS} FROM {FROM} WHERE e.id = ?")
            params.append(eid)
        if part:
            marks = ",".join("?" * len(part))
            selects.append(f"SELECT {COLUMNS} FROM {FROM} WHERE e.ns = ? AND e.key IN ({marks})")
            params += [ns, *part]
        if selects:
            rows += map(entry_of, conn.execute(" UNION ALL ".join(selects), params).fetchall())
    # UNION ALL: the found entry may also be one the request extends; one copy is enough,
    # and cheaper to drop here than UNION's comparison of whole rows in a temporary b-tree.
    return list({r.row_id: r for r in rows}.values())
