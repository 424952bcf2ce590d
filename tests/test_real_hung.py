"""A real llama-server SIGSTOPped (it accepts connections, answers nothing) beside another:
its timed-out check takes it out of rotation, new conversations and /health are answered by
the other, and after SIGCONT it rejoins."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from .conftest import start_proxy, start_real_server

pytestmark = pytest.mark.real

BOUND = 60.0


async def test_a_stopped_real_server_leaves_rotation_and_rejoins(cache_dir: Path) -> None:
    servers = [
        await asyncio.to_thread(start_real_server, cache_dir, ctx_per_slot=1024) for _ in range(2)
    ]
    proxy = await start_proxy([s.url for s in servers], cache_dir)
    hung = servers[0]
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == hung.url)
    try:
        os.kill(hung.pid, signal.SIGSTOP)
        try:
            async with asyncio.timeout(20):  # a lone server's 30 s check would not do it
                while lane.in_rotation:
                    await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as s, asyncio.timeout(BOUND):
                async with s.get(proxy.url + "/health") as r:
                    assert r.status == 200
                for n in range(3):
                    body = {
                        "messages": [{"role": "user", "content": f"Say hello {n}."}],
                        "max_tokens": 4,
                    }
                    async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["choices"][0]["message"]["content"] is not None
        finally:
            os.kill(hung.pid, signal.SIGCONT)
        async with asyncio.timeout(BOUND):
            while not lane.in_rotation:
                await asyncio.sleep(0.1)
    finally:
        await proxy.stop()
        for server in servers:
            await asyncio.to_thread(server.stop)
