"""`Store`: the loop-owned index of the cache dir, and the operations that keep it and the
files in step.

Who touches what. The in-memory index (`Store.entries`, the prefix map `lookup` uses, the pins
and `problems`) belongs to one thread: the event loop's in the proxy, the only thread in
`kvproxy ls|rm|gc`. Every change to it happens there (a change from another thread raises), so
the loop iterates it (lookups, eviction, `total_bytes`, the /metrics scrape) with no lock and
no copy. File I/O lives in `StoreFiles` (`kvproxy.store.files`), which keeps no index, so any
thread may run it. The proxy calls the `*_async` methods of `Store`: each does its index work
on the loop, runs the file I/O in a thread and applies the result on the loop when the thread
is done. The synchronous methods (`open`, `commit`, `remove`, ...) do both in the calling
thread, for a process with no event loop; never hand them to `asyncio.to_thread`.

Order on disk. The `*_async` operations that change a key's files (commit, record rewrite,
delete) run one at a time per key, in the order the loop issued them, and their index effects
are applied even if the request that asked for them is cancelled: a record rewrite after a
restore cannot bring back an `.idx` that a later eviction deleted, and the index never falls
behind the disk.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from ..keys import is_key
from .entry import Entry
from .files import Loaded, StoreFiles

log = logging.getLogger("kvproxy.store")

T = TypeVar("T")
R = TypeVar("R")


def _same(value: T) -> T:
    return value


class Store:
    """The index of the cache dir, and the operations that keep it and the files in step.

    Invariant: `entries`, the prefix map, the pins and `problems` change only on the thread
    that first changed them (the event loop in the proxy), and `entries` holds exactly the
    committed entries the proxy knows of; see the module docstring.
    """

    def __init__(self, root: Path, ttl: float, max_bytes: int) -> None:
        self.root = root
        self.files = StoreFiles(root)
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.entries: dict[str, Entry] = {}
        self._by_prefix: dict[str, set[str]] = {}
        self._pinned: dict[str, int] = {}
        self.problems: list[tuple[str, str]] = []  # (key, reason) skipped by the last load
        self._owner: int | None = None  # the thread the index belongs to
        self._last_op: dict[str, asyncio.Future[Any]] = {}  # per key, the latest file operation

    # --- names (any thread)

    def state_name(self, key: str) -> str:
        return self.files.state_name(key)

    def temp_name(self, key: str) -> str:
        """Where llama-server writes a save before it is committed under its key."""
        return self.files.temp_name(key)

    # --- the index: its own thread only, no I/O

    def _own(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError("the store index changed off its thread (use the *_async calls)")

    def _install(self, loaded: Loaded) -> None:
        self._own()
        self.entries.clear()
        self._by_prefix.clear()
        for entry in loaded.entries:
            self._add(entry)
        self.problems = loaded.problems

    def _add(self, entry: Entry) -> None:
        self._own()
        self.entries[entry.key] = entry
        for k in entry.chain or [entry.key]:
            self._by_prefix.setdefault(k, set()).add(entry.key)

    def _forget(self, key: str) -> Entry | None:
        self._own()
        entry = self.entries.pop(key, None)
        if entry is not None:
            for k in entry.chain or [entry.key]:
                holders = self._by_prefix.get(k)
                if holders is not None:
                    holders.discard(key)
                    if not holders:
                        del self._by_prefix[k]
        return entry

    @property
    def total_bytes(self) -> int:
        """Bytes on disk: state files, their sidecars and the conversations' text."""
        return sum(e.on_disk for e in self.entries.values())

    def lookup(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        """The stored entry sharing the longest prefix with `keys`, and that prefix's length."""
        for depth in range(len(keys), 0, -1):
            holders = self._by_prefix.get(keys[depth - 1])
            if not holders:
                continue
            # Prefer the entry that ends closest to this point: least to load, least to drop.
            candidates = [
                self.entries[k] for k in holders if self.entries[k].namespace == namespace
            ]
            if candidates:
                best = min(candidates, key=lambda e: (len(e.chain), -e.last_used))
                return best, depth
        return None

    def candidates(self, keys: list[str], namespace: str) -> list[tuple[Entry, int]]:
        """Entries a request could restore, each with the keys it shares with `keys`: the
        longest match (`lookup`), and every entry that ends exactly at one of the request's
        boundaries (the request extends it). O(len(keys)) dict look-ups: no pass over the
        entries that merely share a prefix (every conversation of an agent shares its system
        prompt). Deepest first."""
        out: list[tuple[Entry, int]] = []
        longest = self.lookup(keys, namespace)
        if longest is not None:
            out.append(longest)
        for depth in range(len(keys), 0, -1):
            entry = self.entries.get(keys[depth - 1])
            # Keys are chained hashes: an entry under keys[depth - 1] holds keys[:depth].
            if entry is not None and entry.namespace == namespace:
                if longest is None or entry is not longest[0]:
                    out.append((entry, depth))
        return out

    def recent_with_text(self, namespace: str, limit: int = 8) -> list[str]:
        """Keys of the most recently used entries of `namespace` whose text was kept: the
        conversations a miss is compared with (reading every entry's text would not scale)."""
        found = [e for e in self.entries.values() if e.namespace == namespace and e.msgs_bytes]
        found.sort(key=lambda e: e.last_used, reverse=True)
        return [e.key for e in found[:limit]]

    def pin(self, key: str) -> None:
        self._own()
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        self._own()
        left = self._pinned.get(key, 0) - 1
        if left > 0:
            self._pinned[key] = left
        else:
            self._pinned.pop(key, None)

    def expired(self, entry: Entry, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.ttl > 0 and now - entry.last_used > self.ttl

    def select_victims(self, now: float | None = None, incoming: int = 0) -> list[Entry]:
        """TTL first, then least recently used until the budget (plus `incoming`) fits.

        Victims leave the in-memory index at once; the caller deletes their files
        (`delete_files_async`, or `delete_files` with no event loop).
        """
        now = time.time() if now is None else now
        victims: list[Entry] = []
        if self.ttl > 0:
            for entry in list(self.entries.values()):
                if self.expired(entry, now) and entry.key not in self._pinned:
                    victims.append(entry)
                    self._forget(entry.key)
        if self.max_bytes > 0:
            total = self.total_bytes + incoming
            if total > self.max_bytes:
                for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
                    if total <= self.max_bytes:
                        break
                    if entry.key in self._pinned:
                        continue
                    victims.append(entry)
                    self._forget(entry.key)
                    total -= entry.on_disk
        return victims

    def _committed(self, temp: str, old: Entry | None, committed: Entry | None) -> Entry:
        """Index a commit that replaced `old` (already forgotten), or put `old` back."""
        if committed is None:  # nothing changed on disk: the old entry is still good
            if old is not None and old.key not in self.entries:
                self._add(old)
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        self._add(committed)
        return committed

    def _record_use(self, key: str, hits: int) -> bytes | None:
        """Count a use of `key` (for LRU across restarts); its new record, None if unknown."""
        self._own()
        entry = self.entries.get(key)
        if entry is None:
            return None
        entry.last_used = time.time()
        entry.hits += hits
        return entry.to_json()

    def _forget_gone(self, known: dict[str, Entry], gone: list[str]) -> list[str]:
        """Forget those of `gone` (seen without a commit marker) still indexed as they were in
        `known`: an entry committed again since, or being restored, stays."""
        forgotten = []
        for key in gone:
            if self.entries.get(key) is known[key] and key not in self._pinned:
                self._forget(key)
                forgotten.append(key)
        return forgotten

    # --- the proxy: index work on the loop, file I/O in a thread

    async def open_async(self) -> None:
        """Create the directory, sweep what no commit covers, load the index."""
        await self._in_thread((), self._open_dir, self._install)
        self._log_opened()

    async def commit_async(self, entry: Entry, temp: str) -> Entry:
        """Commit a finished save (see `StoreFiles.commit`); the committed entry.
        FileNotFoundError if the server wrote nothing under `temp`."""
        old = self._forget(entry.key)  # its commit marker is the first thing to go on disk
        work = partial(self.files.commit, entry, temp)
        return await self._in_thread((entry.key,), work, partial(self._committed, temp, old))

    async def touch_async(self, key: str, hits: int = 1) -> None:
        """Record a use (for LRU across restarts)."""
        record = self._record_use(key, hits)
        if record is not None:
            await self._in_thread((key,), partial(self.files.rewrite_record, key, record))

    async def remove_async(self, entry: Entry) -> None:
        """Drop `entry`, if it is still the one indexed under its key (else whoever replaced or
        forgot it has its files in hand)."""
        if self.entries.get(entry.key) is entry:
            self._forget(entry.key)
            await self._in_thread((entry.key,), partial(self.files.delete, [entry.key]))

    async def delete_files_async(self, victims: list[Entry]) -> None:
        """Delete the files of entries `select_victims` took out of the index."""
        keys = [e.key for e in victims]
        await self._in_thread(keys, partial(self.files.delete, keys))

    async def forget_removed_async(self) -> list[str]:
        """Forget entries whose commit marker someone else deleted (`kvproxy rm`, `gc`), so the
        budget and gauges stay true; the keys forgotten."""
        known = dict(self.entries)
        work = partial(self.files.missing_records, list(known))
        return await self._in_thread((), work, partial(self._forget_gone, known))

    def _in_thread(
        self,
        keys: Iterable[str],
        work: Callable[[], T],
        then: Callable[[T], R] = _same,  # type: ignore[assignment]
    ) -> asyncio.Future[R]:
        """Run `work()` in a thread once the operations issued earlier on `keys` are done, then
        `then(result)` on the loop. A task of its own that the caller's cancellation does not
        reach: a request whose client hung up neither lets a later operation on these keys
        overtake this one nor leaves the index behind the disk."""
        keys = list(keys)
        earlier = {self._last_op[k] for k in keys if k in self._last_op}
        task = asyncio.ensure_future(_after(earlier, work, then))
        for k in keys:
            self._last_op[k] = task
        task.add_done_callback(partial(self._op_done, keys))
        return asyncio.shield(task)

    def _op_done(self, keys: list[str], task: asyncio.Future[Any]) -> None:
        for k in keys:
            if self._last_op.get(k) is task:
                del self._last_op[k]

    # --- no event loop (kvproxy ls|rm|gc): index and files in the calling thread

    def open(self) -> None:
        """Create the directory, sweep what no commit covers, load the index."""
        self._install(self._open_dir())
        self._log_opened()

    def open_readonly(self) -> list[tuple[str, str]]:
        """Load the index without changing anything on disk, for `kvproxy ls|rm|gc` while a
        proxy may be using the directory (a sweep could delete its save in flight). Returns
        the (key, reason) of records skipped; FileNotFoundError when there is no cache dir."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"no cache dir at {self.root}")
        self._install(self.files.load(sweep=False))
        return self.problems

    def commit(self, entry: Entry, temp: str) -> Entry:
        old = self._forget(entry.key)
        return self._committed(temp, old, self.files.commit(entry, temp))

    def remove(self, key: str) -> None:
        """Drop an entry: the commit marker goes first."""
        self._forget(key)
        self.files.delete([key])

    def remove_damaged(self, key: str) -> None:
        """Delete the files of a key that has no loadable entry (see `open_readonly`)."""
        if is_key(key) and key not in self.entries:
            self.files.delete([key])

    def delete_files(self, entries: list[Entry]) -> None:
        self.files.delete([e.key for e in entries])

    # --- reads and temp clean-up: no index, any thread

    def read_messages(self, key: str) -> list[Any] | None:
        return self.files.read_messages(key)

    def read_many_messages(self, keys: list[str]) -> list[tuple[str, list[Any]]]:
        return self.files.read_many_messages(keys)

    def check_state_file(self, entry: Entry) -> str | None:
        return self.files.check_state_file(entry)

    def verify_checksum(self, entry: Entry) -> str | None:
        return self.files.verify_checksum(entry)

    def discard_temp(self, temp: str) -> None:
        self.files.discard_temp(temp)

    def _open_dir(self) -> Loaded:
        self.files.create()
        return self.files.load(sweep=True)

    def _log_opened(self) -> None:
        log.info("cache dir %s: %d entries, %s", self.root, len(self.entries), self.total_bytes)


async def _after(
    earlier: set[asyncio.Future[Any]], work: Callable[[], T], then: Callable[[T], R]
) -> R:
    if earlier:
        await asyncio.wait(earlier)
    return then(await asyncio.to_thread(work))
