"""Request bodies kvproxy holds at once are bounded in bytes (--max-body-memory), not only
in count: a body past the budget gets a 503 with Retry-After before it is read, while those
held are served; the budget comes back as answers end."""

from __future__ import annotations

import asyncio

import aiohttp

from kvproxy.edge.heldbodies import HeldBodies

from .conftest import Maker

MIB = 1024**2
BOUND = 30.0


def body(n: int) -> dict[str, str]:
    return {"content": "a" * (n - 20)}


async def tokenize(s: aiohttp.ClientSession, url: str) -> tuple[int, str, dict[str, str]]:
    async with s.post(url + "/tokenize", json=body(MIB)) as resp:
        return resp.status, await resp.text(), dict(resp.headers)


async def test_bodies_past_the_byte_budget_get_503_and_held_ones_are_served(make: Maker) -> None:
    fake, proxy = await make(max_body_memory=3 * MIB + 4096)
    fake.frozen = True  # the server answers nothing: every body stays held
    async with aiohttp.ClientSession() as s:
        held = [asyncio.create_task(tokenize(s, proxy.url)) for _ in range(3)]
        async with asyncio.timeout(BOUND):
            while sum(1 for r in fake.requests if r[1] == "/tokenize") < 3:
                await asyncio.sleep(0.05)
        async with asyncio.timeout(BOUND):  # before: forwarded, and waits with the others
            status, text, headers = await tokenize(s, proxy.url)
        assert status == 503, text
        assert "--max-body-memory" in text and '"body_memory_full"' in text
        assert headers["Retry-After"] == "1"
        fake.frozen = False
        async with asyncio.timeout(BOUND):
            answers = await asyncio.gather(*held)
        assert [a[0] for a in answers] == [200, 200, 200]
        status, text, _ = await tokenize(s, proxy.url)  # the budget came back
        assert status == 200, text


def test_one_body_always_passes_and_zero_means_no_bound() -> None:
    budget = HeldBodies(10)
    assert budget.take(50)  # nothing held: a body over the whole budget still passes
    assert not budget.take(1)
    budget.give_back(50)
    assert budget.take(6) and not budget.take(5) and budget.take(4)
    assert budget.refused == 2
    unbounded = HeldBodies(0)
    assert all(unbounded.take(10**9) for _ in range(5))
