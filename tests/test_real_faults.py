"""Faults with a real llama-server: killed mid-reply, restarted, and found out."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from kvproxy_bench.dialogues import first_turn

from kvproxy.server.managed import free_port

from .conftest import committed, start_proxy, start_real_server
from .test_cache import settle
from .test_real_cache import chat, next_turn, reuse

pytestmark = pytest.mark.real


async def test_server_killed_mid_stream_then_restarted(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    port = free_port()
    servers = [start_real_server(cache, port=port)]
    proxy = await start_proxy(servers[0].url, cache, min_tokens=16, write_through=True)
    try:
        convo = first_turn(31, n_facts=20)
        reply1, _ = await chat(proxy.url, convo)
        await settle(proxy)
        assert len(committed(cache)) == 1

        received = b""
        async with aiohttp.ClientSession() as s:
            body = {"messages": first_turn(32, n_facts=20), "stream": True, "max_tokens": 400}
            async with s.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                received += await resp.content.readline()
                servers[0].kill()
                # A complete response (no ClientPayloadError) whose last event is the error.
                async for chunk in resp.content.iter_any():
                    received += chunk
        assert b'"error"' in received and b"broke off" in received
        assert b"[DONE]" not in received

        async with (
            aiohttp.ClientSession() as s,
            s.post(proxy.url + "/v1/chat/completions", json={"messages": convo}) as resp,
        ):
            assert resp.status == 502  # down: a clean error, and the proxy is still here

        servers.append(start_real_server(cache, port=port))
        reply2, headers = await chat(proxy.url, next_turn(convo, reply1, "And fact 5?"))
        # The slot that held the conversation is empty after the restart: kvproxy noticed
        # and restored it from disk instead of trusting the slot.
        assert headers["X-KVProxy-Cache"] == "restored"
        assert reuse([reply2]) > 0.8
        other, _ = await chat(proxy.url, first_turn(33, n_facts=5))  # asserts a 200 itself
        assert other["choices"][0]["message"]["content"] is not None
    finally:
        await proxy.stop()
        for server in servers:
            server.stop()
