"""Opening a cache dir: the import of old `.idx` records (once) and the start-up sweep.

Start-up only, on the thread that owns the connection: one directory scan and one pass over
the keys, the import in a few large transactions. A proxy sweeps (deletes what no row covers:
temp files of saves a killed process left, files of keys nobody committed); `kvproxy
ls|rm|gc` never do, since a sweep could delete a running proxy's save in flight, and once a
cache dir was imported they neither scan it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from pathlib import Path

from kvproxy.store.db import IndexDB
from kvproxy.store.files import Scanned, Steps, StoreFiles

log = logging.getLogger("kvproxy.store")

IMPORT_BATCH = 5000  # `.idx` records imported per transaction
# SQLite's page cache while importing (KiB): the prefix rows of a batch land all over a table
# that grows to ~2M rows at 100k entries; with the default 2 MiB cache most of them read and
# write back a page that was just evicted. The cache is given back after the import.
IMPORT_CACHE_KIB = 128 * 1024


def open_index(
    db: IndexDB, files: StoreFiles, sweep: bool, progress: Steps | None = None
) -> list[tuple[str, str]]:
    """Import old records, drop rows whose state file is gone, and (with `sweep`) delete what
    no row covers. Returns the (key, reason) of records that could not be imported."""
    files.create()
    if not sweep and db.get_meta("opened") is not None:
        return []  # imported before: rows are the truth, no scan for the CLI
    scanned: Scanned = files.scan(db.all_keys(), sweep, progress)
    if scanned.imported:
        n = len(scanned.imported)
        log.info("importing %d entries from the .idx records of an older kvproxy (once)", n)
        with db.cache_size(IMPORT_CACHE_KIB):
            for i in range(0, n, IMPORT_BATCH):
                db.insert_many(scanned.imported[i : i + IMPORT_BATCH])
                if progress is not None:
                    progress("importing old entries", min(i + IMPORT_BATCH, n), n)
        log.info("imported %d entries from .idx records", n)
    # The rows are committed: the records they came from go (see drop_records).
    good = {e.key for e in scanned.imported}
    if sweep:
        files.drop_records(scanned.records)
    else:
        files.drop_records(k for k in scanned.records if k in good)
    # On a full disk the index still opens (its rows are read, not written): what follows is
    # left for a later open, and the proxy runs as it does when the disk fills later (saves
    # fail, slots are still pinned and erased between tenants). Failing the open instead would
    # leave requests unpinned, free to reuse another tenant's tokens in a slot.
    with contextlib.suppress(sqlite3.OperationalError):
        for key in scanned.missing:  # state file gone (an older kvproxy swept it)
            row = db.delete(key)
            if row is not None and sweep:
                files.delete([row])
        if not scanned.problems:  # else a later open tries (and reports) them again
            db.set_meta("opened", str(time.time()))
    return scanned.problems


def set_aside(path: Path, exc: sqlite3.DatabaseError) -> bool:
    """An index SQLite finds corrupt (or cannot open although it is there) is renamed
    `index.sqlite3.corrupt-<time>` (its -wal and -shm beside it), so an empty one can be
    started and caching goes on without a restart. Its entries cannot be rebuilt: a state
    file's row (key chain, namespace, checksum) is the only record of it, so the sweep then
    removes the state files, which could not be checked. (`kvproxy ls|rm|gc` never move an
    index: a proxy may use it.) False when the error is not the file's (busy, full, read-only)."""
    if not _corrupt(exc) or not os.path.lexists(path):
        return False
    aside = f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
    for suffix in ("", "-wal", "-shm"):
        if os.path.lexists(f"{path}{suffix}"):
            os.rename(f"{path}{suffix}", path.parent / f"{aside}{suffix}")
    log.warning(
        "the cache index %s is unusable (%s): moved aside to %s; starting an empty index "
        "(state files without a row are swept)",
        path,
        exc,
        aside,
    )
    return True


def _corrupt(exc: sqlite3.DatabaseError) -> bool:
    """SQLite's word that the index file itself is bad (not busy, full or read-only)."""
    name = getattr(exc, "sqlite_errorname", "")
    if name:
        return name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB", "SQLITE_CANTOPEN"))
    return not isinstance(exc, sqlite3.OperationalError)
