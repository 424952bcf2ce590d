"""A large cache dir opening (or importing) does not keep the proxy from answering: the port
binds at once, `/health` answers and requests are served uncached until the index is open."""

from __future__ import annotations

import threading
from pathlib import Path

import aiohttp
import pytest

from kvproxy.store import Store

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


async def test_health_and_uncached_answers_while_the_cache_dir_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
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
                assert r.status == 200
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/kvproxy/stats") as r:
                state = await r.json()
                assert state["cache_open"] is False and state["enabled"] is False
            status, body, h = await chat(proxy, conv(1))
            assert status == 200 and body["choices"][0]["message"]["content"].startswith("Echo")
            assert h["X-KVProxy-Cache"] == "bypass"  # passed through: caching is not on yet
            assert fake.actions == []  # no slot work before the cache dir is open

            release.set()
            await proxy.cache.started()
            _, r1, h1 = await chat(proxy, conv(2))
            _, _, h2 = await chat(proxy, then(conv(2), r1))
            assert h1["X-KVProxy-Cache"] == "miss" and h2["X-KVProxy-Cache"] == "resident"
            await settle(proxy)
        finally:
            release.set()
            await proxy.stop()
