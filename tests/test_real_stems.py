"""A date change inside a long system prompt costs only its tail on a real llama-server
(Gemma 3 270M, a sliding-window model, --swa-full): the new day's first session restores the
stem (the prompt's head before the date line) and extends it, where without it nothing stored
could serve it (its system message matches none, and a restored SWA state serves only what
extends it or parts near its end)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from .conftest import RealServer, start_proxy, start_real_server
from .test_real_cache import chat, own_server

pytestmark = pytest.mark.real
__all__ = ["own_server"]

HEAD = "You are a careful assistant for a warehouse team.\n" + "".join(
    f"Rule {i}: shelf {i % 17} holds item {i * 7 % 101}, checked every {i % 5 + 1} days.\n"
    for i in range(90)
)
TAIL = "".join(f"Note {i}: restock shelf {i % 13} before noon.\n" for i in range(40))


def session(day: str, question: str) -> list[dict[str, Any]]:
    system = f"{HEAD}Current date: 2026-12-{day}\n{TAIL}"
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def head_tokens(server: RealServer) -> int:
    body = {"content": HEAD, "add_special": False}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/tokenize", json=body) as r:
        return len((await r.json())["tokens"])


async def test_the_first_session_after_a_date_change_reuses_the_unchanged_head(
    own_server: tuple[Path, list[RealServer]],
) -> None:
    cache, servers = own_server
    servers.append(start_real_server(cache))
    n_head = await head_tokens(servers[0])
    assert n_head >= 1500, n_head
    proxy = await start_proxy(servers[0].url, cache, min_tokens=256)
    try:
        _, h = await chat(proxy.url, session("01", "Which shelf holds item 14?"))
        assert h["X-KVProxy-Cache"] == "miss"
        for other in ("inventory", "payroll"):  # other conversations take both slots
            await chat(proxy.url, [{"role": "user", "content": f"You help with {other}. " * 40}])
        b, h = await chat(proxy.url, session("02", "How often is shelf 3 checked?"))
        # What came from disk, not what kvproxy evaluated on the way (the new opening).
        evaluated = int(h.get("X-KVProxy-Evaluated-Tokens", 0))
        cached = b["timings"]["cache_n"] - evaluated
        print(
            f"\nhead {n_head} tokens; after the date change: {h['X-KVProxy-Cache']}, "
            f"{h.get('X-KVProxy-Restored-Tokens')} restored, {cached} reused from it, "
            f"{evaluated} evaluated on the way, {b['timings']['prompt_n']} prefilled"
        )
        assert h["X-KVProxy-Cache"] == "restored", h
        assert int(h["X-KVProxy-Restored-Tokens"]) >= 0.9 * n_head
        assert cached >= 0.9 * n_head
    finally:
        await proxy.stop()
