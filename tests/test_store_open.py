"""A large cache dir opening (or importing): the port binds at once, `/health` answers 503
"Loading model" as a loading llama-server does, and requests wait until the index is open
(at most --queue-timeout), so none runs unpinned."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
import pytest

from kvproxy.store import Store

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


async def test_health_is_loading_and_requests_wait_while_the_cache_dir_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port binds at once and answers /health as a loading llama-server does (503), so
    a client waiting for 200 sends its first requests when kvproxy can pin and cache them;
    a request that comes anyway waits, and is never relayed unpinned."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    release = threading.Event()
    open_in = Store._open_in

    def slow_open(self: Store, db, sweep: bool):  # type: ignore[no-untyped-def]
        release.wait(30)  # an import of 100k .idx records, say
        return open_in(self, db, sweep)

    monkeypatch.setattr(Store, "_open_in", slow_open)
    async with FakeLlamaServer(slot_save_path=cache) as fake:
        proxy = await start_proxy(fake.url, cache, wait=False)
        try:
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as r:
                assert r.status == 503
                assert (await r.json())["error"] == {
                    "message": "Loading model",
                    "type": "unavailable_error",
                    "code": 503,
                }
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/kvproxy/stats") as r:
                state = await r.json()
                assert state["cache_open"] is False and state["enabled"] is False
            first = asyncio.create_task(chat(proxy, conv(1)))
            await asyncio.sleep(0.3)
            assert not first.done()
            assert not [r for r in fake.requests if r[1] == "/v1/chat/completions"]

            release.set()
            status, r1, h1 = await first
            assert status == 200 and h1["X-KVProxy-Cache"] == "miss"  # keyed and pinned
            _, _, h2 = await chat(proxy, then(conv(1), r1))
            assert h2["X-KVProxy-Cache"] == "resident"
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as r:
                assert r.status == 200
            await settle(proxy)
        finally:
            release.set()
            await proxy.stop()


async def test_a_request_waits_for_the_cache_dir_no_longer_than_for_a_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    release = threading.Event()
    open_in = Store._open_in

    def slow_open(self: Store, db, sweep: bool):  # type: ignore[no-untyped-def]
        release.wait(30)
        return open_in(self, db, sweep)

    monkeypatch.setattr(Store, "_open_in", slow_open)
    async with FakeLlamaServer(slot_save_path=cache) as fake:
        proxy = await start_proxy(fake.url, cache, wait=False, queue_timeout=0.2)
        try:
            status, body, _ = await chat(proxy, conv(1))
            assert status == 503 and body["error"]["type"] == "unavailable_error"
            assert not [r for r in fake.requests if r[1] == "/v1/chat/completions"]
        finally:
            release.set()
            await proxy.stop()
