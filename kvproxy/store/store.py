"""`Store`: the cache dir's index (an SQLite database, `kvproxy.store.db`) and the operations
that keep it and the files in step.

Who touches what. The index lives in the database: the proxy keeps only the pins of entries
being restored, the operations in flight per key, a summary (entry count and bytes, one row
the triggers keep) refreshed after each write, and the first two keys of every entry
(`kvproxy.store.heads`). In the proxy every query and write runs on one thread with one
connection (`_db`), file I/O in `asyncio.to_thread` (`StoreFiles`), results applied on the
event loop: the loop never waits for SQLite or the disk. `kvproxy ls|rm|gc` (no event loop)
call the synchronous methods (`kvproxy.store.offline`) on a connection of the calling thread.
Several processes share the database safely (SQLite's locking, WAL); rows are the truth.

Order on disk. The `*_async` operations that change a key's files (commit, delete) run one
at a time per key, in issue order, and finish even if their request is cancelled. A commit
deletes the key's old row before its files change and writes the new row after they are in
place (the row is the commit marker; a commit that fails leaves none of the key's files); a
deletion drops the row before the files. An eviction's victims are rows it deleted; their
files are deleted unless a commit of the same key was in flight meanwhile (they are its).
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TypeVar

from kvproxy import readable
from kvproxy.store.db import IndexDB, IndexUnwritable
from kvproxy.store.entry import Entry
from kvproxy.store.files import Steps, StoreFiles
from kvproxy.store.heads import Heads
from kvproxy.store.listing import Totals
from kvproxy.store.offline import OfflineStore
from kvproxy.store.perkey import PerKey
from kvproxy.store.salt import load_or_create
from kvproxy.store.schema import DB_NAME
from kvproxy.store.startup import open_index, set_aside
from kvproxy.store.thread import IndexThread
from kvproxy.store.view import EntriesView

log = logging.getLogger("kvproxy.store")

T = TypeVar("T")


class Store(OfflineStore):
    """The index of the cache dir, and the operations that keep it and the files in step.
    See the module docstring for which thread does what."""

    def __init__(self, root: Path, ttl: float, max_bytes: int) -> None:
        self.root = root
        self.files = StoreFiles(root)
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.problems: list[tuple[str, str]] = []  # (key, reason) skipped by the last open
        self.ready = False  # opened: the proxy serves uncached until then
        # Mixed into tenants' hashes (salt.py); read at the proxy's open. Until then tenants
        # are hashed unsalted: kept apart as well, only named otherwise.
        self.tenant_salt = b""
        self.summary = Totals(0, 0)
        self._pinned: dict[str, int] = {}
        # File operations: one at a time per key, in issue order. What one raises after its
        # caller left goes to `on_orphaned_error` (the cache reports it as a fault).
        self.on_orphaned_error: Callable[[BaseException], None] | None = None
        self._serial = PerKey(self._orphaned).run
        self._committing: dict[str, int] = {}  # keys with a commit in flight
        self._watchers: list[set[str]] = []  # keys committed while an eviction runs
        self._local = threading.local()  # one IndexDB per thread
        self._thread = IndexThread()  # the proxy's index connection lives there
        # The lookups settled by entries' first two keys, answered on the loop (heads.py).
        self.heads = Heads()
        self._jobs = 0  # jobs sent to the index thread, which runs them in that order

    # --- names (any thread)

    def state_name(self, key: str) -> str:
        return self.files.state_name(key)

    def temp_name(self, key: str) -> str:
        """Where llama-server writes a save before it is committed under its key."""
        return self.files.temp_name(key)

    # --- the database

    def _conn(self) -> IndexDB:
        """The calling thread's connection (sqlite3 connections stay on their thread)."""
        db: IndexDB | None = getattr(self._local, "db", None)
        if db is None:
            if not self.root.exists():
                self.files.create()
            db = IndexDB(self.root)
            self._local.db = db
        return db

    async def _db(
        self,
        work: Callable[[IndexDB], T],
        refresh: bool = True,
        then: Callable[[T, int], None] | None = None,
    ) -> T:
        """Run `work` on the index thread; with `refresh` (writes), the summary is refreshed
        with it. Lookups leave it be: it changes only with writes, ours (refreshed then) or
        another process's (housekeeping's refresh, every second). A full disk or a read-only
        dir comes out as IndexUnwritable (an OSError), as for any other file. `then(result,
        job number)` runs on the loop as soon as the result is back: in the order the jobs ran
        (results come back in that order, and nothing is awaited in between)."""
        seq = self._jobs
        self._jobs += 1
        try:
            result, totals = await self._thread.run(partial(self._with_totals, work, refresh))
        except sqlite3.OperationalError as exc:
            raise IndexUnwritable(str(exc)) from exc
        if totals is not None:
            self.summary = totals
        if then is not None:
            then(result, seq)
        return result

    def _with_totals(
        self, work: Callable[[IndexDB], T], refresh: bool = True
    ) -> tuple[T, Totals | None]:
        db = self._conn()
        db.written = None
        result = work(db)
        if not refresh:
            return result, None
        return result, db.written or db.totals()

    def _sync(self, work: Callable[[IndexDB], T]) -> T:
        result, totals = self._with_totals(work)
        assert totals is not None
        self.summary = totals
        if self._conn().written is not None:
            self.heads.stale()  # written from outside the index thread (tests, tools)
        return result

    def close(self) -> None:
        """Close the connections and end the proxy's index thread (if it started)."""
        if self._thread.started:
            self._thread.call(self._close_local)
            self._thread.stop()
        self._close_local()
        self.files.owner.release()

    def _close_local(self) -> None:
        db: IndexDB | None = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # --- what the loop keeps: pins and a summary

    @property
    def total_bytes(self) -> int:
        """Bytes on disk: state files, their sidecars and the conversations' text (as of the
        last query; housekeeping refreshes it every second)."""
        return self.summary.bytes

    @property
    def entries(self) -> Mapping[str, Entry]:
        """A read-only view of the committed entries, querying the database in the calling
        thread: for `kvproxy ls|rm|gc` and tests, never the proxy's request paths."""
        return EntriesView(self._sync)

    def pin(self, key: str) -> None:
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        left = self._pinned.get(key, 0) - 1
        if left > 0:
            self._pinned[key] = left
        else:
            self._pinned.pop(key, None)

    def expired(self, entry: Entry, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.ttl > 0 and now - entry.last_used > self.ttl

    # --- lookups (the proxy: on the index thread)

    async def lookup_async(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        """The stored entry sharing the longest prefix with `keys`, and that prefix's length."""
        return await self._db(lambda db: db.longest(keys, namespace), refresh=False)

    async def candidates_async(self, keys: list[str], namespace: str) -> list[tuple[Entry, int]]:
        """See `candidates`; answered on the loop when the entries' first keys settle it."""
        found = self.heads.answer(keys, namespace)
        if found is not None:
            return found
        return await self._db(
            lambda db: db.candidates(keys, namespace),
            refresh=False,
            then=lambda got, _: self.heads.remember(keys, namespace, got),
        )

    async def used_since_async(self, when: float, limit: int = 10_000) -> list[tuple[str, float]]:
        """(key, last_used) of the entries used since `when` (wall clock), newest first."""
        return await self._db(lambda db: db.used_since(when, limit), refresh=False)

    async def contains_async(self, key: str) -> bool:
        return await self._db(lambda db: db.contains(key), refresh=False)

    async def recent_with_text_async(self, namespace: str, limit: int = 8) -> list[str]:
        """See `recent_with_text`."""
        return await self._db(lambda db: db.recent_with_text(namespace, limit), refresh=False)

    async def refresh_async(self) -> Totals:
        """Re-read the summary (another process may have removed entries), and the entries'
        first keys when another process wrote (or they were never read)."""
        if await self._db(lambda db: db.others_wrote()) or not self.heads.ready:
            self.heads.stale()
            await self._db(lambda db: db.heads(), refresh=False, then=self.heads.load)
        return self.summary

    async def forget_removed_async(self) -> list[str]:
        """The summary refreshed (rows are the truth: nothing to forget); always []."""
        await self.refresh_async()
        return []

    # --- the proxy: changes

    async def open_async(self) -> None:
        """Create the directory, import old `.idx` records, sweep what no row covers."""
        self.problems, self.summary = await self._thread.run(self._open_recovering)
        self.tenant_salt = await asyncio.to_thread(load_or_create, self.root)
        self.ready = True
        self._log_opened()

    async def commit_async(self, entry: Entry, temp: str) -> Entry:
        """Commit a finished save (see `StoreFiles.commit`); the committed entry.
        FileNotFoundError if the server wrote nothing under `temp`."""
        key = entry.key
        self._committing[key] = self._committing.get(key, 0) + 1
        for seen in self._watchers:
            seen.add(key)

        async def run() -> Entry:
            try:
                return await self._commit_steps(entry, temp)
            finally:
                left = self._committing.pop(key) - 1
                if left:
                    self._committing[key] = left

        return await self._serial((key,), run)

    async def _commit_steps(self, entry: Entry, temp: str) -> Entry:
        # The commit marker goes first.
        old = await self._db(lambda db: db.delete(entry.key), then=self._removed)
        try:
            committed = await asyncio.to_thread(self.files.commit, entry, temp, old)
        except OSError:  # a full disk mid-commit: no row names the key, so no file may stay
            await asyncio.to_thread(self.files.delete_key, entry.key)
            raise
        if committed is None:  # nothing changed on disk: the old entry is still good
            if old is not None:
                await self._db(lambda db: db.insert(old), then=self.heads.added)
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        return await self._db(lambda db: db.insert(committed), then=self.heads.added)

    def _removed(self, row: Entry | None, seq: int) -> None:
        if row is not None:
            self.heads.removed(row, seq)

    def _evicted(self, rows: list[Entry], seq: int) -> None:
        for row in rows:
            self.heads.removed(row, seq)

    def _orphaned(self, exc: BaseException) -> None:
        if self.on_orphaned_error is not None:
            self.on_orphaned_error(exc)

    async def touch_async(self, key: str, hits: int = 1) -> None:
        """Record a use (for LRU across restarts); an entry gone meanwhile stays gone."""
        now = time.time()
        await self._serial(
            (key,), partial(self._db, lambda db: db.touch(key, now, hits), then=self._touched)
        )

    def _touched(self, row: Entry | None, seq: int) -> None:
        if row is not None:
            self.heads.touched(row, seq)

    async def remove_async(self, entry: Entry) -> None:
        """Drop `entry`, if it is still the row indexed under its key (else whoever replaced
        or removed it has its files in hand)."""

        async def run() -> None:
            row = await self._db(
                lambda db: db.delete(entry.key, entry.row_id or None), then=self._removed
            )
            if row is not None:
                await asyncio.to_thread(self.files.delete, [row])

        await self._serial((entry.key,), run)

    async def select_victims_async(self, incoming: int = 0) -> list[Entry]:
        """TTL first, then least recently used until the budget (plus `incoming`) fits:
        indexed queries, stopping once the budget fits. The victims' rows are gone when this
        returns; delete their files with `delete_files_async`. Entries pinned for a restore
        or being committed stay; a victim whose key was committed again meanwhile is left out
        (its files are the new commit's)."""
        summary, now = self.summary, time.time()
        if (self.ttl <= 0 or now - summary.oldest <= self.ttl) and (
            self.max_bytes <= 0 or summary.bytes + incoming <= self.max_bytes
        ):
            return []  # the summary is exact as of the last write: nothing to ask
        # A key being committed is no victim: its row may be the new one (files left rowless).
        seen = set(self._committing)
        pinned = frozenset(self._pinned) | frozenset(seen)
        self._watchers.append(seen)
        try:
            victims = await self._db(
                lambda db: db.evict(now, self.ttl, self.max_bytes, pinned, incoming),
                then=self._evicted,
            )
        finally:
            self._watchers.remove(seen)
        return [v for v in victims if v.key not in seen]

    async def supersede_async(
        self, entry: Entry, choose: Callable[[list[Entry]], list[str]]
    ) -> list[Entry]:
        """Remove the entries `entry` (committed) extends that `choose` names (lineage.py), and
        their files; those removed. Those pinned for a restore or being committed stay."""
        chain, ns = entry.chain[:-1], entry.namespace
        seen = set(self._committing)
        pinned = frozenset(self._pinned) | frozenset(seen)
        self._watchers.append(seen)

        def work(db: IndexDB) -> list[Entry]:
            older = [e for e in map(db.get, chain) if e is not None and e.namespace == ns]
            names = set(choose(older))
            return db.delete_many([e for e in older if e.key in names and e.key not in pinned])

        try:
            removed = await self._db(work, then=self._evicted)
        finally:
            self._watchers.remove(seen)
        removed = [e for e in removed if e.key not in seen]
        if removed:
            await self.delete_files_async(removed)
        return removed

    async def delete_files_async(self, victims: list[Entry]) -> None:
        """Delete the files of entries `select_victims_async` took out of the index."""
        keys = [e.key for e in victims]
        await self._serial(keys, partial(asyncio.to_thread, self.files.delete, victims))

    # --- no event loop (kvproxy ls|rm|gc, tests): database and files in the calling thread

    def open(self) -> None:
        """Create the directory, import old `.idx` records, sweep what no row covers."""
        self.problems, self.summary = self._open_recovering()
        self.ready = True
        self._log_opened()

    def _open_recovering(self) -> tuple[list[tuple[str, str]], Totals]:
        """The proxy's open, on the thread that owns the connection; an unusable index is
        moved aside and an empty one started (startup.set_aside)."""
        try:
            return self._open_with_totals()
        except sqlite3.DatabaseError as exc:
            self._close_local()  # the next try (here, or the proxy's later one) starts afresh
            if not set_aside(self.root / DB_NAME, exc):
                raise
            return self._open_with_totals()

    def _open_with_totals(self) -> tuple[list[tuple[str, str]], Totals]:
        db = self._conn()
        self.files.owner.take()  # before the sweep: what it leaves alone of others' is theirs
        problems = self._open_in(db, sweep=True)
        return problems, db.totals()

    def open_readonly(self, progress: Steps | None = None) -> list[tuple[str, str]]:
        """Open the index without sweeping, for `kvproxy ls|rm|gc` while a proxy may be
        using the directory (a sweep could delete its save in flight). Old `.idx` records are
        imported (rows only add what they describe; `progress` hears how far). Returns the
        (key, reason) of records not imported; FileNotFoundError when there is no cache dir."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"no cache dir at {self.root}")
        self.problems = self._sync(partial(self._open_in, sweep=False, progress=progress))
        self.ready = True
        return self.problems

    def _open_in(
        self, db: IndexDB, sweep: bool, progress: Steps | None = None
    ) -> list[tuple[str, str]]:
        """The open's work (`kvproxy.store.startup`), on the thread that owns `db`."""
        return open_index(db, self.files, sweep, progress)

    def _log_opened(self) -> None:
        n, size = self.summary.entries, self.summary.bytes
        log.info("cache dir %s: %d entries, %s", self.root, n, readable.size(size))
