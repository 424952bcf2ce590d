"""`IndexDB`: the index of the cache dir, an SQLite database (`index.sqlite3`, WAL) beside the
files it describes.

One row per committed entry: a row is committed only after its state file was renamed into
place (so the row is the commit marker) and deleted before its files are. Every query a
request, a save, a restore or a housekeeping tick makes is an index seek, never a pass over
the entries:

- `entries`: one row per entry (its chain as 16 bytes per key), indexed by key and by
  `last_used` (LRU order and TTL expiry).
- `prefixes`: one row per key of an entry's chain, ordered as the prefix lookup wants them
  (namespace, key, the entry's depth, most recently used first), so "the entry sharing the
  longest prefix, ending closest to it" is one seek per probe.
- `totals`: the entry count and bytes on disk, kept by triggers, so the byte budget and the
  gauges read one row however many entries there are; `kvproxy rm|gc` keep it true too.

A connection belongs to the thread that opened it (sqlite3's rule): the proxy runs its one
connection on a dedicated thread (`Store`), `kvproxy ls|rm|gc` on their main thread. Several
processes may share the file; SQLite's locking keeps them apart and a reader never waits for
a writer (WAL).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

from .entry import Entry

DB_NAME = "index.sqlite3"
SCHEMA_VERSION = 1
KEY_BYTES = 16  # a key is 32 hex digits (kvproxy.keys)
MAX_PARAMS = 500  # keys per IN (...) query: well under SQLite's parameter limit

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS namespaces(id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE);
CREATE TABLE IF NOT EXISTS entries(
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    ns INTEGER NOT NULL,
    n_tokens INTEGER NOT NULL,
    state_bytes INTEGER NOT NULL,
    msgs_bytes INTEGER NOT NULL,
    n_messages INTEGER NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL,
    checksum TEXT NOT NULL,
    sidecars TEXT NOT NULL,
    chain BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_lru ON entries(last_used);
CREATE INDEX IF NOT EXISTS entries_text ON entries(ns, last_used) WHERE msgs_bytes > 0;
CREATE TABLE IF NOT EXISTS prefixes(
    ns INTEGER NOT NULL,
    pkey INTEGER NOT NULL,
    edepth INTEGER NOT NULL,
    rank REAL NOT NULL,
    eid INTEGER NOT NULL,
    PRIMARY KEY (ns, pkey, edepth, rank, eid)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals(
    id INTEGER PRIMARY KEY CHECK (id = 0), n INTEGER NOT NULL, bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS entries_ins AFTER INSERT ON entries BEGIN
    UPDATE totals SET n = n + 1, bytes = bytes + new.state_bytes + new.msgs_bytes;
END;
CREATE TRIGGER IF NOT EXISTS entries_del AFTER DELETE ON entries BEGIN
    UPDATE totals SET n = n - 1, bytes = bytes - old.state_bytes - old.msgs_bytes;
END;
CREATE TRIGGER IF NOT EXISTS entries_upd AFTER UPDATE OF state_bytes, msgs_bytes ON entries
BEGIN
    UPDATE totals SET bytes = bytes - old.state_bytes - old.msgs_bytes
        + new.state_bytes + new.msgs_bytes;
END;
"""

_COLUMNS = (
    "e.id, e.key, n.name, e.n_tokens, e.state_bytes, e.msgs_bytes, e.n_messages, e.created, "
    "e.last_used, e.hits, e.checksum, e.sidecars, e.chain"
)
_FROM = "entries e JOIN namespaces n ON n.id = e.ns"


@dataclass(frozen=True)
class Totals:
    entries: int
    bytes: int


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


def pkey(key: str) -> int:
    """A chain key as the signed 64-bit integer the prefix table stores: its first 8 bytes.
    A collision is caught by comparing the found entry's chain (`IndexDB.longest`)."""
    return int.from_bytes(bytes.fromhex(key[:16]), "big", signed=True)


def pack_chain(chain: list[str]) -> bytes:
    return bytes.fromhex("".join(chain))


def unpack_chain(blob: bytes) -> list[str]:
    h = blob.hex()
    step = KEY_BYTES * 2
    return [h[i : i + step] for i in range(0, len(h), step)]


class IndexDB:
    """One connection to the cache dir's index; use it on the thread that opened it."""

    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.path = root / DB_NAME
        if not create and not self.path.exists():
            raise FileNotFoundError(f"no index at {self.path}")
        if create and not self.path.exists():
            # 0600 from the start: the index names every conversation's keys.
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        # Autocommit: every write below is its own explicit transaction.
        self.conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        # NORMAL (WAL): no fsync per transaction, so a save's bookkeeping is not three fsyncs.
        # A killed process loses nothing (the WAL is in the OS's cache); a power cut may roll
        # back the last transactions, never corrupt. What that can leave is safe: files a lost
        # row committed are swept at the next start; a row whose deletion was lost names files
        # that are gone, and the start-up scan drops it (a restore's file check would too).
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=30000")
        self._create_schema()
        self._ns: dict[str, int] = {}

    def _create_schema(self) -> None:
        # executescript commits on its own; the statements are all IF NOT EXISTS.
        self.conn.executescript(_SCHEMA)
        self.conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def _write(self, dry_run: bool = False) -> Iterator[None]:
        """One write transaction (taken at once, so two writers queue instead of failing);
        with `dry_run`, rolled back: what it would do, changing nothing."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("ROLLBACK" if dry_run else "COMMIT")

    # --- meta

    def get_meta(self, name: str) -> str | None:
        row = self.conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, name: str, value: str) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    def data_version(self) -> int:
        """Changes when another connection committed (PRAGMA data_version)."""
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    # --- reading

    def totals(self) -> Totals:
        n, b = self.conn.execute("SELECT n, bytes FROM totals WHERE id = 0").fetchone()
        return Totals(int(n), int(b))

    def get(self, key: str) -> Entry | None:
        cur = self.conn.execute(f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.key = ?", (key,))
        found = cur.fetchone()
        return None if found is None else _row(found)

    def used_since(self, when: float, limit: int) -> list[tuple[str, float]]:
        """(key, last_used) of the entries used at `when` or later, newest first."""
        cur = self.conn.execute(
            "SELECT key, last_used FROM entries WHERE last_used >= ? "
            "ORDER BY last_used DESC LIMIT ?",
            (when, limit),
        )
        return [(str(k), float(t)) for k, t in cur.fetchall()]

    def contains(self, key: str) -> bool:
        return (
            self.conn.execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone() is not None
        )

    def _ns_id(self, namespace: str, create: bool = False) -> int | None:
        found = self._ns.get(namespace)
        if found is not None:
            return found
        row = self.conn.execute("SELECT id FROM namespaces WHERE name = ?", (namespace,)).fetchone()
        if row is None:
            if not create:
                return None
            cur = self.conn.execute("INSERT INTO namespaces(name) VALUES (?)", (namespace,))
            ns = int(cur.lastrowid or 0)
        else:
            ns = int(row[0])
        self._ns[namespace] = ns
        return ns

    def _present(self, ns: int, key: str) -> bool:
        cur = self.conn.execute(
            "SELECT 1 FROM prefixes WHERE ns = ? AND pkey = ? LIMIT 1", (ns, pkey(key))
        )
        return cur.fetchone() is not None

    def longest(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `keys` (ending closest to it, then most
        recently used), and that prefix's length. Keys are chained hashes, so an entry holding
        keys[d-1] holds keys[:d]: the deepest shared depth is found by binary search, a few
        index seeks however long the conversation and however many entries share it."""
        ns = self._ns_id(namespace)
        if ns is None or not keys:
            return None
        if self._present(ns, keys[-1]):
            depth = len(keys)
        elif not self._present(ns, keys[0]):
            return None
        else:
            lo, hi = 1, len(keys)  # present at lo, absent at hi
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if self._present(ns, keys[mid - 1]):
                    lo = mid
                else:
                    hi = mid
            depth = lo
        cur = self.conn.execute(
            f"SELECT {_COLUMNS} FROM prefixes p JOIN entries e ON e.id = p.eid "
            "JOIN namespaces n ON n.id = e.ns "
            "WHERE p.ns = ? AND p.pkey = ? ORDER BY p.edepth, p.rank LIMIT 1",
            (ns, pkey(keys[depth - 1])),
        )
        got = cur.fetchone()
        if got is None:
            return None
        found = _row(got)
        chain = found.chain or [found.key]
        if len(chain) < depth or chain[depth - 1] != keys[depth - 1]:
            return None  # a 64-bit collision: no match rather than a wrong one
        return found, depth

    def ending_at(self, keys: list[str], namespace: str) -> list[tuple[Entry, int]]:
        """Entries whose key is one of `keys` (the request extends them), deepest first."""
        if not keys:
            return []
        ns = self._ns_id(namespace)
        if ns is None:
            return []
        depth = {k: i + 1 for i, k in enumerate(keys)}
        found = []
        for i in range(0, len(keys), MAX_PARAMS):
            part = keys[i : i + MAX_PARAMS]
            cur = self.conn.execute(
                f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.ns = ? "
                f"AND e.key IN ({','.join('?' * len(part))})",
                (ns, *part),
            )
            found += [(r, depth[r.key]) for r in map(_row, cur.fetchall())]
        found.sort(key=lambda pair: -pair[1])
        return found

    def recent_with_text(self, namespace: str, limit: int) -> list[str]:
        ns = self._ns_id(namespace)
        if ns is None:
            return []
        cur = self.conn.execute(
            "SELECT key FROM entries WHERE ns = ? AND msgs_bytes > 0 "
            "ORDER BY last_used DESC LIMIT ?",
            (ns, limit),
        )
        return [str(r[0]) for r in cur.fetchall()]

    def oldest(self) -> Iterator[Entry]:
        """Every entry, least recently used first (an index walk, read as far as needed)."""
        cur = self.conn.execute(f"SELECT {_COLUMNS} FROM {_FROM} ORDER BY e.last_used")
        for found in cur:
            yield _row(found)

    def unused_since(self, before: float) -> list[Entry]:
        cur = self.conn.execute(
            f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.last_used < ? ORDER BY e.last_used",
            (before,),
        )
        return [_row(r) for r in cur.fetchall()]

    def listing(self, query: Listing) -> tuple[list[Entry], Totals]:
        """`kvproxy ls`: the entries `query` selects, in its order, at most its limit, and
        the count and bytes of all it selects. Sorting by last use is an index walk."""
        where = "e.state_bytes + e.msgs_bytes >= ? AND e.created <= ? AND e.last_used <= ?"
        params = (query.min_size, query.created_before, query.used_before)
        column, descending = SORTS[query.sort]
        direction = "DESC" if descending != query.reverse else "ASC"
        sql = f"SELECT {_COLUMNS} FROM {_FROM} WHERE {where} ORDER BY {column} {direction}"
        if query.limit is not None:
            sql += f" LIMIT {max(0, int(query.limit))}"
        rows = [_row(r) for r in self.conn.execute(sql, params).fetchall()]
        n, b = self.conn.execute(
            f"SELECT COUNT(*), COALESCE(SUM(e.state_bytes + e.msgs_bytes), 0) FROM {_FROM} "
            f"WHERE {where}",
            params,
        ).fetchone()
        return rows, Totals(int(n), int(b))

    def with_prefix(self, prefix: str, limit: int) -> list[Entry]:
        """Entries whose key starts with `prefix` (hex), by the key index."""
        cur = self.conn.execute(
            f"SELECT {_COLUMNS} FROM {_FROM} WHERE e.key >= ? AND e.key < ? ORDER BY e.key LIMIT ?",
            (prefix, prefix + "g", limit),
        )
        return [_row(r) for r in cur.fetchall()]

    def delete_many(self, entries: list[Entry]) -> list[Entry]:
        """Drop these rows (those still as given) in one transaction; the rows dropped."""
        dropped = []
        with self._write():
            for entry in entries:
                row = self.get(entry.key)
                if row is not None and row.row_id == entry.row_id:
                    self._delete_row(row)
                    dropped.append(row)
        return dropped

    def all_files(self) -> dict[str, tuple[str, ...]]:
        """Every key and its sidecar suffixes (start-up only)."""
        cur = self.conn.execute("SELECT key, sidecars FROM entries")
        return {str(k): _sidecars(s) for k, s in cur.fetchall()}

    # --- writing

    def insert(self, entry: Entry) -> Entry:
        """Commit `entry` (replacing any row of its key): the commit marker."""
        with self._write():
            old = self._get_for_delete(entry.key)
            if old is not None:
                self._delete_row(old)
            return self._insert(entry)

    def insert_many(self, entries: Iterable[Entry]) -> int:
        """Import: one transaction for many rows; a key already indexed is kept as it is."""
        n = 0
        prefixes: list[tuple[int, int, int, float, int]] = []
        with self._write():
            for entry in entries:
                if self._get_for_delete(entry.key) is None:
                    self._insert(entry, prefixes)
                    n += 1
            # In key order: random inserts into a big prefix table would each touch another
            # page; sorted, a batch fills pages in turn (an import of 100k entries is 2M rows).
            prefixes.sort()
            self.conn.executemany("INSERT OR IGNORE INTO prefixes VALUES (?, ?, ?, ?, ?)", prefixes)
        return n

    def _insert(
        self, entry: Entry, later: list[tuple[int, int, int, float, int]] | None = None
    ) -> Entry:
        """Insert the row and its prefix rows (or add those to `later`, for the caller to
        insert in key order)."""
        ns = self._ns_id(entry.namespace, create=True)
        assert ns is not None  # created if missing
        cur = self.conn.execute(
            "INSERT INTO entries(key, ns, n_tokens, state_bytes, msgs_bytes, n_messages, "
            "created, last_used, hits, checksum, sidecars, chain) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                entry.key,
                ns,
                entry.n_tokens,
                entry.state_bytes,
                entry.msgs_bytes,
                entry.n_messages,
                entry.created,
                entry.last_used,
                entry.hits,
                entry.checksum,
                orjson.dumps(list(entry.sidecars)).decode(),
                pack_chain(entry.chain),
            ),
        )
        eid = int(cur.lastrowid or 0)
        chain = entry.chain or [entry.key]
        rows = [(ns, pkey(k), len(chain), -entry.last_used, eid) for k in chain]
        if later is not None:
            later += rows
        else:
            self.conn.executemany("INSERT OR IGNORE INTO prefixes VALUES (?, ?, ?, ?, ?)", rows)
        return replace(entry, row_id=eid, messages=None)

    def _get_for_delete(self, key: str) -> Entry | None:
        return self.get(key)

    def _delete_row(self, row: Entry) -> None:
        ns = self._ns_id(row.namespace)
        chain = row.chain or [row.key]
        self.conn.executemany(
            "DELETE FROM prefixes WHERE ns = ? AND pkey = ? AND edepth = ? AND rank = ? "
            "AND eid = ?",
            [(ns, pkey(k), len(chain), -row.last_used, row.row_id) for k in chain],
        )
        self.conn.execute("DELETE FROM entries WHERE id = ?", (row.row_id,))

    def delete(self, key: str, eid: int | None = None) -> Entry | None:
        """Drop the row of `key` (only if it is still row `eid`, when given); the row dropped."""
        with self._write():
            row = self.get(key)
            if row is None or (eid is not None and row.row_id != eid):
                return None
            self._delete_row(row)
            return row

    def touch(self, key: str, now: float, hits: int) -> None:
        """Record a use: LRU order, and the prefix order among entries of one depth."""
        with self._write():
            row = self.get(key)
            if row is None:
                return  # evicted or removed meanwhile: a use does not bring it back
            ns = self._ns_id(row.namespace)
            chain = row.chain or [row.key]
            self.conn.executemany(
                "UPDATE prefixes SET rank = ? WHERE ns = ? AND pkey = ? AND edepth = ? "
                "AND rank = ? AND eid = ?",
                [(-now, ns, pkey(k), len(chain), -row.last_used, row.row_id) for k in chain],
            )
            self.conn.execute(
                "UPDATE entries SET last_used = ?, hits = hits + ? WHERE id = ?",
                (now, hits, row.row_id),
            )

    def set_last_used(self, key: str, when: float) -> None:
        """Tests and benchmarks: age an entry."""
        row = self.get(key)
        if row is not None:
            with self._write():
                ns = self._ns_id(row.namespace)
                chain = row.chain or [row.key]
                self.conn.executemany(
                    "UPDATE prefixes SET rank = ? WHERE ns = ? AND pkey = ? AND eid = ?",
                    [(-when, ns, pkey(k), row.row_id) for k in chain],
                )
                self.conn.execute(
                    "UPDATE entries SET last_used = ? WHERE id = ?", (when, row.row_id)
                )

    def evict(
        self,
        now: float,
        ttl: float,
        max_bytes: int,
        pinned: frozenset[str],
        incoming: int = 0,
        dry_run: bool = False,
    ) -> list[Entry]:
        """TTL first, then least recently used until the budget (plus `incoming`) fits; the
        rows dropped (their files are the caller's to delete). Index walks that stop as soon
        as the budget fits: the cost is the victims', not the cache's."""
        victims: list[Entry] = []
        with self._write(dry_run):
            if ttl > 0:
                for row in self.unused_since(now - ttl):
                    if row.key not in pinned:
                        self._delete_row(row)
                        victims.append(row)
            if max_bytes > 0:
                total = self.totals().bytes + incoming
                if total > max_bytes:
                    for row in list(self._oldest_until(total - max_bytes, pinned)):
                        self._delete_row(row)
                        victims.append(row)
        return victims

    def _oldest_until(self, excess: int, pinned: frozenset[str]) -> Iterator[Entry]:
        freed = 0
        for row in self.oldest():
            if freed >= excess:
                return
            if row.key in pinned:
                continue
            freed += row.on_disk
            yield row


def _sidecars(raw: str) -> tuple[str, ...]:
    return tuple(str(s) for s in orjson.loads(raw))


def _row(r: tuple[Any, ...]) -> Entry:
    return Entry(
        row_id=int(r[0]),
        sidecars=_sidecars(r[11]),
        key=r[1],
        namespace=r[2],
        n_tokens=r[3],
        state_bytes=r[4],
        msgs_bytes=r[5],
        n_messages=r[6],
        created=r[7],
        last_used=r[8],
        hits=r[9],
        checksum=r[10],
        chain=unpack_chain(r[12]),
    )
