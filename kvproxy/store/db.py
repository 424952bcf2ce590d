"""`IndexDB`: one connection to the cache dir's index, an SQLite database (`index.sqlite3`,
WAL) beside the files it describes (its layout: `kvproxy.store.schema`).

One row per committed entry: a row is committed only after its state file was renamed into
place (so the row is the commit marker) and deleted before its files are. Every query a
request, a save, a restore or a housekeeping tick makes is an index seek, never a pass over
the entries (the prefix lookup: `kvproxy.store.lookup`; `kvproxy ls`: `kvproxy.store.listing`).

A connection belongs to the thread that opened it (sqlite3's rule): the proxy runs its one
connection on a dedicated thread (`Store`), `kvproxy ls|rm|gc` on their main thread. Several
processes may share the file; SQLite's locking keeps them apart and a reader never waits for
a writer (WAL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import orjson

from kvproxy.store import lookup
from kvproxy.store.entry import Entry
from kvproxy.store.listing import Listing, Totals, listing, totals
from kvproxy.store.schema import (
    COLUMNS,
    FROM,
    KEY_BYTES,
    connect,
    entry_of,
    pack_chain,
    pkey,
    sidecars,
)
from kvproxy.store.schema import DB_NAME as DB_NAME  # where kvproxy's tools look for it

# The head of each entry's chain `heads` reads: its first two keys (`kvproxy.store.heads`).
HEAD_BYTES = 2 * KEY_BYTES


class IndexUnwritable(OSError):
    """The index could not do what was asked (SQLite's operational error, its message kept)."""


class IndexDB:
    """One connection to the cache dir's index; use it on the thread that opened it."""

    def __init__(self, root: Path, *, create: bool = True) -> None:
        self.path = root / DB_NAME
        self.conn = connect(self.path, create)
        self._ns: dict[str, int] = {}
        # The totals as the last write transaction left them, read inside it: the summary a
        # write's caller wants costs no read transaction of its own (see `Store._db`).
        self.written: Totals | None = None
        self._version: int | None = None  # PRAGMA data_version when `others_wrote` last looked

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def cache_size(self, kib: int) -> Iterator[None]:
        """A larger page cache for a while (an import); shrunk back after, freeing it."""
        (before,) = self.conn.execute("PRAGMA cache_size").fetchone()
        self.conn.execute(f"PRAGMA cache_size = -{int(kib)}")
        try:
            yield
        finally:
            self.conn.execute(f"PRAGMA cache_size = {int(before)}")

    @contextlib.contextmanager
    def _write(self, dry_run: bool = False) -> Iterator[None]:
        """One write transaction (taken at once, so two writers queue instead of failing);
        with `dry_run`, rolled back: what it would do, changing nothing."""
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.written = None if dry_run else self.totals()
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

    def others_wrote(self) -> bool:
        """Did another connection commit since the last call (True at the first)?"""
        version, self._version = self._version, self.data_version()
        return version != self._version

    def heads(self) -> tuple[dict[int, str], list[tuple[int, bytes | str]]]:
        """Every entry's first keys (`Heads.load`) by namespace id: its chain's first bytes,
        or its key (hex) when it has no chain; and the namespaces' names. One pass."""
        names = {int(i): str(n) for i, n in self.conn.execute("SELECT id, name FROM namespaces")}
        cur = self.conn.execute(
            f"SELECT ns, CASE WHEN length(chain) > 0 THEN substr(chain, 1, {HEAD_BYTES}) "
            "ELSE key END FROM entries"
        )
        return names, cur.fetchall()

    # --- reading

    def totals(self) -> Totals:
        return totals(self.conn)

    def get(self, key: str) -> Entry | None:
        cur = self.conn.execute(f"SELECT {COLUMNS} FROM {FROM} WHERE e.key = ?", (key,))
        found = cur.fetchone()
        return None if found is None else entry_of(found)

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

    def longest(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        """The entry sharing the longest prefix with `keys` (ending closest to it, then most
        recently used), and that prefix's length (see `kvproxy.store.lookup`)."""
        found = self.candidates(keys, namespace, extended=False)
        return found[0] if found else None

    def candidates(
        self, keys: list[str], namespace: str, *, extended: bool = True
    ) -> list[tuple[Entry, int]]:
        """See `kvproxy.store.lookup.candidates`."""
        ns = self._ns_id(namespace)
        return [] if ns is None else lookup.candidates(self.conn, ns, keys, extended=extended)

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
        cur = self.conn.execute(f"SELECT {COLUMNS} FROM {FROM} ORDER BY e.last_used")
        for found in cur:
            yield entry_of(found)

    def unused_since(self, before: float) -> list[Entry]:
        cur = self.conn.execute(
            f"SELECT {COLUMNS} FROM {FROM} WHERE e.last_used < ? ORDER BY e.last_used",
            (before,),
        )
        return [entry_of(r) for r in cur.fetchall()]

    def listing(self, query: Listing) -> tuple[list[Entry], Totals]:
        """See `kvproxy.store.listing.listing`."""
        return listing(self.conn, query)

    def with_prefix(self, prefix: str, limit: int) -> list[Entry]:
        """Entries whose key starts with `prefix` (hex), by the key index."""
        cur = self.conn.execute(
            f"SELECT {COLUMNS} FROM {FROM} WHERE e.key >= ? AND e.key < ? ORDER BY e.key LIMIT ?",
            (prefix, prefix + "g", limit),
        )
        return [entry_of(r) for r in cur.fetchall()]

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

    def all_keys(self) -> set[str]:
        """Every key (start-up only: what the directory scan compares with)."""
        return {str(k) for (k,) in self.conn.execute("SELECT key FROM entries")}

    def all_files(self) -> dict[str, tuple[str, ...]]:
        """Every key and its sidecar suffixes (start-up only)."""
        cur = self.conn.execute("SELECT key, sidecars FROM entries")
        return {str(k): sidecars(s) for k, s in cur.fetchall()}

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
            "created, last_used, hits, checksum, sidecars, chain, model, kind) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                entry.model,
                entry.kind,
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

    def touch(self, key: str, now: float, hits: int) -> Entry | None:
        """Record a use: LRU order, and the prefix order among entries of one depth. The
        entry as it is now (None: evicted or removed meanwhile, and a use does not bring it
        back)."""
        with self._write():
            row = self.get(key)
            if row is None:
                return None
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
        return replace(row, last_used=now, hits=row.hits + hits)

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
