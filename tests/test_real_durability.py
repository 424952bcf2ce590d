"""Saves on a real llama-server (small states): a request that vacates a slot waits for the
server's write, not the commit; a conversation keeps one state on disk (dense) or one back
(sliding window); a state bigger than the whole --max-disk is not saved."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvproxy_bench.dialogues import system_prompt

from kvproxy.store.files import TMP_MARK

from .conftest import committed, start_proxy, start_real_server
from .test_durability import held_commits  # noqa: F401 (a fixture)
from .test_metrics import parse, scrape, total

pytestmark = pytest.mark.real

REPLY = "Noted, fact kept."
GRAMMAR = f'root ::= "{REPLY}"'


def opening(n: int) -> list[dict[str, Any]]:
    # ~400 tokens: no presumed opening (too short), past nothing the test cares about.
    return [
        {"role": "system", "content": system_prompt(n, n_facts=18)},
        {"role": "user", "content": f"What is fact {n}?"},
    ]


async def chat(url: str, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """One turn: the conversation with the reply appended, and the cache's decision."""
    body = {"messages": messages, "temperature": 0, "max_tokens": 16, "grammar": GRAMMAR}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        reply = await r.json()
        decision = r.headers["X-KVProxy-Cache"]
    content = reply["choices"][0]["message"]["content"]
    return [*messages, {"role": "assistant", "content": content}], decision


def states(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.kv"))


@pytest.mark.parametrize(("kind", "kept"), [("dense", 1), ("swa", 2)])
async def test_a_five_turn_conversation_keeps_one_state_on_disk(
    kind: str, kept: int, tiny_models: dict[str, Path], cache_dir: Path
) -> None:
    """Two conversations take turns on one slot: every turn vacates the other's state, so
    each is saved at every turn (A five times, B four). On a dense model the newest state of
    each stands for the older ones; on a sliding-window model one turn back stays too (it
    alone serves a branch from that turn)."""
    if kind == "dense":
        server = start_real_server(cache_dir, tiny_models["dense"], 1, 2048, ("--cache-ram", "0"))
    else:
        server = start_real_server(cache_dir, slots=1, ctx_per_slot=2048)
    proxy = await start_proxy(server.url, cache_dir, live_window=0)
    try:
        a, b = opening(1), opening(2)
        for turn in range(5):
            a, decided = await chat(proxy.url, a)
            assert decided == ("miss" if turn == 0 else "restored"), (turn, decided)
            b, _ = await chat(proxy.url, b)
            a = [*a, {"role": "user", "content": f"And fact {turn + 2}?"}]
            b = [*b, {"role": "user", "content": f"And fact {turn + 2}?"}]
        await proxy.cache.background.wait(30)
        assert len(states(cache_dir)) == 2 * kept, states(cache_dir)
        assert len(committed(cache_dir)) == 2 * kept
        _, decided = await chat(proxy.url, a)  # the newest state still serves
        assert decided == "restored"
    finally:
        await proxy.stop()
        server.stop()


async def test_the_request_that_vacates_a_slot_waits_for_no_commit(
    cache_dir: Path,
    held_commits: threading.Event,  # noqa: F811 (the fixture)
) -> None:
    server = start_real_server(cache_dir, slots=1, ctx_per_slot=2048)
    proxy = await start_proxy(server.url, cache_dir, live_window=0)
    try:
        a, _ = await chat(proxy.url, opening(1))
        # B takes the only slot: A's state is written, its commit held back; B is answered.
        _, decided = await asyncio.wait_for(chat(proxy.url, opening(2)), 120)
        assert decided == "miss"
        assert committed(cache_dir) == set() and states(cache_dir) == []
        assert [p for p in cache_dir.iterdir() if TMP_MARK in p.name]  # written, uncommitted
        back = asyncio.ensure_future(chat(proxy.url, [*a, {"role": "user", "content": "More?"}]))
        await asyncio.sleep(0.5)
        assert not back.done()  # A's turn waits for its state's commit ...
        held_commits.set()
        _, decided = await asyncio.wait_for(back, 120)
        assert decided == "restored"  # ... and restores it
    finally:
        held_commits.set()
        await proxy.stop()
        server.stop()


async def test_a_budget_too_small_for_one_state_skips_its_save(cache_dir: Path) -> None:
    """Gemma 3 270M keeps ~8 KiB a token: a ~400-token state is ~3 MB, over a 1 MB budget.
    Requests are answered, nothing is kept, and /metrics counts the saves not made."""
    server = start_real_server(cache_dir, slots=1, ctx_per_slot=2048)
    proxy = await start_proxy(server.url, cache_dir, live_window=0, max_disk=1_000_000)
    try:
        for n in (1, 2, 3):
            await chat(proxy.url, opening(n))
        await proxy.cache.background.wait(30)
        assert states(cache_dir) == [] and committed(cache_dir) == set()
        assert not [p for p in cache_dir.iterdir() if TMP_MARK in p.name]
        _, text = await scrape(proxy)
        assert total(parse(text), "kvproxy_saves_over_budget_total") == 2
    finally:
        await proxy.stop()
        server.stop()
