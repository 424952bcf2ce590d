"""A real llama-server SIGSTOPped (it accepts connections, answers nothing) beside another:
its timed-out check takes it out of rotation, new conversations and /health are answered by
the other, and after SIGCONT it rejoins. Requests it had already drawn before it was found
hung are answered by the other too, while it is still stopped."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from kvproxy.cache.reports.events import Count, RequestEvent, SlotActionEvent
from kvproxy.edge.app import SERVICE

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


class Served:
    """Which server each request kvproxy answered was served by, and its status."""

    def __init__(self) -> None:
        self.by: list[tuple[str, int]] = []

    def on_request(self, event: RequestEvent) -> None:
        self.by.append((event.served_by, event.status))

    def on_slot_action(self, event: SlotActionEvent) -> None:
        del event

    def on_count(self, what: Count, n: int) -> None:
        del what, n


async def test_requests_sent_as_a_real_server_hangs_are_served_by_the_other(
    cache_dir: Path,
) -> None:
    """New conversations sent right after a server is SIGSTOPped, before any check found it
    hung: those that went to it (its idle slots drew them) are answered by the other server
    while it is still stopped, instead of waiting until it resumes."""
    servers = [
        await asyncio.to_thread(start_real_server, cache_dir, ctx_per_slot=1024) for _ in range(2)
    ]
    proxy = await start_proxy([s.url for s in servers], cache_dir)
    served = Served()
    proxy.app[SERVICE].events.listeners.append(served)
    hung, other = servers
    lane = next(lane for lane in proxy.cache.lanes if lane.backend.upstream.base_url == hung.url)
    assert lane.in_rotation

    async def ask(s: aiohttp.ClientSession, n: int) -> tuple[int, str | None]:
        body = {"messages": [{"role": "user", "content": f"Say hello {n}."}], "max_tokens": 4}
        async with s.post(proxy.url + "/v1/chat/completions", json=body) as r:
            reply = await r.json()
            return r.status, reply.get("choices", [{}])[0].get("message", {}).get("content")

    try:
        async with aiohttp.ClientSession() as s:
            os.kill(hung.pid, signal.SIGSTOP)
            try:
                sent = [asyncio.create_task(ask(s, n)) for n in range(8)]
                done, pending = await asyncio.wait(sent, timeout=BOUND)
                for task in pending:
                    task.cancel()
                # Answered while the server was still stopped: by the other one.
                assert not pending, f"{len(pending)} of 8 waited for the stopped server"
                assert all(t.result()[0] == 200 and t.result()[1] is not None for t in done)
            finally:
                os.kill(hung.pid, signal.SIGCONT)
        async with asyncio.timeout(BOUND):  # a miss's report waits for its explanation
            while sum(status == 200 for _, status in served.by) < 8:
                await asyncio.sleep(0.1)
        answered = [name for name, status in served.by if status == 200]
        assert answered == [other.url.split("//")[1]] * 8, served.by
    finally:
        await proxy.stop()
        for server in servers:
            await asyncio.to_thread(server.stop)
