"""A llama-server started with --sleep-idle-seconds unloads its model when idle: kvproxy
watches it without waking it (GET /props shows `is_sleeping` and does not wake it; GET
/slots, slot actions and completions do), and forgets what the slots held once it sleeps."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvproxy.cache.servers import backend
from kvproxy.lanes import cache as lanecache

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


@pytest.fixture
def quick_housekeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lanecache, "HOUSEKEEPING_INTERVAL", 0.05)
    monkeypatch.setattr(backend, "PROPS_CHECK_INTERVAL", 0.1)


async def wait_until(condition, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition never held")


@pytest.mark.usefixtures("quick_housekeeping")
async def test_a_sleeping_server_is_watched_without_waking_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache, sleep_idle_seconds=0.3) as fake:
        proxy = await start_proxy(fake.url, cache)
        try:
            _, r1, h1 = await chat(proxy, conv(1))
            assert h1["X-KVProxy-Cache"] == "miss"
            await settle(proxy)
            await wait_until(lambda: fake.is_sleeping)
            asleep_at = len(fake.requests)
            await asyncio.sleep(1.0)  # ten props checks
            later = fake.requests[asleep_at:]
            assert [r[1] for r in later if r[1] == "/props"], "kvproxy stopped watching"
            assert {r[1] for r in later} == {"/props"}  # no GET /slots, nothing that wakes it
            assert fake.wakes == 0 and fake.is_sleeping
            assert proxy.cache.backend.sleeping
            # The server emptied its slots: kvproxy no longer counts on what they held.
            assert all(s.holding is None for s in proxy.cache.pool.slots)

            status, _, h2 = await chat(proxy, then(conv(1), r1))  # a client wakes it
            assert status == 200 and fake.wakes == 1
            assert h2["X-KVProxy-Cache"] != "resident"
            await settle(proxy)
        finally:
            await proxy.stop()


@pytest.mark.usefixtures("quick_housekeeping")
async def test_an_idle_save_does_not_wake_a_sleeping_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server fell asleep before kvproxy's props check noticed: the idle save asks /props
    first, and leaves the server asleep (its slot is empty now: nothing to save)."""
    monkeypatch.setattr(backend, "PROPS_CHECK_INTERVAL", 3600.0)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache, sleep_idle_seconds=0.2) as fake:
        proxy = await start_proxy(fake.url, cache, idle_save_after=0.6)
        try:
            await chat(proxy, conv(1))
            await settle(proxy)
            await wait_until(lambda: fake.is_sleeping)
            await asyncio.sleep(1.0)  # the idle save is due
            assert fake.wakes == 0 and not [a for a in fake.actions if a[0] == "save"]
            assert all(s.holding is None for s in proxy.cache.pool.slots)
        finally:
            await proxy.stop()


@pytest.mark.usefixtures("quick_housekeeping")
async def test_slots_are_saved_before_the_server_sleeps(tmp_path: Path) -> None:
    """Told the server's --sleep-idle-seconds, kvproxy saves an idle slot within half of it
    (the idle save is otherwise 30 s away): the turn after the server slept and woke empty is
    restored from disk, not prefilled again."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache, sleep_idle_seconds=1.0) as fake:
        proxy = await start_proxy(fake.url, cache, server_sleep_after=1.0, idle_save_after=3600)
        try:
            _, r1, _ = await chat(proxy, conv(1))
            await settle(proxy)
            await wait_until(lambda: fake.is_sleeping)
            assert proxy.cache.store.entries, "saved before the server slept"
            status, r2, h2 = await chat(proxy, then(conv(1), r1))
            assert status == 200 and fake.wakes == 1
            assert h2["X-KVProxy-Cache"] == "restored"
            assert r2["timings"]["cache_n"] > 0.9 * (
                r2["timings"]["cache_n"] + r2["timings"]["prompt_n"]
            )
        finally:
            await proxy.stop()


def test_managed_mode_reads_the_servers_sleep_timeout() -> None:
    from kvproxy.server.launch import sleep_idle_seconds

    assert sleep_idle_seconds(["-t", "2", "--sleep-idle-seconds", "300"]) == 300.0
    assert sleep_idle_seconds(["--sleep-idle-seconds=60"]) == 60.0
    assert sleep_idle_seconds(["--sleep-idle-seconds", "-1"]) is None
    assert sleep_idle_seconds(["-t", "2"]) is None
