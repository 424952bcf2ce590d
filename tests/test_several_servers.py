"""Several llama-servers behind one kvproxy (fake servers sharing one cache dir): requests
follow their conversation's state, new ones spread out, a dead server costs nothing but what
it had not saved, and a returning one is distrusted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvproxy.cli.stats import render_stats
from kvproxy.config import Settings
from kvproxy.handlers.prepare import SNAPSHOT_TRUST

from .conftest import RunningProxy, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, then


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[list[FakeLlamaServer], RunningProxy]]:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fakes = [FakeLlamaServer(slot_save_path=cache) for _ in range(2)]
    for fake in fakes:
        await fake.start()
    proxy = await start_proxy([f.url for f in fakes], cache)
    try:
        yield fakes, proxy
    finally:
        await proxy.stop()
        for fake in fakes:
            await fake.stop()


def chats_on(fake: FakeLlamaServer) -> int:
    return sum(1 for r in fake.requests if r[1].startswith("/v1/chat/completions"))


async def test_the_env_var_and_repeated_flag_name_several_servers() -> None:
    env = Settings(upstream="http://127.0.0.1:1, http://127.0.0.1:2/")
    assert env.upstream_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    flags = Settings(upstream=["http://127.0.0.1:1", "http://127.0.0.1:2"])
    assert flags.upstream_url == "http://127.0.0.1:1" and len(flags.upstream_urls) == 2


async def test_a_conversation_stays_where_its_state_is_and_new_ones_spread(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    first = conv(1)
    status, body, headers = await chat(proxy, first)
    assert status == 200 and headers["X-KVProxy-Cache"] == "miss"
    home = next(f for f in fakes if chats_on(f) == 1)
    # A second conversation goes to the other server: both have an empty slot, the other two.
    status, _, _ = await chat(proxy, conv(2))
    assert status == 200
    assert [chats_on(f) for f in fakes] == [1, 1]
    # Turn 2 of the first goes back to where it is resident.
    status, body2, headers2 = await chat(proxy, then(first, body))
    assert status == 200 and headers2["X-KVProxy-Cache"] == "resident"
    assert chats_on(home) >= 2
    assert body2["timings"]["cache_n"] > 0
    stats = proxy.stats()
    names = {f.url.split("//")[1] for f in fakes}
    assert {b["name"] for b in stats["backends"]} == names
    assert len(stats["slots"]) == 4
    # `kvproxy stats` names each server and the server of each slot.
    shown = render_stats(stats, proxy.url)
    for name in names:
        assert f"server       {name}  in rotation" in shown
        assert f"  {name} 0  " in shown
    # So do the metrics.
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/metrics") as r:
        text = await r.text()
    for name in names:
        assert f'kvproxy_backend_up{{backend="{name}"}} 1.0' in text
    assert 'kvproxy_backend_requests_total{backend="' in text


async def test_concurrent_conversations_use_both_servers(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    for fake in fakes:
        fake.token_delay = 0.02  # replies long enough to overlap
    results = await asyncio.gather(*(chat(proxy, conv(n), max_tokens=20) for n in range(4)))
    assert all(status == 200 for status, _, _ in results)
    # Four at once through 2 × 2 slots: none waited, each server took two.
    assert [chats_on(f) for f in fakes] == [2, 2]


async def test_a_dead_server_costs_only_what_it_had_not_saved(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    first = conv(1)
    _, body, _ = await chat(proxy, first)
    home = next(f for f in fakes if chats_on(f) == 1)
    other = next(f for f in fakes if f is not home)
    # Saved (as an idle save or an eviction would), then its server dies.
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == home.url)
    slot = next(s for s in lane.pool.slots if s.holding is not None)
    got, _ = await lane.pool.acquire(wanted=slot.id)
    try:
        await lane.work.verify(got)
        await lane.work.save(got)
    finally:
        lane.pool.release(got)
    await home.stop()
    # The next turn goes to the other server, restored there from the shared cache dir.
    status, body2, headers = await chat(proxy, then(first, body))
    assert status == 200, body2
    assert headers["X-KVProxy-Cache"] == "restored"
    assert chats_on(other) == 1
    assert body2["timings"]["cache_n"] > 0
    # New conversations keep being served.
    status, _, _ = await chat(proxy, conv(3))
    assert status == 200
    backends = {b["name"]: b for b in proxy.stats()["backends"]}
    assert backends[home.url.split("//")[1]]["down"] is not None


async def test_a_server_that_returns_rejoins_with_its_slots_distrusted(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    _, body, _ = await chat(proxy, conv(1))
    home = next(f for f in fakes if chats_on(f) == 1)
    port = int(home.url.rsplit(":", 1)[1])
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == home.url)
    await home.stop()
    # Found down by its health check (every 2 s with several servers).
    for _ in range(100):
        if not lane.in_rotation:
            break
        await asyncio.sleep(0.1)
    assert not lane.in_rotation
    restarted = FakeLlamaServer(slot_save_path=home.save_dir)
    await restarted.start(port)
    try:
        for _ in range(100):
            if lane.in_rotation:
                break
            await asyncio.sleep(0.1)
        assert lane.in_rotation
        assert all(slot.holding is None for slot in lane.pool.slots)
    finally:
        await restarted.stop()


async def test_pass_through_routes_go_to_a_server_in_rotation(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    await fakes[0].stop()
    async with aiohttp.ClientSession() as s:
        # Until its check finds it down, a pass-through may still pick it: wait for that.
        lane = proxy.cache.lanes[0]
        for _ in range(100):
            if not lane.in_rotation:
                break
            await asyncio.sleep(0.1)
        async with s.post(proxy.url + "/tokenize", json={"content": "hello"}) as r:
            assert r.status == 200


async def test_a_server_that_dies_before_answering_is_replaced_by_another(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    fakes, proxy = pair
    fakes[0].prompt_delay = 2.0  # the first choice is still prefilling when it dies
    request = asyncio.create_task(chat(proxy, conv(1)))
    for _ in range(200):
        if chats_on(fakes[0]):
            break
        await asyncio.sleep(0.01)
    assert chats_on(fakes[0]) == 1
    await fakes[0].stop()
    status, body, headers = await request
    # Not a byte had reached the client: the request went to the other server instead.
    assert status == 200, body
    assert chats_on(fakes[1]) == 1
    assert body["choices"][0]["message"]["content"]


async def test_a_hung_server_leaves_rotation_and_rejoins_when_it_answers(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    """A server that accepts connections and answers nothing (SIGSTOPped) is taken out of
    rotation by its timed-out check, long before a lone server's 30 s one would: new
    conversations and /health go to the other; once it answers again, it rejoins."""
    fakes, proxy = pair
    hung, other = fakes
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == hung.url)
    hung.frozen = True
    try:
        async with asyncio.timeout(15):  # fails with the old 30 s check
            while lane.in_rotation:
                await asyncio.sleep(0.1)
        for n in range(4):  # its slots look idle: before, new conversations went there
            status, body, _ = await chat(proxy, conv(10 + n))
            assert status == 200, body
        assert chats_on(other) == 4
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.get(proxy.url + "/health") as r:
                    assert r.status == 200
        backends = {b["name"]: b for b in proxy.stats()["backends"]}
        assert "no answer within" in str(backends[hung.url.split("//")[1]]["down"])
    finally:
        hung.frozen = False
    async with asyncio.timeout(30):
        while not lane.in_rotation:
            await asyncio.sleep(0.1)


# How long the tests below wait for answers while a server stays hung: well past the time its
# check takes to find it hung, and short of for ever, which is how long a request held on it
# waited before (until the server answered again).
PATIENCE = 30.0


async def test_requests_already_on_a_server_found_hung_go_to_the_other(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    """New conversations sent as a server hangs, before its check finds it hung: those it
    drew (its idle slots) wait there for kvproxy's own calls (a fresh server's slots are
    erased before a tenant's first use), headers that never come, or one of its slots. Once it
    is found hung they are served by the other, long before it answers again."""
    fakes, proxy = pair
    hung, other = fakes
    hung.frozen = True
    before = len(hung.requests)
    sent = [asyncio.create_task(chat(proxy, conv(30 + n))) for n in range(6)]
    try:
        done, pending = await asyncio.wait(sent, timeout=PATIENCE)
        # Some went there first (kvproxy's own calls for them, or the chats themselves).
        assert [r for r in hung.requests[before:] if r[1] != "/props"]
        assert not pending, f"{len(pending)} of 6 still held by the hung server"
        assert [t.result()[0] for t in done] == [200] * 6
        assert chats_on(other) == 6
    finally:
        for task in sent:
            task.cancel()
        hung.frozen = False


async def test_a_turn_waiting_on_kvproxys_own_call_to_a_hung_server_goes_to_the_other(
    pair: tuple[list[FakeLlamaServer], RunningProxy],
) -> None:
    """A returning conversation goes to the server holding it; hung, that server does not
    answer kvproxy's check of the slot (GET /slots, before the slot is trusted). Once the
    server is found hung, the turn is restored from disk on the other."""
    fakes, proxy = pair
    first = conv(1)
    _, body, _ = await chat(proxy, first)
    home = next(f for f in fakes if chats_on(f) == 1)
    other = next(f for f in fakes if f is not home)
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == home.url)
    slot = next(s for s in lane.pool.slots if s.holding is not None)
    got, _ = await lane.pool.acquire(wanted=slot.id)
    try:
        await lane.work.verify(got)
        await lane.work.save(got)  # as an idle save would
    finally:
        lane.pool.release(got)
    slot.seen_at -= SNAPSHOT_TRUST  # a while later: what the slot holds is checked first
    home.frozen = True
    before = len(home.requests)
    try:
        status, body2, headers = await asyncio.wait_for(chat(proxy, then(first, body)), PATIENCE)
        assert [r[1] for r in home.requests[before:]][:1] == ["/slots"]  # it waited there
        assert status == 200, body2
        assert headers["X-KVProxy-Cache"] == "restored"
        assert chats_on(other) == 1
    finally:
        home.frozen = False
