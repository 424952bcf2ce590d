"""Two kvproxy on one cache dir: neither deletes the other's files in flight.

A kvproxy starting sweeps what no index row covers (temp files a killed process left, saves
nobody committed). Another kvproxy running on the same dir has such files in flight: a save
its server is writing under a temp name, a state renamed into place and not yet committed.
Each kvproxy holds a lock file of its own (store/owners.py), and its temp files carry its
token: the sweep takes only what a dead kvproxy left.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvproxy.store import Store
from kvproxy.store.files import TMP_MARK

from .conftest import committed, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle
from .test_store import save, state_bytes


async def test_a_second_proxy_starting_leaves_the_first_ones_save_in_flight(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    # The first proxy's server answers its saves a second after writing the file.
    first_server = FakeLlamaServer(slot_save_path=cache, action_delay=1.0)
    second_server = FakeLlamaServer(slot_save_path=cache)
    await first_server.start()
    await second_server.start()
    first = await start_proxy(first_server.url, cache)
    second = None
    try:
        for n in (1, 2):
            assert (await chat(first, conv(n)))[0] == 200
        await settle(first)
        # A third conversation: the slot holding the first is saved before it is given away.
        third = asyncio.create_task(chat(first, conv(3)))
        in_flight: list[str] = []
        for _ in range(500):
            in_flight = [p.name for p in cache.iterdir() if TMP_MARK in p.name]
            if in_flight:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("no save in flight")
        second = await start_proxy(second_server.url, cache)  # its start-up sweep ran
        assert (await third)[0] == 200
        await settle(first)
        saved = committed(cache)
        assert {name.split(".")[0] for name in in_flight} <= saved, "saves in flight committed"
        assert first.stats()["disk_enabled"] is True
        # The first goes on saving: every new conversation past the slots saves one.
        for n in range(4, 14):
            assert (await chat(first, conv(n)))[0] == 200
            await settle(first)
        assert len(committed(cache)) >= len(saved) + 10
    finally:
        for proxy in (first, second):
            if proxy is not None:
                await proxy.stop()
        await first_server.stop()
        await second_server.stop()


def test_the_sweep_takes_only_what_nobody_alive_will_finish(tmp_path: Path) -> None:
    running = Store(tmp_path, ttl=3600, max_bytes=0)
    running.open()
    kept = save(running, 2)
    in_flight = tmp_path / running.temp_name("cd" * 16)
    in_flight.write_bytes(state_bytes(5))  # its server writing a save
    renamed = tmp_path / f"{'ef' * 16}.kv"
    renamed.write_bytes(state_bytes(5))  # renamed into place, its row not yet written
    dead = Store(tmp_path, ttl=3600, max_bytes=0)
    dead.open()
    left_by_dead = tmp_path / dead.temp_name("ab" * 16)
    left_by_dead.write_bytes(b"half a save")
    dead.close()  # a kvproxy that ended (or was killed) leaves its temp file behind

    starting = Store(tmp_path, ttl=3600, max_bytes=0)
    starting.open()
    assert in_flight.exists() and renamed.exists(), "the running proxy's files stay"
    assert not left_by_dead.exists(), "a dead proxy's temp file goes"
    assert list(starting.entries) == [kept.key]
    starting.close()

    running.close()
    alone = Store(tmp_path, ttl=3600, max_bytes=0)
    alone.open()  # no other kvproxy alive: what no row covers is swept
    assert not in_flight.exists() and not renamed.exists()
    alone.close()


async def test_a_save_removed_before_its_commit_does_not_turn_the_disk_cache_off(
    tmp_path: Path,
) -> None:
    """A save whose file someone removed before kvproxy committed it (a user, a kvproxy of
    an older version sweeping the dir) is lost, and only it: the server still saves here."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    server = FakeLlamaServer(slot_save_path=cache, action_delay=1.0)
    await server.start()
    proxy = await start_proxy(server.url, cache)
    try:
        for n in (1, 2):
            assert (await chat(proxy, conv(n)))[0] == 200
        await settle(proxy)
        third = asyncio.create_task(chat(proxy, conv(3)))
        for _ in range(500):
            in_flight = [p for p in cache.iterdir() if TMP_MARK in p.name]
            if in_flight:
                break
            await asyncio.sleep(0.01)
        for path in in_flight:
            path.unlink()
        assert (await third)[0] == 200
        await settle(proxy)
        assert proxy.stats()["disk_enabled"] is True
        before = len(committed(cache))
        for n in range(4, 8):
            assert (await chat(proxy, conv(n)))[0] == 200
            await settle(proxy)
        assert len(committed(cache)) >= before + 4
    finally:
        await proxy.stop()
        await server.stop()
