"""`OfflineStore`: the store's synchronous operations, for `kvproxy ls|rm|gc` and tests (no
event loop): the database and the files in the calling thread, with a connection of its own.
Never call these from the proxy's loop (`Store`'s `*_async` operations are the proxy's).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from kvproxy.keys import is_key
from kvproxy.store.db import IndexDB
from kvproxy.store.entry import Entry
from kvproxy.store.files import StoreFiles
from kvproxy.store.listing import Listing, Totals

T = TypeVar("T")


class OfflineStore:
    """Mixed into `Store`, which provides what is declared here."""

    root: Path
    files: StoreFiles
    ttl: float
    max_bytes: int
    _pinned: dict[str, int]

    def _sync(self, work: Callable[[IndexDB], T]) -> T:
        raise NotImplementedError

    def lookup(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        return self._sync(lambda db: db.longest(keys, namespace))

    def candidates(self, keys: list[str], namespace: str) -> list[tuple[Entry, int]]:
        """Entries a request could restore, each with the keys it shares with `keys`: the
        longest match (`lookup`), and every entry that ends exactly at one of the request's
        boundaries (the request extends it). Index seeks only: no pass over the entries that
        merely share a prefix (every conversation of an agent shares its system prompt).
        Deepest first."""
        return self._sync(lambda db: db.candidates(keys, namespace))

    def recent_with_text(self, namespace: str, limit: int = 8) -> list[str]:
        """Keys of the most recently used entries of `namespace` whose text was kept: the
        conversations a miss is compared with (reading every entry's text would not scale)."""
        return self._sync(lambda db: db.recent_with_text(namespace, limit))

    def set_last_used(self, key: str, when: float) -> None:
        """Tests and benchmarks: age an entry."""
        self._sync(lambda db: db.set_last_used(key, when))

    # --- changes

    def commit(self, entry: Entry, temp: str) -> Entry:
        if not (self.root / temp).exists():
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        old = self._sync(lambda db: db.delete(entry.key))
        committed = self.files.commit(entry, temp, old)
        if committed is None:
            if old is not None:
                self._sync(lambda db: db.insert(old))
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        return self._sync(lambda db: db.insert(committed))

    def remove(self, key: str) -> Entry | None:
        """Drop an entry: the row goes first, then its files."""
        row = self._sync(lambda db: db.delete(key))
        if row is not None:
            self.files.delete([row])
        return row

    def remove_damaged(self, key: str) -> None:
        """Delete the files of a key that has no row (see `open_readonly`)."""
        if is_key(key) and not self._sync(lambda db: db.contains(key)):
            self.files.delete_key(key)

    def select_victims(
        self, now: float | None = None, incoming: int = 0, dry_run: bool = False
    ) -> list[Entry]:
        """See `select_victims_async`; the caller deletes the files (`delete_files`). With
        `dry_run`, the victims are only named: no row changes."""
        when = time.time() if now is None else now
        pinned = frozenset(self._pinned)
        return self._sync(
            lambda db: db.evict(when, self.ttl, self.max_bytes, pinned, incoming, dry_run)
        )

    def remove_many(self, entries: list[Entry]) -> list[Entry]:
        """Drop entries (still as given) in one transaction, then their files; those dropped."""
        rows = self._sync(lambda db: db.delete_many(entries))
        self.files.delete(rows)
        return rows

    def listing(self, query: Listing) -> tuple[list[Entry], Totals]:
        """See `IndexDB.listing`."""
        return self._sync(lambda db: db.listing(query))

    def with_prefix(self, prefix: str, limit: int = 50) -> list[Entry]:
        """Entries whose key starts with the hex `prefix` (an index range)."""
        return self._sync(lambda db: db.with_prefix(prefix, limit))

    def all_entries(self) -> list[Entry]:
        """Every entry, least recently used first (`kvproxy rm --all`)."""
        return self._sync(lambda db: list(db.oldest()))

    def delete_files(self, entries: list[Entry]) -> None:
        self.files.delete(entries)
