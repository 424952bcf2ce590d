"""A repeated fault in work nobody waits for (a full disk under Store.touch_async, housekeeping,
habits written out) is logged once when it starts and once when it ends, never as one
"Task exception was never retrieved" traceback per request; metrics and /kvproxy/stats show it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sqlite3
from typing import Any

import aiohttp
import pytest

from kvproxy.cache.reports.faults import Faults
from kvproxy.cache.servers.leases import Background
from kvproxy.edge.app import SERVICE
from kvproxy.store import Store

from .conftest import Maker
from .test_cache import chat, conv, settle, then

FULL = "database or disk is full"


async def full_disk() -> None:
    raise sqlite3.OperationalError(FULL)


async def fine() -> None:
    return None


async def touch_async(self: Store, key: str, hits: int = 1) -> None:
    """Store.touch_async on a full disk."""
    await asyncio.sleep(0)
    raise sqlite3.OperationalError(FULL)


def never_retrieved(loop: asyncio.AbstractEventLoop) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    return seen


async def test_background_tasks_are_owned_and_a_fault_is_logged_once_per_change(
    caplog: pytest.LogCaptureFixture,
) -> None:
    unowned = never_retrieved(asyncio.get_running_loop())
    background = Background(Faults())
    caplog.set_level(logging.INFO, logger="kvproxy")
    for _ in range(64):
        background.spawn(full_disk(), "Store.touch_async")
    await background.wait()
    background.spawn(fine(), "Store.touch_async")
    await background.wait()
    for _ in range(5):
        background.spawn(full_disk(), "Store.touch_async")
    await background.wait()
    gc.collect()
    await asyncio.sleep(0)
    assert not unowned
    lines = [r.getMessage() for r in caplog.records if "Store.touch_async" in r.getMessage()]
    assert len(lines) == 3, lines  # fails, recovers, fails again
    assert FULL in lines[0] and "recovered" in lines[1] and "64 errors" in lines[1]
    assert background.faults.summary() == {"Store.touch_async": (True, 69)}


async def test_a_full_disk_under_touch_floods_no_log_and_is_shown(
    make: Maker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    unowned = never_retrieved(asyncio.get_running_loop())

    monkeypatch.setattr(Store, "touch_async", touch_async)
    caplog.set_level(logging.INFO, logger="kvproxy")
    fake, proxy = await make()
    replies = {}
    for c in (1, 2, 3):
        _, replies[c], _ = await chat(proxy, conv(c))
    await settle(proxy)
    restored = 0
    for turn in range(4):  # each conversation evicts another, then comes back restored
        for c in (1, 2, 3):
            status, replies[c], h = await chat(proxy, then(conv(c), replies[c], f"q{turn}"))
            assert status == 200
            restored += h["X-KVProxy-Cache"] == "restored"
            await settle(proxy)
    assert restored >= 4
    gc.collect()
    await asyncio.sleep(0)
    assert not [u for u in unowned if "never retrieved" in str(u.get("message"))]
    about = [r for r in caplog.records if FULL in r.getMessage()]
    assert len(about) == 1, [r.getMessage() for r in about]
    assert "\n" not in about[0].getMessage() and not about[0].exc_info
    stats = proxy.stats()
    assert FULL in stats["faults"]["touch_async"]
    # /health is still the server's answer, and names what fails.
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/health") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ok"
        assert resp.headers["X-KVProxy-Faults"] == "touch_async"
    exposition = proxy.app[SERVICE].metrics.exposition().decode()
    assert 'kvproxy_background_failing{kind="touch_async"} 1.0' in exposition
    assert f'kvproxy_background_errors_total{{kind="touch_async"}} {restored}.0' in (exposition)
