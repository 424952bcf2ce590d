"""Restores on a real llama-server: the checksum checked beside the server's read, and the
pay-off rule prefilling instead when the measured disk is slow."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvproxy_bench.dialogues import first_turn

from kvproxy.cache.reports.events import SlotActionEvent

from .conftest import committed, start_proxy, start_real_server
from .test_cache import settle
from .test_real_cache import chat, next_turn

pytestmark = pytest.mark.real

GiB = 1 << 30


async def test_restores_pass_the_check_and_a_slow_disk_prefills(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    server = start_real_server(cache)  # 2 slots
    proxy = await start_proxy(server.url, cache, min_tokens=16, write_through=True)
    try:
        convos = {c: first_turn(40 + c, n_facts=12) for c in (1, 2, 3, 4)}
        replies = {}
        for c in (1, 2, 3):
            replies[c], _ = await chat(proxy.url, convos[c])
            await settle(proxy)
        # 1 was pushed out by 2 and 3: its checked state comes back, and is reused.
        again, headers = await chat(proxy.url, next_turn(convos[1], replies[1], "And fact 4?"))
        assert headers["X-KVProxy-Cache"] == "restored"
        assert again["timings"]["cache_n"] > 0
        await settle(proxy)
        # 2 is on disk only now (1 and 3 hold the slots). Told the disk reads 1 KB/s and the
        # server prefills a million tokens a second, kvproxy prefills 2 instead.
        lane = proxy.cache.lane
        lane.pace.acted(SlotActionEvent("restore", True, 1000, GiB, GiB / 1e3))
        proxy.cache.events.rates.observe(lane.backend.name, 0, 1000, 1.0)
        files = committed(cache)
        back, headers = await chat(proxy.url, next_turn(convos[2], replies[2], "And fact 4?"))
        assert headers["X-KVProxy-Cache"] == "miss"
        assert back["choices"][0]["message"]["content"]
        assert back["timings"]["prompt_n"] > 100, "prefilled, not restored"
        assert proxy.stats()["prefills_over_restores"] == 1
        assert files <= committed(cache), "the state stays on disk"
    finally:
        await proxy.stop()
        server.stop()
