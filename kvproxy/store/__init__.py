"""The disk store: saved slot states in the cache dir shared with llama-server.

- `kvproxy.store.files`: `StoreFiles`, the files on disk and their invariants (derived names,
  O_NOFOLLOW, regular files only; old `.idx` records read for import); any thread.
- `kvproxy.store.db`: `IndexDB`, the SQLite index (`index.sqlite3`, WAL): one row per entry,
  the commit marker, written after the files and deleted before them; LRU/TTL order and a
  trigger-kept byte total. Its tables and connection settings: `kvproxy.store.schema`; the
  prefix lookup: `kvproxy.store.lookup`; `kvproxy ls`'s query: `kvproxy.store.listing`.
- `kvproxy.store.store`: `Store`, the operations that keep index and files in step: `*_async`
  for the proxy (the database on one dedicated thread, `kvproxy.store.thread`; files in
  threads; one operation at a time per key, in issue order) and the synchronous ones for the
  CLI. Opening a cache dir (import of old records, start-up sweep): `kvproxy.store.startup`.
- `kvproxy.store.heads`: `Heads`, every entry's first two keys on the event loop, which
  answer a new session's lookup without the hop to the index thread.
- `kvproxy.store.offline`: the synchronous operations of `kvproxy ls|rm|gc` (no event loop).
- `kvproxy.store.entry`: `Entry`, one saved state, and the old JSON index record.
"""

from kvproxy.store.db import IndexDB
from kvproxy.store.entry import Entry
from kvproxy.store.files import (
    MAX_IDX_BYTES,
    MAX_MSGS_BYTES,
    MSGS_SUFFIX,
    SIDECAR_SUFFIXES,
    STATE_MAGIC,
    TMP_MARK,
    Scanned,
    StoreFiles,
)
from kvproxy.store.listing import SORTS, Listing, Totals
from kvproxy.store.schema import DB_NAME
from kvproxy.store.store import Store

__all__ = [
    "DB_NAME",
    "MAX_IDX_BYTES",
    "MAX_MSGS_BYTES",
    "MSGS_SUFFIX",
    "SIDECAR_SUFFIXES",
    "SORTS",
    "STATE_MAGIC",
    "TMP_MARK",
    "Entry",
    "IndexDB",
    "Listing",
    "Scanned",
    "Store",
    "StoreFiles",
    "Totals",
]
