"""The index database's layout: tables, connection settings, and an `Entry` as a row.

One row per committed entry in `entries` (its chain as 16 bytes per key), indexed by key and
by `last_used` (LRU order and TTL expiry); one row per key of an entry's chain in `prefixes`,
ordered as the prefix lookup wants them (namespace, key, the entry's depth, most recently
used first), so "the entry sharing this prefix, ending closest to it" is one seek; `totals`,
the entry count and bytes on disk, kept by triggers, so the byte budget and the gauges read
one row however many entries there are.

An index of an older layout is brought up to date when opened (`MIGRATIONS`); an older
kvproxy still opens a newer one (each column added since has a default, and every query
names its columns).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path
from typing import Any

import orjson

from kvproxy.store.entry import Entry

DB_NAME = "index.sqlite3"
SCHEMA_VERSION = 3
KEY_BYTES = 16  # a key is 32 hex digits (kvproxy.keys)

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
    chain BLOB NOT NULL,
    model TEXT NOT NULL DEFAULT '',
    kind TEXT NOT NULL DEFAULT ''
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
# Written last, in the script's transaction: its presence says the schema is complete.
_SCHEMA += f"INSERT OR IGNORE INTO meta VALUES ('schema', '{SCHEMA_VERSION}');\n"

# Version -> the statement that takes an index of that version to the next one.
MIGRATIONS: dict[str, str] = {
    # 2: the model an entry's state came from (a router's model name, or the GGUF file's).
    "1": "ALTER TABLE entries ADD COLUMN model TEXT NOT NULL DEFAULT ''",
    # 3: what an entry is kept for (Entry.kind): a conversation's turn, or a shared start.
    "2": "ALTER TABLE entries ADD COLUMN kind TEXT NOT NULL DEFAULT ''",
}

COLUMNS = (
    "e.id, e.key, n.name, e.n_tokens, e.state_bytes, e.msgs_bytes, e.n_messages, e.created, "
    "e.last_used, e.hits, e.checksum, e.sidecars, e.chain, e.model, e.kind"
)
FROM = "entries e JOIN namespaces n ON n.id = e.ns"


def connect(path: Path, create: bool) -> sqlite3.Connection:
    """A connection to the index at `path` (created, 0600, with `create`), its schema in place."""
    if not create and not path.exists():
        raise FileNotFoundError(f"no index at {path}")
    if create and not path.exists():
        # 0600 from the start: the index names every conversation's keys.
        with contextlib.suppress(FileExistsError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    # Autocommit: every write is its own explicit transaction (IndexDB._write).
    conn = sqlite3.connect(path, timeout=30.0, isolation_level=None)
    try:
        _prepare(conn)
    except BaseException:
        conn.close()  # a file that is not a database: no connection left open on it
        raise
    return conn


def _prepare(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA journal_mode=WAL")
    # NORMAL (WAL): no fsync per transaction, so a save's bookkeeping is not three fsyncs.
    # A killed process loses nothing (the WAL is in the OS's cache); a power cut may roll
    # back the last transactions, never corrupt. What that can leave is safe: files a lost
    # row committed are swept at the next start; a row whose deletion was lost names files
    # that are gone, and the start-up scan drops it (a restore's file check would too).
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("PRAGMA busy_timeout=30000")
    # The schema is there once the meta row is (written last, in the script's transaction):
    # then opening reads one row instead of taking the write lock for the CREATE ... IF NOT
    # EXISTS script, which would queue `kvproxy ls` behind a proxy's write.
    version = _schema_version(conn)
    if version is None:
        # executescript commits on its own; every statement is IF NOT EXISTS / OR IGNORE.
        conn.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}COMMIT;")
    elif version in MIGRATIONS:
        _migrate(conn)


def _migrate(conn: sqlite3.Connection) -> None:
    """Bring an index of an older layout up to date, a step per transaction; another process
    (a proxy, `kvproxy ls`) that opens it at the same time waits, then finds it done."""
    while True:
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = _schema_version(conn)
            step = MIGRATIONS.get(version or "")
            if step is not None:
                conn.execute(step)
                conn.execute(
                    "UPDATE meta SET value = ? WHERE name = 'schema'", (str(int(str(version)) + 1),)
                )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        if step is None:
            return


def _schema_version(conn: sqlite3.Connection) -> str | None:
    try:
        row = conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()
    except sqlite3.OperationalError:  # no meta table: a new database
        return None
    return None if row is None else str(row[0])


def pkey(key: str) -> int:
    """A chain key as the signed 64-bit integer the prefix table stores: its first 8 bytes.
    A collision is caught by comparing the found entry's chain (`kvproxy.store.lookup`)."""
    return int.from_bytes(bytes.fromhex(key[:16]), "big", signed=True)


def pack_chain(chain: list[str]) -> bytes:
    return bytes.fromhex("".join(chain))


def unpack_chain(blob: bytes) -> list[str]:
    h = blob.hex()
    step = KEY_BYTES * 2
    return [h[i : i + step] for i in range(0, len(h), step)]


def sidecars(raw: str) -> tuple[str, ...]:
    return tuple(str(s) for s in orjson.loads(raw))


def entry_of(r: tuple[Any, ...]) -> Entry:
    """The `Entry` of a row selected as `COLUMNS`."""
    return Entry(
        row_id=int(r[0]),
        sidecars=sidecars(r[11]),
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
        model=r[13],
        kind=r[14],
    )
