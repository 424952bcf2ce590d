"""With a real llama-server started with --sleep-idle-seconds: kvproxy's watching (GET /props
every check) leaves it asleep, and a client's request wakes it and is served."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvproxy.cache.servers import backend
from kvproxy.lanes import cache as lanecache

from .conftest import start_proxy, start_real_server
from .test_cache import chat

pytestmark = pytest.mark.real


async def test_kvproxy_leaves_a_sleeping_server_asleep(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lanecache, "HOUSEKEEPING_INTERVAL", 0.2)
    monkeypatch.setattr(backend, "PROPS_CHECK_INTERVAL", 0.5)  # 30 times kvproxy's pace
    server = await asyncio.to_thread(
        start_real_server,
        cache_dir,
        extra=("--cache-ram", "0", "--swa-full", "--sleep-idle-seconds", "2"),
    )
    try:
        proxy = await start_proxy(server.url, cache_dir)
        try:
            messages = [{"role": "user", "content": "Say hi."}]
            status, _, _ = await chat(proxy, messages, max_tokens=4)
            assert status == 200
            for _ in range(100):
                if proxy.cache.backend.sleeping:
                    break
                await asyncio.sleep(0.1)
            assert proxy.cache.backend.sleeping, "the server never fell asleep"
            log = server.log_path.read_text()
            woke = log.count("exiting sleeping state")
            await asyncio.sleep(4)  # eight props checks
            assert server.log_path.read_text().count("exiting sleeping state") == woke
            assert proxy.cache.backend.sleeping

            status, body, _ = await chat(proxy, messages, max_tokens=4)  # a client wakes it
            assert status == 200 and body["choices"][0]["message"]["content"] is not None
            assert server.log_path.read_text().count("exiting sleeping state") > woke
        finally:
            await proxy.stop()
    finally:
        await asyncio.to_thread(server.stop)
