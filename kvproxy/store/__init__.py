"""The disk store: saved slot states in the cache dir shared with llama-server.

- `kvproxy.store.files`: `StoreFiles`, the files on disk and their invariants (the `.idx`
  commit marker, written last and deleted first; O_NOFOLLOW, regular files only); any thread.
- `kvproxy.store.index`: `Store`, the in-memory index owned by the event loop, its `*_async`
  operations (one at a time per key, in issue order) and the synchronous ones for the CLI.
- `kvproxy.store.entry`: `Entry`, one saved state, and its JSON index record.
"""

from .entry import Entry
from .files import (
    MAX_IDX_BYTES,
    MAX_MSGS_BYTES,
    MSGS_SUFFIX,
    STATE_MAGIC,
    TMP_MARK,
    Loaded,
    StoreFiles,
)
from .index import Store

__all__ = [
    "MAX_IDX_BYTES",
    "MAX_MSGS_BYTES",
    "MSGS_SUFFIX",
    "STATE_MAGIC",
    "TMP_MARK",
    "Entry",
    "Loaded",
    "Store",
    "StoreFiles",
]
