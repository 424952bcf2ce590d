"""Background saves against a real llama-server (Gemma 3 270M, -np 2, --cache-ram 0,
--swa-full): once three conversations share two slots, the idle slots are saved before any
request needs them, so a returning conversation's turn 2 evicts one already on disk and does
no save on its own path."""

from __future__ import annotations

import asyncio

import pytest
from kvproxy_bench.dialogues import first_turn

from .conftest import RealServer, RunningProxy, committed, start_proxy
from .test_real_cache import chat, next_turn

pytestmark = pytest.mark.real


async def background_saves_done(proxy: RunningProxy, expected: int) -> None:
    for _ in range(600):
        stats = proxy.stats()
        if stats["background_saves"] >= expected and all(s["saved"] for s in stats["slots"]):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"background saves never came: {proxy.stats()}")


async def test_turn_two_after_pressure_does_no_save_on_its_path(real_server: RealServer) -> None:
    cache = real_server.cache_dir
    proxy = await start_proxy(real_server.url, cache, min_tokens=256)
    try:
        convs = {c: first_turn(c + 40, n_facts=20) for c in (1, 2, 3)}
        turn1 = {c: (await chat(proxy.url, convs[c]))[0] for c in (1, 2, 3)}
        # Conversation 1 was saved on 3's path (the pressure began with 3); 2 and 3 were
        # then saved in the background.
        await background_saves_done(proxy, 2)
        stats = proxy.stats()
        on_path = stats["saves"] - stats["background_saves"]
        assert on_path == 1
        held = {s["id"]: s["key"] for s in stats["slots"]}
        # Both slots' conversations are committed on disk before turn 2 comes.
        assert set(held.values()) <= committed(cache)

        reply, headers = await chat(proxy.url, next_turn(convs[1], turn1[1], "And fact 5?"))
        assert headers["X-KVProxy-Cache"] == "restored", headers
        restored = int(headers["X-KVProxy-Restored-Tokens"])
        assert reply["timings"]["cache_n"] >= restored - 8
        after = proxy.stats()
        # The request evicted a conversation already on disk: no save on its path.
        assert after["saves"] - after["background_saves"] == on_path
        evicted = next(key for i, key in held.items() if after["slots"][i]["key"] != key)
        assert evicted in committed(cache)
    finally:
        await proxy.stop()
