"""A corrupt or unusable index.sqlite3 at start-up is moved aside and an empty index started:
caching resumes at once, without a restart, and the bad file is kept for a look. (It is not
rebuilt from the state files: a state file's row holds its tenant's namespace and key chain,
which the file alone does not; serving it to anyone would risk a cross-tenant read.) A cache
dir that cannot be opened at all (a full disk) is tried again until it opens."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from kvproxy.lanes import cache as lanecache
from kvproxy.store import IndexDB, Store
from kvproxy.store.schema import DB_NAME

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then

GARBAGE = b"this is not an SQLite database, just bytes a broken disk left " * 64


def corrupt_pages(cache: Path) -> bytes:
    """A real index whose pages after the header are overwritten: SQLite says 'malformed'."""
    store = Store(cache, 3600.0, 0)
    store.open()
    store.close()
    db = sqlite3.connect(cache / DB_NAME)
    db.execute("PRAGMA journal_mode=DELETE")
    db.execute("CREATE TABLE pad (x)")
    db.executemany("INSERT INTO pad VALUES (?)", [("p" * 500,)] * 200)
    db.commit()
    db.close()
    raw = bytearray((cache / DB_NAME).read_bytes())
    raw[4096:] = b"\xa5" * (len(raw) - 4096)
    (cache / DB_NAME).write_bytes(bytes(raw))
    return bytes(raw)


@pytest.mark.parametrize("damage", ["garbage", "pages"])
async def test_a_corrupt_index_is_moved_aside_and_caching_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    if damage == "garbage":
        (cache / DB_NAME).write_bytes(GARBAGE)
        bad = GARBAGE
    else:
        bad = corrupt_pages(cache)
    caplog.set_level(logging.INFO, logger="kvproxy")
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    proxy = await start_proxy(fake.url, cache)
    try:
        assert proxy.stats()["cache_open"] is True
        aside = [p for p in cache.glob(f"{DB_NAME}.corrupt-*") if not p.name.endswith("-shm")]
        # Kept as it was (past the header, where SQLite may have set the WAL mode bytes).
        assert len(aside) == 1 and aside[0].read_bytes()[100:] == bad[100:]
        warned = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
        assert len(warned) == 1
        # Caching works on the fresh index: evicted, saved, restored.
        replies = {}
        for c in (1, 2, 3):
            _, replies[c], _ = await chat(proxy, conv(c))
        await settle(proxy)
        status, _, h = await chat(proxy, then(conv(1), replies[1]))
        assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    finally:
        await proxy.stop()
        await fake.stop()


def test_a_busy_or_read_only_index_is_never_moved(tmp_path: Path) -> None:
    """Only SQLite's word for a bad file moves it: other errors are not corruption."""
    from kvproxy.store.startup import _corrupt

    assert not _corrupt(sqlite3.OperationalError("database is locked"))
    try:
        sqlite3.connect(tmp_path / "x").execute("PRAGMA journal_mode=WAL")
        (tmp_path / "y").write_bytes(GARBAGE)
        sqlite3.connect(tmp_path / "y").execute("PRAGMA journal_mode=WAL")
    except sqlite3.DatabaseError as exc:
        assert _corrupt(exc)
    else:
        raise AssertionError("garbage opened as a database")


async def test_a_cache_dir_that_cannot_open_at_start_up_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or a read-only dir) when kvproxy starts: requests pass through meanwhile,
    /health names the fault, and once the disk has room the cache opens and caching works,
    without a restart; the fault is logged when it starts and when it ends, nothing between."""
    full = True
    opened = Store.open_async

    async def open_async(self: Store) -> None:
        if full:
            raise sqlite3.OperationalError("database or disk is full")
        await opened(self)

    monkeypatch.setattr(Store, "open_async", open_async)
    monkeypatch.setattr(lanecache, "OPEN_RETRY_S", 0.05)
    monkeypatch.setattr(lanecache, "OPEN_RETRY_MAX_S", 0.1)
    caplog.set_level(logging.INFO, logger="kvproxy")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    proxy = await start_proxy(fake.url, cache)
    try:
        await asyncio.sleep(0.3)  # a few tries fail
        assert proxy.stats()["cache_open"] is False
        status, _, _ = await chat(proxy, conv(1))
        assert status == 200  # served, uncached
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as resp:
            assert resp.headers["X-KVProxy-Faults"] == lanecache.OPENING
        full = False
        async with asyncio.timeout(30):  # open, and the server found again
            while not (proxy.stats()["cache_open"] and proxy.stats()["enabled"]):
                await asyncio.sleep(0.05)
        replies = {}
        for c in (1, 2, 3):
            _, replies[c], _ = await chat(proxy, conv(c))
        await settle(proxy)
        status, _, h = await chat(proxy, then(conv(1), replies[1]))
        assert status == 200 and h["X-KVProxy-Cache"] == "restored"
        async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as resp:
            assert "X-KVProxy-Faults" not in resp.headers
        lines = [r.getMessage() for r in caplog.records if lanecache.OPENING in r.getMessage()]
        assert len(lines) == 2 and "disk is full" in lines[0] and "recovered" in lines[1], lines
    finally:
        await proxy.stop()
        await fake.stop()


async def test_a_full_disk_at_start_up_still_opens_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index's rows are read on a full disk; only the open's bookkeeping cannot be
    written. So the cache opens at once and slots are pinned and kept apart between tenants
    (an open that failed would let requests go unpinned, free to reuse another tenant's
    tokens in a slot)."""

    def set_meta(self: IndexDB, name: str, value: str) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    Store(cache, 3600.0, 0).open()  # an index exists (a new one would need writing)
    monkeypatch.setattr(IndexDB, "set_meta", set_meta)
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    proxy = await start_proxy(fake.url, cache)
    try:
        assert proxy.stats()["cache_open"] is True and proxy.stats()["enabled"] is True
        status, reply, h = await chat(proxy, conv(1))
        assert status == 200 and h["X-KVProxy-Cache"] == "miss"
        status, _, h = await chat(proxy, then(conv(1), reply))
        assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    finally:
        await proxy.stop()
        await fake.stop()
