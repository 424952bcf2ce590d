"""kvproxy in front of a router (the fake one, bench/kvproxy_fake/router.py): one lane per
model, each request to the lane of its body's "model"; before a request makes the router
unload a model (--models-max), that model's unsaved slots are saved, and its conversations
come back restored when it does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from kvproxy_fake.router import FakeRouter, fake_models

from kvproxy.lanes.models import ModelView, victim

from .conftest import RunningProxy, committed, start_proxy
from .test_cache import chat, conv, then


@pytest.fixture
async def routed(tmp_path: Path) -> AsyncIterator[tuple[FakeRouter, RunningProxy]]:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeRouter(fake_models(["coder", "chat"]), models_max=1, slot_save_path=cache) as r:
        proxy = await start_proxy(r.url, cache)
        try:
            yield r, proxy
        finally:
            await proxy.stop()


async def settle(proxy: RunningProxy) -> None:
    for _ in range(1000):
        lanes = proxy.cache.lanes
        if not len(proxy.cache.background) and not any(
            s.busy for lane in lanes for s in lane.pool.slots
        ):
            return
        await asyncio.sleep(0.01)


def test_the_router_unloads_its_least_recently_used_idle_model() -> None:
    views = [
        ModelView("a", "loaded", busy=False, last_post=5.0),
        ModelView("b", "sleeping", busy=False, last_post=1.0),
        ModelView("c", "unloaded", busy=False, last_post=0.0),
    ]
    assert victim(views, "c", 2) == "b"  # asleep counts as idle
    assert victim(views, "c", 3) is None  # room for one more
    assert victim(views, "a", 1) is None  # already running
    assert victim(views, "c", 0) is None  # no limit
    busy = [ModelView("a", "loaded", True, 5.0), ModelView("c", "unloaded", False, 0.0)]
    assert victim(busy, "c", 1) != "a"  # never a model with a request on its way: wait


async def test_each_model_is_a_lane_and_a_swap_loses_no_conversation(
    routed: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = routed
    assert sorted(lane.name.rsplit("/", 1)[1] for lane in proxy.cache.lanes) == [
        "chat",
        "coder",
    ]
    status, r1, h1 = await chat(proxy, conv(1), model="coder")
    assert status == 200 and h1["X-KVProxy-Cache"] == "miss"
    await settle(proxy)
    cache = proxy.cache.store.root
    assert router.models["coder"].loads == 1 and not committed(cache)

    # A request for the other model: the router (--models-max 1) unloads coder for it, and
    # kvproxy saved coder's conversation first.
    status, _, h = await chat(proxy, conv(2), model="chat")
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert router.unloads == ["coder"]
    assert committed(cache), "coder's conversation was not saved before the swap"
    # Its entry names its model (`kvproxy ls`).
    assert {e.model for e in proxy.cache.store.entries.values()} == {"coder"}
    await settle(proxy)

    status, r2, h2 = await chat(proxy, then(conv(1), r1), model="coder")
    assert status == 200 and h2["X-KVProxy-Cache"] == "restored", h2
    assert router.unloads == ["coder", "chat"] and router.models["coder"].loads == 2
    # Served from the restored state: only the new turn was prefilled.
    assert r2["timings"]["prompt_n"] <= 100 < r2["timings"]["cache_n"]


async def test_a_request_naming_no_model_goes_to_the_router_as_it_is(
    routed: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = routed
    status, body, _ = await chat(proxy, conv(1))
    assert status == 400 and "model name is missing" in str(body)
    status, body, _ = await chat(proxy, conv(1), model="nope")
    assert status == 400 and "not found" in str(body)
    assert all(m.loads == 0 for m in router.models.values())


@pytest.mark.parametrize("route", ["/models/load", "/models/unload"])
async def test_a_model_management_route_saves_what_it_unloads_first(
    tmp_path: Path, route: str
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    # Unloading: both models loaded, so the route's model is not the only one in rotation.
    models_max = 1 if route == "/models/load" else 2
    models = fake_models(["coder", "chat"])
    async with FakeRouter(models, models_max=models_max, slot_save_path=cache) as r:
        proxy = await start_proxy(r.url, cache, allow_model_management=True)
        try:
            if route == "/models/unload":
                assert (await chat(proxy, conv(2), model="coder"))[0] == 200
            status, r1, _ = await chat(proxy, conv(1), model="chat")
            assert status == 200
            await settle(proxy)
            assert not committed(cache)
            # Loading coder unloads chat (--models-max 1); unloading chat, too.
            name = "coder" if route == "/models/load" else "chat"
            async with aiohttp.ClientSession() as s:
                async with s.post(proxy.url + route, json={"model": name}) as resp:
                    assert resp.status == 200, await resp.text()
            assert r.unloads == ["chat"] and committed(cache)
            status, _, h2 = await chat(proxy, then(conv(1), r1), model="chat")
            assert status == 200 and h2["X-KVProxy-Cache"] == "restored", h2
        finally:
            await proxy.stop()


async def test_a_request_asking_for_no_load_gets_the_routers_refusal_and_loads_nothing(
    routed: tuple[FakeRouter, RunningProxy],
) -> None:
    """`?autoload=false` on a model the router has not loaded: the router alone answers 400
    "model is not loaded" and unloads nothing; through kvproxy too, on every kind of route."""
    router, proxy = routed
    status, r1, _ = await chat(proxy, conv(1), model="chat")
    assert status == 200
    await settle(proxy)
    async with aiohttp.ClientSession() as s:
        for method, route, body in (
            (
                "POST",
                "/v1/chat/completions?autoload=false",
                {"model": "coder", "messages": conv(2)},
            ),
            (
                "POST",
                "/completion?autoload=false",
                {"model": "coder", "prompt": "Hi", "n_predict": 2},
            ),
            ("GET", "/props?model=coder&autoload=false", None),
        ):
            async with s.request(method, proxy.url + route, json=body) as resp:
                answer = await resp.json()
                assert resp.status == 400, (route, answer)
                assert answer["error"]["message"] == "model is not loaded", (route, answer)
                # A route that uses a slot says what the cache did (nothing); /props none.
                label = "bypass" if route.startswith(("/v1/chat", "/completion")) else None
                assert resp.headers.get("X-KVProxy-Cache") == label, route
    assert router.models["coder"].loads == 0 and router.unloads == []
    status, r2, h2 = await chat(proxy, then(conv(1), r1), model="chat")
    assert status == 200 and h2["X-KVProxy-Cache"] == "resident", h2


async def test_a_router_that_autoloads_nothing_is_asked_as_it_is(tmp_path: Path) -> None:
    """`--no-models-autoload`: a request for a model not loaded is refused unless it asks
    `?autoload=true`, as the router alone answers it."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    models = fake_models(["coder", "chat"])
    async with FakeRouter(models, models_max=1, slot_save_path=cache, autoload=False) as router:
        proxy = await start_proxy(router.url, cache)
        try:
            status, refused, _ = await chat(proxy, conv(1), model="chat")
            assert status == 400 and refused["error"]["message"] == "model is not loaded"
            assert router.models["chat"].loads == 0
            async with aiohttp.ClientSession() as s:
                body = {"model": "chat", "messages": conv(1)}
                url = proxy.url + "/v1/chat/completions?autoload=true"
                async with s.post(url, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["X-KVProxy-Cache"] == "miss"
            assert router.models["chat"].loads == 1
        finally:
            await proxy.stop()


async def test_a_pinned_completion_goes_to_its_models_lane(
    routed: tuple[FakeRouter, RunningProxy],
) -> None:
    router, proxy = routed
    async with aiohttp.ClientSession() as s:
        body = {"model": "chat", "prompt": "Hello there", "n_predict": 4}
        async with s.post(proxy.url + "/completion", json=body) as resp:
            assert resp.status == 200, await resp.text()
    sent = [b for m, p, b in router.child("chat").requests if p.startswith("/completion")]
    assert sent and sent[-1]["model"] == "chat" and sent[-1]["id_slot"] in (0, 1)
    assert router.models["coder"].loads == 0


async def test_a_router_with_no_models_is_served_as_it_is(tmp_path: Path) -> None:
    # llama.cpp's own suite starts routers with no models (its CORS tests): kvproxy must
    # still answer, passing requests through, not fail for want of a lane.
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeRouter({}, slot_save_path=cache) as r:
        proxy = await start_proxy(r.url, cache)
        try:
            assert len(proxy.cache.lanes) == 1
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as resp:
                assert resp.status == 200, await resp.text()
            status, body, _ = await chat(proxy, conv(1), model="coder")
            assert status == 400 and "not found" in str(body)
        finally:
            await proxy.stop()


@pytest.mark.parametrize(
    ("method", "route", "body"),
    [
        ("POST", "/tokenize", {"model": "coder", "content": "hello"}),
        ("POST", "/detokenize", {"model": "coder", "tokens": [1, 2]}),
        (
            "POST",
            "/apply-template",
            {"model": "coder", "messages": [{"role": "user", "content": "hi"}]},
        ),
        ("GET", "/props?model=coder", None),
    ],
)
async def test_a_pass_through_route_naming_another_model_saves_what_it_unloads_first(
    routed: tuple[FakeRouter, RunningProxy], method: str, route: str, body: object
) -> None:
    """The router loads the model any proxied route names (server-models.cpp proxy_post reads
    the body's "model", proxy_get `?model=`): with --models-max 1 that unloads the other one,
    so what it held is saved first, as before a chat turn for that model."""
    router, proxy = routed
    status, r1, _ = await chat(proxy, conv(1), model="chat")
    assert status == 200
    await settle(proxy)
    assert not committed(proxy.cache.store.root)
    async with aiohttp.ClientSession() as s:
        async with s.request(method, proxy.url + route, json=body) as resp:
            assert resp.status == 200, await resp.text()
    assert router.unloads == ["chat"]
    assert committed(proxy.cache.store.root), "chat's conversation was lost in the swap"
    status, r2, h2 = await chat(proxy, then(conv(1), r1), model="chat")
    assert status == 200 and h2["X-KVProxy-Cache"] == "restored", h2
    assert r2["timings"]["prompt_n"] <= 100 < r2["timings"]["cache_n"]
