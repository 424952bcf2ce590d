"""kvproxy started with (or before) its llama-server: until kvproxy has found the server, it
answers as a loading server does, and no slot-using request reaches the server unpinned
(its tokens would sit in a slot of no known occupant, which the cross-tenant guard erases
on the next keyed request: the server would have reused them, kvproxy would not)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer, clients
from .test_cache import chat, conv, settle, then


async def completion(url: str, prompt: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        body = {"prompt": prompt, "n_predict": 4}
        async with s.post(url + "/completion", json=body) as r:
            return r.status, await r.json()


async def test_requests_once_a_loading_server_is_up_are_pinned(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache) as fake:
        fake.loading = True
        proxy = await start_proxy(fake.url, cache)  # its first look found a loading server
        try:
            assert not proxy.cache.enabled
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as r:
                assert r.status == 503  # the server's own answer, relayed
            status, body = await completion(proxy.url, "too early")
            assert status == 503 and body["error"]["message"] == "Loading model"
            assert not [r for r in fake.requests if r[1] == "/completion"]

            fake.loading = False  # the model is in: the next requests find the server
            prompt = "System prompt " * 40
            status, first = await completion(proxy.url, prompt)
            assert status == 200
            sent = [r[2] for r in clients(fake.requests) if r[1] == "/completion"]
            assert len(sent) == 1 and "id_slot" in sent[0]  # pinned, not relayed blind
            _, r1, h1 = await chat(proxy, conv(1))
            _, r2, h2 = await chat(proxy, then(conv(1), r1))
            assert (h1["X-KVProxy-Cache"], h2["X-KVProxy-Cache"]) == ("miss", "resident")
            await settle(proxy)
        finally:
            await proxy.stop()


async def test_health_answers_only_once_the_server_was_looked_for(tmp_path: Path) -> None:
    """A /health 200 through kvproxy means kvproxy has found the server: a client that waits
    for it (llama.cpp's own test harness does) sends requests kvproxy pins."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache) as fake:
        fake.loading = True
        proxy = await start_proxy(fake.url, cache)
        try:
            fake.loading = False
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as r:
                assert r.status == 200
            assert proxy.cache.enabled  # the health check looked again, and found it
        finally:
            await proxy.stop()
