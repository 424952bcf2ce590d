"""The store's index while worker threads do its I/O.

Threads used to change the in-memory index while the event loop iterated it (`total_bytes`
for /metrics and /kvproxy/stats, `select_victims` after each save): "dictionary changed size
during iteration", a 500. The index is now a database on its own thread, and the loop keeps
only a summary it replaces whole. The first test scrapes while a commit's files are being
written; the second is the load that found the race: saves that evict, `kvproxy rm` removals
in another connection and tight scrapes at once, against the fake llama-server.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvproxy import keys
from kvproxy.cache.servers import backend as backendmod
from kvproxy.edge.app import SERVICE
from kvproxy.lanes import cache as cachemod
from kvproxy.store import Entry, Store, fileops

from .conftest import NOT_ENTRIES, Maker, RunningProxy, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then
from .test_store import state_bytes


def indexed_on_disk(root: Path) -> set[str]:
    """Keys whose state file is in the cache dir."""
    return {p.name[:-3] for p in root.iterdir() if p.suffix == ".kv"}


# --- a scrape during a commit


async def test_a_scrape_during_a_commit_answers_and_the_index_follows(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, proxy = await make(write_through=True)
    await chat(proxy, conv(1))
    await settle(proxy)
    store = proxy.cache.store
    assert len(store.entries) == 1

    in_commit = threading.Event()
    fsync = fileops.fsync_file

    def slow_fsync(path: Path) -> None:  # runs in the commit's thread
        in_commit.set()
        time.sleep(0.1)
        fsync(path)

    monkeypatch.setattr(fileops, "fsync_file", slow_fsync)
    talking = asyncio.ensure_future(chat(proxy, conv(2)))  # its reply is saved: a commit
    while not in_commit.is_set():
        await asyncio.sleep(0.002)
    service = proxy.app[SERVICE]
    assert b"kvproxy_cache_entries 1.0" in service.metrics.exposition()  # mid-commit

    status, _, _ = await talking
    await settle(proxy)
    assert status == 200
    assert len(store.entries) == 2 and set(store.entries) == indexed_on_disk(store.root)
    assert b"kvproxy_cache_entries 2.0" in service.metrics.exposition()


# --- the load that found it

PRELOADED = 2000  # entries of another namespace already in the cache dir
REMOVED = 200  # of those, deleted behind the proxy's back as `kvproxy rm` does
WORKERS = 4
TURNS = 9  # per worker
SCRAPED = ("/metrics", "/kvproxy/stats", "/metrics")
OTHER_NS = keys.namespace("another-model.gguf", {}, None)


def preloaded_key(i: int) -> str:
    return f"{i:032x}"


def preload(root: Path, n: int) -> int:
    """Write `n` entries as kvproxy before the SQLite index did (`.kv` and `.idx`): the proxy
    imports them when it opens the dir. Their total size."""
    # Used "in the future": LRU eviction takes the proxy's own saves first, so the index
    # stays big (and each iteration over it long) for the whole run.
    later = time.time() + 86400
    data = state_bytes(1, 64)
    for i in range(n):
        key = preloaded_key(i)
        (root / f"{key}.kv").write_bytes(data)
        record = Entry(key, OTHER_NS, 1, len(data), 1, later, later, chain=[key])
        (root / f"{key}.idx").write_bytes(record.to_json())
    return n * len(data)


def remove_like_rm(root: Path, n: int) -> None:
    """What `kvproxy rm` does, in a connection of its own (another process's); a thread."""
    cli = Store(root, 0, 0)
    cli.open_readonly()
    for i in range(n):
        assert cli.remove(preloaded_key(i)) is not None
        time.sleep(0.002)
    cli.close()


@pytest.fixture
def cache_root(tmp_path: Path) -> Iterator[Path]:
    """A fresh cache dir, in memory where there is a tmpfs: thousands of files are written."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else tmp_path
    with tempfile.TemporaryDirectory(prefix="kvproxy-race-", dir=base) as tmp:
        root = Path(tmp) / "cache"
        root.mkdir(mode=0o700)
        yield root


@pytest.fixture
def thread_switches_often() -> Iterator[None]:
    """Threads cut in on the loop every 10 µs instead of every 5 ms."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


async def scrape_until(proxy: RunningProxy, path: str, done: asyncio.Event) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as s:
        while not done.is_set():
            async with s.get(proxy.url + path) as r:
                await r.read()
                statuses.append(r.status)
    return statuses


async def converse(proxy: RunningProxy, worker: int) -> list[int]:
    """Three conversations in turn, each a turn longer every time: with more conversations
    than slots, nearly every turn saves the slot's previous one, and that save evicts."""
    convs = {
        c: [{"role": "user", "content": f"worker {worker} conversation {c}. " + "pad " * 60}]
        for c in range(3)
    }
    statuses = []
    for turn in range(TURNS):
        c = turn % 3
        status, body, _ = await chat(proxy, convs[c])
        statuses.append(status)
        if status == 200:
            convs[c] = then(convs[c], body, f"question {turn}")
    return statuses


async def test_index_survives_saves_evictions_removals_and_scrapes(
    cache_root: Path, monkeypatch: pytest.MonkeyPatch, thread_switches_often: None
) -> None:
    # Housekeeping (eviction, noticing removed entries) as often as it can run.
    monkeypatch.setattr(cachemod, "HOUSEKEEPING_INTERVAL", 0.01)
    monkeypatch.setattr(backendmod, "PROPS_CHECK_INTERVAL", 0.01)
    preloaded = preload(cache_root, PRELOADED)
    async with FakeLlamaServer(slot_save_path=cache_root, n_ctx=16384) as fake:
        # Room for the preloaded entries and about one save: nearly every save evicts.
        proxy = await start_proxy(
            fake.url, cache_root, max_disk=preloaded + 12_000, ttl=0, write_through=True
        )
        try:
            await load_and_check(proxy, cache_root)
        finally:
            await proxy.stop()


async def load_and_check(proxy: RunningProxy, root: Path) -> None:
    store = proxy.cache.store
    assert len(store.entries) == PRELOADED
    done = asyncio.Event()
    scrapers = [asyncio.ensure_future(scrape_until(proxy, path, done)) for path in SCRAPED]
    removing = asyncio.ensure_future(asyncio.to_thread(remove_like_rm, root, REMOVED))
    chats = await asyncio.gather(*(converse(proxy, w) for w in range(WORKERS)))
    await removing
    await settle(proxy)
    done.set()
    scrapes = await asyncio.gather(*scrapers)

    assert [s for statuses in chats for s in statuses] == [200] * (WORKERS * TURNS)
    failed = [
        (path, [s for s in statuses if s != 200])
        for path, statuses in zip(SCRAPED, scrapes, strict=True)
    ]
    assert all(scrapes) and not any(bad for _, bad in failed), failed
    assert proxy.stats()["saves"] >= WORKERS * TURNS // 2
    assert proxy.stats()["evictions"] >= proxy.stats()["saves"] // 2

    await proxy.cache.notice_removals()  # what housekeeping does every second
    names = [p.name for p in root.iterdir() if not p.name.startswith(NOT_ENTRIES)]
    assert set(store.entries) == indexed_on_disk(root)
    assert not set(store.entries) & {preloaded_key(i) for i in range(REMOVED)}
    assert not [n for n in names if n.endswith(".idx")]  # imported, then dropped
    on_disk = sum((root / n).stat().st_size for n in names)
    assert store.total_bytes == on_disk
