"""When a managed llama-server dies, kvproxy names the requests that were in flight (route,
body size, body hash; never the prompt) in its log and in /kvproxy/stats, and the fleet tells
it of every death of a server that had come up."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import orjson
import xxhash

from kvproxy.edge.app import SERVICE
from kvproxy.server.fleet import Backoff, Fleet

from .conftest import Maker
from .test_fleet import SERVES, standins

BOUND = 30.0


async def test_a_death_names_the_requests_in_flight_without_their_text(make: Maker) -> None:
    fake, proxy = await make()
    fake.frozen = True
    raw = orjson.dumps({"content": "SECRET prompt " * 50})
    async with aiohttp.ClientSession() as s:
        sent = asyncio.create_task(
            s.post(
                proxy.url + "/tokenize",
                data=raw,
                headers={"Content-Type": "application/json"},
            )
        )
        async with asyncio.timeout(BOUND):
            while not any(r[1] == "/tokenize" for r in fake.requests):
                await asyncio.sleep(0.05)
        proxy.app[SERVICE].in_flight.server_died("on port 1")
        async with s.get(proxy.url + "/kvproxy/stats") as r:
            text = await r.text()
            deaths = (await r.json())["server_deaths"]
        assert "SECRET" not in text
        assert deaths[-1]["server"] == "on port 1"
        (suspect,) = deaths[-1]["in_flight"]
        assert suspect["path"] == "/tokenize" and suspect["method"] == "POST"
        assert suspect["body_bytes"] == len(raw)
        assert suspect["body_hash"] == xxhash.xxh3_64_hexdigest(raw)
        fake.frozen = False
        async with asyncio.timeout(BOUND):
            resp = await sent
            assert resp.status == 200
            resp.release()
        async with s.get(proxy.url + "/kvproxy/stats") as r:
            assert len((await r.json())["server_deaths"]) == 1  # kept until more come


async def test_the_fleet_tells_of_each_death_of_a_server_that_was_up(tmp_path: Path) -> None:
    servers, _ = standins(tmp_path, SERVES, 1)
    fleet = Fleet(servers, tmp_path, Backoff(first=0.05, most=0.1, give_up=2))
    told: list[str] = []
    fleet.on_death = told.append
    await fleet.start(timeout=30)
    supervisor = asyncio.create_task(fleet.supervise())
    try:
        for n in (1, 2):
            process = servers[0].process
            assert process is not None
            os.kill(process.pid, signal.SIGKILL)
            async with asyncio.timeout(60):
                while fleet.restarts < n:
                    await asyncio.sleep(0.05)
        assert told == [f"on port {servers[0].port}"] * 2
    finally:
        supervisor.cancel()
        await fleet.stop()


async def test_while_the_managed_server_is_down_clients_get_503_with_retry_after(
    make: Maker,
) -> None:
    _, proxy = await make()
    service = proxy.app[SERVICE]
    service.servers_down_for = lambda: 2.5
    async with aiohttp.ClientSession() as s:
        for path in ("/v1/chat/completions", "/tokenize"):
            async with s.post(proxy.url + path, json={"content": "hi", "messages": []}) as r:
                assert r.status == 503
                assert r.headers["Retry-After"] == "3"
                error = (await r.json())["error"]
                assert error["code"] == "server_restarting" and "started again" in error["message"]
        service.servers_down_for = lambda: None
        async with s.post(proxy.url + "/tokenize", json={"content": "hi"}) as r:
            assert r.status == 200


async def test_the_fleet_says_how_long_until_a_dead_server_starts_again(tmp_path: Path) -> None:
    servers, _ = standins(tmp_path, SERVES, 1)
    fleet = Fleet(servers, tmp_path, Backoff(first=3, most=3, give_up=2))
    await fleet.start(timeout=30)
    supervisor = asyncio.create_task(fleet.supervise())
    try:
        assert fleet.down_for() is None
        process = servers[0].process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        async with asyncio.timeout(BOUND):
            while (down := fleet.down_for()) is None:
                await asyncio.sleep(0.02)
        assert 0 <= down <= 3
        async with asyncio.timeout(BOUND):
            while fleet.restarts < 1:
                await asyncio.sleep(0.05)
        assert fleet.down_for() is None
    finally:
        supervisor.cancel()
        await fleet.stop()
