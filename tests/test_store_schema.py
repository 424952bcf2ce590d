"""A cache dir whose index was written before kvproxy recorded each entry's model (schema 1)
still opens: its entries are kept and restorable, `kvproxy ls` lists them (model unknown),
and new saves record their model."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import orjson
import pytest

from kvproxy import keys
from kvproxy.cli import main
from kvproxy.store import DB_NAME, Store
from kvproxy.store.entry import TURN

from .test_store import NS, save


def columns(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [row[1] for row in conn.execute("PRAGMA table_info(entries)")]
    finally:
        conn.close()


def schema_version(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("SELECT value FROM meta WHERE name = 'schema'").fetchone()[0])
    finally:
        conn.close()


def as_schema_1(root: Path) -> None:
    """Take the index back to the layout of schema 1: `entries` without its model column."""
    conn = sqlite3.connect(root / DB_NAME, isolation_level=None)
    try:
        conn.execute("ALTER TABLE entries DROP COLUMN kind")
        conn.execute("ALTER TABLE entries DROP COLUMN model")
        conn.execute("UPDATE meta SET value = '1' WHERE name = 'schema'")
    finally:
        conn.close()
    assert "model" not in columns(root / DB_NAME)


def test_an_index_without_models_opens_and_keeps_its_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "cache"
    store = Store(root, ttl=0, max_bytes=0)
    store.open()
    old = save(store, 3)
    store.close()
    as_schema_1(root)

    # `kvproxy ls` is the first to open it (as while a proxy of the old version runs).
    assert main(["ls", "--json", "--cache-dir", str(root)]) == 0
    listed = orjson.loads(capsys.readouterr().out)
    assert [(e["key"], e["model"]) for e in listed] == [(old.key, None)]
    assert "model" in columns(root / DB_NAME) and schema_version(root / DB_NAME) == "3"

    store = Store(root, ttl=0, max_bytes=0)
    store.open()
    assert set(store.entries) == {old.key} and store.entries[old.key].model == ""
    assert store.files.check_state_file(store.entries[old.key]) is None
    found = store.lookup(
        keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(4)]), NS
    )
    assert found is not None and found[0].key == old.key
    new = save(store, 5, model="coder")
    store.close()

    assert main(["ls", "--cache-dir", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "MODEL"
    shown = {line.split()[0]: line.split()[-1] for line in lines[1:3]}
    assert shown == {old.key[:12]: "-", new.key[:12]: "coder"}


def test_a_new_index_records_each_entrys_model(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache", ttl=0, max_bytes=0)
    store.open()
    entry = save(store, 2, model="org/chat:Q4")
    store.close()
    assert schema_version(tmp_path / "cache" / DB_NAME) == "3"
    again = Store(tmp_path / "cache", ttl=0, max_bytes=0)
    again.open()
    assert again.entries[entry.key].model == "org/chat:Q4"
    again.close()


def test_an_index_without_kinds_opens_and_keeps_its_entries_as_shared(tmp_path: Path) -> None:
    """Schema 2 (before entries were kinded): its entries are kept, of no kind, and a newer
    state never supersedes them (only the states kvproxy saved as a conversation's turns)."""
    root = tmp_path / "cache"
    store = Store(root, ttl=0, max_bytes=0)
    store.open()
    old = save(store, 3)
    store.close()
    conn = sqlite3.connect(root / DB_NAME, isolation_level=None)
    try:
        conn.execute("ALTER TABLE entries DROP COLUMN kind")
        conn.execute("UPDATE meta SET value = '2' WHERE name = 'schema'")
    finally:
        conn.close()
    store = Store(root, ttl=0, max_bytes=0)
    store.open()
    assert "kind" in columns(root / DB_NAME) and schema_version(root / DB_NAME) == "3"
    assert set(store.entries) == {old.key} and store.entries[old.key].kind == ""
    new = save(store, 5, kind=TURN)
    assert store.entries[new.key].kind == TURN
    store.close()
