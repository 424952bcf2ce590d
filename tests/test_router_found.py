"""Router models kvproxy finds while it runs (bench/kvproxy_fake/router.py): a model the
router lists after kvproxy started, a router that was down when kvproxy started, and one
model's lanes on several routers (`--servers N --models-dir`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from kvproxy_fake.router import FakeRouter, fake_models

from kvproxy.cache.servers import backend
from kvproxy.lanes import cache as lanecache
from kvproxy.lanes.routing import model_candidates
from kvproxy.server.managed import free_port

from .conftest import RunningProxy, start_proxy
from .test_cache import chat, conv, then
from .test_router_lanes import settle


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
async def one_model(cache: Path) -> AsyncIterator[tuple[FakeRouter, RunningProxy]]:
    async with FakeRouter(fake_models(["coder"]), models_max=2, slot_save_path=cache) as r:
        proxy = await start_proxy(r.url, cache)
        try:
            yield r, proxy
        finally:
            await proxy.stop()


def lane_models(proxy: RunningProxy) -> list[str]:
    return sorted(lane.backend.model or "" for lane in proxy.cache.lanes)


async def two_turns(proxy: RunningProxy, model: str, n: int = 1) -> None:
    """A conversation's first turn is cached (a miss, then saved or kept), its second is
    served from it: only the new message is prefilled."""
    status, r1, h1 = await chat(proxy, conv(n), model=model)
    assert status == 200 and h1["X-KVProxy-Cache"] == "miss", (r1, h1)
    await settle(proxy)
    status, r2, h2 = await chat(proxy, then(conv(n), r1), model=model)
    assert status == 200 and h2["X-KVProxy-Cache"] in ("resident", "restored"), h2
    assert r2["timings"]["prompt_n"] <= 100 < r2["timings"]["cache_n"]


async def test_a_model_the_router_lists_later_is_cached_from_its_first_request(
    one_model: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = one_model
    assert lane_models(proxy) == ["coder"]
    router.add_file("chat")
    # The operator makes the router read its models dir again, through kvproxy.
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/models?reload=1") as resp:
        assert resp.status == 200
        assert "chat" in [m["id"] for m in (await resp.json())["data"]]
    await two_turns(proxy, "chat")
    assert lane_models(proxy) == ["chat", "coder"]


async def test_housekeeping_finds_a_model_the_router_lists_later(
    one_model: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = one_model
    router.add_file("chat")
    router.reload()  # by someone else: kvproxy sees it at its next look, no request needed
    for _ in range(1000):
        if lane_models(proxy) == ["chat", "coder"]:
            break
        await asyncio.sleep(0.01)
    assert lane_models(proxy) == ["chat", "coder"]
    assert router.models["chat"].loads == 0  # looking loads nothing
    await two_turns(proxy, "chat")


async def test_looking_for_new_models_never_wakes_a_sleeping_one(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lanecache, "HOUSEKEEPING_INTERVAL", 0.05)
    monkeypatch.setattr(backend, "SEVERAL_CHECK_INTERVAL", 0.1)
    models = fake_models(["coder"])
    async with FakeRouter(models, slot_save_path=cache, sleep_idle_seconds=0.3) as router:
        proxy = await start_proxy(router.url, cache)
        try:
            assert (await chat(proxy, conv(1), model="coder"))[0] == 200
            await settle(proxy)
            child = router.child("coder")
            for _ in range(500):
                if child.is_sleeping:
                    break
                await asyncio.sleep(0.01)
            assert child.is_sleeping
            # Ten looks and more, a request naming a model nobody lists, then a new model.
            await asyncio.sleep(1.0)
            status, _, _ = await chat(proxy, conv(2), model="chat")
            assert status == 400
            router.add_file("chat")
            router.reload()
            for _ in range(500):
                if lane_models(proxy) == ["chat", "coder"]:
                    break
                await asyncio.sleep(0.01)
            assert lane_models(proxy) == ["chat", "coder"]
            assert child.wakes == 0 and child.is_sleeping
        finally:
            await proxy.stop()


async def test_a_request_for_a_model_nobody_lists_goes_to_the_router_as_it_is(
    one_model: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = one_model
    router.add_file("chat")  # in the dir, but the router has not read it: it knows no "chat"
    status, body, headers = await chat(proxy, conv(1), model="chat")
    assert status == 400 and "not found" in str(body)
    assert headers["X-KVProxy-Cache"] == "bypass"
    assert lane_models(proxy) == ["coder"]


async def test_a_router_down_when_kvproxy_started_is_served_per_model_once_up(
    cache: Path,
) -> None:
    port = free_port()
    proxy = await start_proxy(f"http://127.0.0.1:{port}", cache)
    try:
        status, _, _ = await chat(proxy, conv(1), model="coder")
        assert status == 502
        router = FakeRouter(fake_models(["coder", "chat"]), models_max=1, slot_save_path=cache)
        await router.start(port)
        try:
            await two_turns(proxy, "coder")
            assert lane_models(proxy) == ["chat", "coder"]
            # A swap on it saves first, as on a router found at start.
            await two_turns(proxy, "chat", 2)
            assert router.unloads == ["coder"]
        finally:
            await router.stop()
    finally:
        await proxy.stop()


def test_a_model_goes_where_it_runs_else_where_it_loads_without_a_swap() -> None:
    assert model_candidates([False, True, True], [True, False, False]) == [1, 2]
    assert model_candidates([False, False, False], [False, True, True]) == [1, 2]
    assert model_candidates([False, False], [False, False]) == [0, 1]


async def test_each_router_serves_a_model_and_no_swap_is_made_while_another_has_room(
    cache: Path,
) -> None:
    names = fake_models(["coder", "chat"])
    async with (
        FakeRouter(names, models_max=1, slot_save_path=cache) as first,
        FakeRouter(names, models_max=1, slot_save_path=cache) as second,
    ):
        proxy = await start_proxy([first.url, second.url], cache)
        try:
            assert lane_models(proxy) == ["chat", "chat", "coder", "coder"]
            status, r1, _ = await chat(proxy, conv(1), model="coder")
            assert status == 200
            await settle(proxy)
            # The router running coder has no room for chat: the other one loads it.
            status, r2, _ = await chat(proxy, conv(2), model="chat")
            assert status == 200
            await settle(proxy)
            loads = {
                (i, name): router.models[name].loads
                for i, router in enumerate((first, second))
                for name in ("coder", "chat")
            }
            assert sorted(v for v in loads.values()) == [0, 0, 1, 1], loads
            assert first.unloads == [] and second.unloads == []
            # Each conversation's next turn goes to the router that holds it.
            for n, reply, model in ((1, r1, "coder"), (2, r2, "chat")):
                status, body, h = await chat(proxy, then(conv(n), reply), model=model)
                assert status == 200 and h["X-KVProxy-Cache"] == "resident", h
                assert body["timings"]["prompt_n"] <= 100 < body["timings"]["cache_n"]
            assert first.unloads == [] and second.unloads == []
        finally:
            await proxy.stop()


async def test_a_reload_through_kvproxy_reaches_every_router(cache: Path) -> None:
    """A model copied into the models dir of several routers: one `GET /models?reload=1`
    through kvproxy makes each read it, so a request naming it is served whichever router
    it goes to."""
    names = fake_models(["coder"])
    async with (
        FakeRouter(names, models_max=2, slot_save_path=cache) as first,
        FakeRouter(names, models_max=2, slot_save_path=cache) as second,
    ):
        proxy = await start_proxy([first.url, second.url], cache)
        try:
            first.add_file("chat")
            second.add_file("chat")
            async with aiohttp.ClientSession() as s:
                async with s.get(proxy.url + "/v1/models?reload=1") as resp:
                    assert resp.status == 200
                    assert "chat" in [m["id"] for m in (await resp.json())["data"]]
                for router in (first, second):
                    async with s.get(router.url + "/models") as resp:
                        assert "chat" in [m["id"] for m in (await resp.json())["data"]]
            for n in (1, 2):  # the two conversations go to both routers (each idle then)
                await two_turns(proxy, "chat", n)
            assert lane_models(proxy) == ["chat", "chat", "coder", "coder"]
        finally:
            await proxy.stop()
