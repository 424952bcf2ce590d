"""Faults injected: full disks, a proxy killed mid-operation, many clients on few slots."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvproxy.server.managed import free_port
from kvproxy.store import IndexDB

from .conftest import NOT_ENTRIES, Maker, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


def rows(cache: Path) -> set[str]:
    """The keys the index commits (what another process reading the database sees)."""
    db = IndexDB(cache)
    try:
        return set(db.all_files())
    finally:
        db.close()


def files(cache: Path) -> list[str]:
    """The cache dir's files but the index's own."""
    return sorted(p.name for p in cache.iterdir() if not p.name.startswith(NOT_ENTRIES))


async def test_full_disk_commits_nothing_and_keeps_serving(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    fake, proxy = await make(server={"fail_saves": True})
    caplog.set_level(logging.WARNING, logger="kvproxy.cache")
    for c in range(1, 6):  # every request past the second evicts an unsaved conversation
        status, body, _ = await chat(proxy, conv(c))
        assert status == 200 and body["choices"][0]["message"]["content"].startswith("Echo:")
    await settle(proxy)
    assert proxy.stats()["save_failures"] >= 3
    assert files(fake.save_dir) == []  # partial files removed ...
    assert rows(fake.save_dir) == set()  # ... nothing committed
    said = [r.getMessage() for r in caplog.records if "saving slots" in r.getMessage()]
    assert len(said) == 1 and "Unable to save slot" in said[0], said  # logged once
    assert await faults_on_health(proxy) == "saving slots"  # as troubleshooting.md says
    assert "saving slots" in proxy.stats()["faults"]
    fake.fail_saves = False  # space comes back: saving resumes
    await chat(proxy, conv(6))
    await settle(proxy)
    # The conversation 6 evicted, on its path, and 6 itself in the background (its slot went
    # idle under pressure); 5's save had failed, so only a request's eviction retries it.
    assert len(rows(fake.save_dir)) == 2
    assert await faults_on_health(proxy) is None
    said = [r.getMessage() for r in caplog.records if "saving slots" in r.getMessage()]
    assert len(said) == 2 and "recovered" in said[1], said


async def faults_on_health(proxy: Any) -> str | None:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as resp:
        assert resp.status == 200
        return resp.headers.get("X-KVProxy-Faults")


async def spawn_proxy(upstream: str, cache: Path, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvproxy.cli",
            "serve",
            "--upstream",
            upstream,
            "--cache-dir",
            str(cache),
            "--port",
            str(port),
            "--min-tokens",
            "0",
            "--idle-save-after",
            "3600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                # /health answers while the cache dir opens; caching is on once stats say so.
                async with s.get(f"http://127.0.0.1:{port}/kvproxy/stats") as r:
                    if r.status == 200 and (await r.json()).get("enabled"):
                        return proc
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError("proxy did not start")


class Remote:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("phase", ["save", "restore", "stream"])
async def test_proxy_killed_mid_operation(tmp_path: Path, phase: str) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fake = FakeLlamaServer(slot_save_path=cache, token_delay=0.01)
    await fake.start()
    port = free_port()
    proc = await spawn_proxy(fake.url, cache, port)
    remote = Remote(port)
    try:
        replies = {}
        for c in (1, 2):
            _, replies[c], _ = await chat(remote, conv(c))
        if phase == "restore":
            # Conversation 1 is saved on 3's path; 2 and 3 in the background (3 live
            # conversations, 2 slots): all three committed before the restore starts.
            await chat(remote, conv(3))
            for _ in range(100):
                if len(rows(cache)) == 3:
                    break
                await asyncio.sleep(0.02)
            assert len(rows(cache)) == 3
        fake.action_delay = 5.0 if phase != "stream" else 0.0
        victim = {
            "save": conv(3),  # evicts conversation 1: a save starts
            "restore": then(conv(1), replies[1]),  # conversation 1 comes back: a restore starts
            "stream": conv(4),
        }[phase]
        task = asyncio.create_task(chat(remote, victim, stream=phase == "stream"))
        for _ in range(200):
            await asyncio.sleep(0.02)
            if phase == "save" and list(cache.glob("*.tmp")):
                break
            if phase == "restore" and any(
                p.startswith("/slots") and "restore" in p for _, p, _ in fake.requests
            ):
                break
            if phase == "stream" and any(s.is_processing for s in fake.slots):
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        with pytest.raises(aiohttp.ClientError):
            await task
        fake.action_delay = 0.0
        if phase == "save":
            assert list(cache.glob("*.tmp")) and rows(cache) == set()

        again = await start_proxy(fake.url, cache)
        try:
            names = files(cache)
            assert not [n for n in names if ".tmp" in n]
            keys = {n.split(".")[0] for n in names}
            assert keys == set(again.cache.store.entries)  # the index matches the files
            assert all((cache / f"{k}.kv").exists() for k in keys)
            for c in (1, 2):
                status, body, _ = await chat(again, then(conv(c), replies[c]))
                assert (
                    status == 200
                    and body["choices"][0]["message"]["content"] == "Echo: next question"
                )
            if phase == "restore":
                assert again.stats()["restores"] >= 1
        finally:
            await again.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
        await fake.stop()


@pytest.mark.parametrize(("max_queue", "expect_503"), [(64, False), (6, True)])
async def test_many_clients_on_two_slots(make: Maker, max_queue: int, expect_503: bool) -> None:
    fake, proxy = await make(server={"token_delay": 0.002}, max_queue=max_queue)
    results = await asyncio.wait_for(
        asyncio.gather(*(chat(proxy, conv(c, 50)) for c in range(32))), 60
    )
    statuses = [s for s, _, _ in results]
    assert set(statuses) <= {200, 503}
    if expect_503:
        assert 503 in statuses
        assert all("Retry-After" in h for s, _, h in results if s == 503)
        assert statuses.count(200) >= 2 + max_queue
    else:
        assert statuses == [200] * 32
    for s, body, _ in results:
        if s == 200:
            assert body["choices"][0]["message"]["content"].startswith("Echo: first question")
    assert fake.deferred_actions == 0
    assert fake.deferred_tasks == 0  # every completion was pinned to a slot the proxy held
    await settle(proxy)
    assert proxy.cache.pool.waiting == 0 and not any(s.busy for s in proxy.cache.pool.slots)


async def test_an_index_the_full_disk_refuses_never_fails_a_request(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's save fits, then the disk fills before kvproxy writes the index (or
    drops or evicts an entry): SQLite says 'database or disk is full' on the request's own
    path. The request is still answered, nothing half-committed is ever restored, and
    caching resumes once the disk has room."""
    full = False
    writes = {name: getattr(IndexDB, name) for name in ("insert", "delete", "evict")}

    def refusing(name: str) -> Any:
        def write(self: IndexDB, *args: Any, **kwargs: Any) -> Any:
            if full:
                raise sqlite3.OperationalError("database or disk is full")
            return writes[name](self, *args, **kwargs)

        return write

    for name in writes:
        monkeypatch.setattr(IndexDB, name, refusing(name))
    fake, proxy = await make()
    replies = {}
    for c in (1, 2):
        _, replies[c], _ = await chat(proxy, conv(c))
    await settle(proxy)
    full = True
    for turn in range(3):  # every request evicts a conversation: a save on its own path
        for c in (1, 2, 3, 4):
            messages = then(conv(c), replies[c], f"q{turn}") if c in replies else conv(c)
            status, replies[c], h = await chat(proxy, messages)
            assert status == 200, replies[c]
    await settle(proxy)
    full = False
    for c in (1, 2, 3, 4):
        status, replies[c], _ = await chat(proxy, then(conv(c), replies[c], "again"))
        assert status == 200
    await settle(proxy)
    status, _, h = await chat(proxy, then(conv(1), replies[1], "last"))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"


async def test_a_full_disk_in_the_commit_leaves_no_file_and_keeps_serving(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's write fits, then the disk fills while kvproxy commits it (the state is
    renamed under its key, the conversation's text does not fit): no file of that key stays
    (none is indexed), every request is answered, and saving resumes once there is room."""
    from kvproxy.store.files import StoreFiles

    full = True
    write = StoreFiles._write_messages

    def refusing(self: StoreFiles, key: str, messages: list[Any]) -> int:
        if full:
            raise OSError(28, "No space left on device")
        return write(self, key, messages)

    monkeypatch.setattr(StoreFiles, "_write_messages", refusing)
    fake, proxy = await make(server={"n_slots": 1}, live_window=0)
    replies = {}
    for c in (1, 2, 3):
        status, replies[c], _ = await chat(proxy, conv(c))
        assert status == 200 and replies[c]["choices"][0]["message"]["content"].startswith("Echo")
    await settle(proxy)
    assert len([a for a in fake.actions if a[0] == "save"]) == 2  # 1 and 2 were written ...
    assert files(fake.save_dir) == [] and rows(fake.save_dir) == set()  # ... none kept
    full = False
    turn2 = then(conv(3), replies[3])
    status, reply2, _ = await chat(proxy, turn2)
    await chat(proxy, conv(4))  # 3 is saved on its path now, and kept
    await settle(proxy)
    status, _, h = await chat(proxy, then(turn2, reply2, "again"))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
