"""A date change inside a long system prompt costs only its tail on a real llama-server
(Gemma 3 270M, a sliding-window model, --swa-full): the new day's first session restores the
stem (the prompt's head before the date) and extends it, where without it nothing stored
could serve it (its system message matches none, and a restored SWA state serves only what
extends it or parts near its end). The date on a line of its own, or inside a sentence of one
long paragraph (`… reports. Current date: 2026-12-03. The crews …`)."""

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
# The same facts as one paragraph: no line starts anywhere near the date.
PARAGRAPH = (
    "You are a careful assistant for a warehouse team. "
    + "".join(
        f"Shelf {i % 17} holds item {i * 7 % 101} and is checked every {i % 5 + 1} days. "
        for i in range(100)
    )
    + "Write the daily reports. "
)
PARAGRAPH_TAIL = ". The crews " + "".join(
    f"restock shelf {i % 13} before noon, then " for i in range(40)
)


def system(day: str, head: str) -> str:
    if head == PARAGRAPH:
        return f"{head}Current date: 2026-12-{day}{PARAGRAPH_TAIL}done."
    return f"{head}Current date: 2026-12-{day}\n{TAIL}"


def session(day: str, question: str, head: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system(day, head)},
        {"role": "user", "content": question},
    ]


async def tokens_of(server: RealServer, text: str) -> int:
    body = {"content": text, "add_special": False}
    async with aiohttp.ClientSession() as s, s.post(server.url + "/tokenize", json=body) as r:
        return len((await r.json())["tokens"])


@pytest.mark.parametrize("head", [HEAD, PARAGRAPH], ids=["date-line", "date-in-a-sentence"])
async def test_the_first_session_after_a_date_change_reuses_the_unchanged_head(
    own_server: tuple[Path, list[RealServer]], head: str
) -> None:
    cache, servers = own_server
    servers.append(start_real_server(cache))
    # What a new day leaves as it was: the system message up to the date.
    n_head = await tokens_of(servers[0], head + "Current date: ")
    assert n_head >= 1500, n_head
    proxy = await start_proxy(servers[0].url, cache, min_tokens=256)
    try:
        _, h = await chat(proxy.url, session("01", "Which shelf holds item 14?", head))
        assert h["X-KVProxy-Cache"] == "miss"
        for other in ("inventory", "payroll"):  # other conversations take both slots
            await chat(proxy.url, [{"role": "user", "content": f"You help with {other}. " * 40}])
        b, h = await chat(proxy.url, session("02", "How often is shelf 3 checked?", head))
        # What came from disk, not what kvproxy evaluated on the way (the new opening).
        evaluated = int(h.get("X-KVProxy-Evaluated-Tokens", 0))
        cached = b["timings"]["cache_n"] - evaluated
        print(
            f"\n{'paragraph' if head == PARAGRAPH else 'date line'}: {n_head} tokens before "
            f"the date; after the date change: {h['X-KVProxy-Cache']}, "
            f"{h.get('X-KVProxy-Restored-Tokens')} restored, {cached} reused from it "
            f"({cached / n_head:.1%}), {evaluated} evaluated on the way, "
            f"{b['timings']['prompt_n']} prefilled"
        )
        assert h["X-KVProxy-Cache"] == "restored", h
        assert int(h["X-KVProxy-Restored-Tokens"]) >= 0.9 * n_head
        assert cached >= 0.9 * n_head
    finally:
        await proxy.stop()
