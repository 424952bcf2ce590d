"""New sessions of an agent start warm on a real llama-server (Gemma 3 270M, SWA, n_swa 512,
--swa-full): a restored multi-turn state serves a new session sharing only its system prompt
with nothing, so kvproxy restores the opening entry (cache/prefixes/openings.py) instead."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import RealServer, start_proxy, start_real_server
from .test_real_cache import chat, next_turn, own_server

pytestmark = pytest.mark.real
__all__ = ["own_server"]

SYSTEM = "You are a careful assistant for a warehouse team. " + " ".join(
    f"Rule {i}: shelf {i % 17} holds item {i * 7 % 101}, checked every {i % 5 + 1} days."
    for i in range(110)
)


def session(question: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def system_tokens(server: RealServer) -> int:
    body = {"content": SYSTEM, "add_special": False}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/tokenize", json=body) as r:
        return len((await r.json())["tokens"])


async def test_a_new_session_restores_the_opening(
    own_server: tuple[Path, list[RealServer]],
) -> None:
    cache, servers = own_server
    servers.append(start_real_server(cache))
    n_system = await system_tokens(servers[0])
    assert 1800 <= n_system <= 2600, n_system
    proxy = await start_proxy(servers[0].url, cache, min_tokens=256)
    try:
        t0 = time.perf_counter()
        a1, h = await chat(proxy.url, session("Which shelf holds item 14?"))
        first_s = time.perf_counter() - t0
        assert h["X-KVProxy-Cache"] == "miss"
        a = next_turn(session("Which shelf holds item 14?"), a1, "And item 21?")
        a2, h = await chat(proxy.url, a)
        assert h["X-KVProxy-Cache"] == "resident"
        for other in ("inventory", "payroll"):  # another conversation takes both slots
            await chat(proxy.url, session("Hello?", f"You help with {other}. " * 40))
        # A new session: the same system prompt, another first question.
        b, h = await chat(proxy.url, session("How often is shelf 3 checked?"))
        cached = b["timings"]["cache_n"]
        print(
            f"\nsystem prompt {n_system} tokens; A's first turn {first_s:.2f} s "
            f"({a1['timings']['prompt_n']} prefilled); new session B: {h['X-KVProxy-Cache']}, "
            f"{cached} from cache, {b['timings']['prompt_n']} prefilled, restore "
            f"{h.get('X-KVProxy-Restore-Ms')} ms"
        )
        assert h["X-KVProxy-Cache"] == "restored", h
        assert cached >= 0.95 * n_system
        openings = [e for e in proxy.cache.store.entries.values() if len(e.chain) == 1]
        assert len(openings) == 1
    finally:
        await proxy.stop()

    # A fresh proxy and server: the opening comes from disk.
    servers[0].stop()
    servers.append(start_real_server(cache))
    proxy = await start_proxy(servers[1].url, cache, min_tokens=256)
    try:
        c, h = await chat(proxy.url, session("Which items are on shelf 5?"))
        cached = c["timings"]["cache_n"]
        print(f"after a restart, new session C: {h['X-KVProxy-Cache']}, {cached} from cache")
        assert h["X-KVProxy-Cache"] == "restored", h
        assert cached >= 0.95 * n_system
    finally:
        await proxy.stop()
