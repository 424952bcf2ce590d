"""Restore only when it pays (cache/decisions/payoff.py): the rule on plain data, the read rate a
server's restores measure (cache/servers/pace.py), and the proxy prefilling when told its disk is slow."""

from __future__ import annotations

from typing import Any

from kvproxy.cache.decisions.payoff import (
    MARGIN,
    RestoreChoice,
    RestoreCost,
    choose_restore,
    tokens_back,
)
from kvproxy.cache.reports.events import SlotActionEvent
from kvproxy.cache.servers.pace import Pace

from .conftest import Maker
from .test_cache import chat, conv, settle, then

GiB = 1 << 30


def test_no_measured_rate_restores_as_before() -> None:
    for read, prefill in ((None, 100.0), (500e6, None), (None, None)):
        assert choose_restore(RestoreCost(GiB, 8000, read, prefill)) is RestoreChoice.UNMEASURED


def test_a_whole_8b_state_from_a_local_disk_is_restored() -> None:
    """8k tokens of an 8B (1 GiB) at 450 MB/s: ~2.4 s of read against minutes of prefill."""
    assert choose_restore(RestoreCost(GiB, 8192, 450e6, 40.0)) is RestoreChoice.RESTORE


def test_a_short_shared_prefix_inside_a_huge_state_is_prefilled() -> None:
    """A new session sharing 300 tokens of a 4 GiB state, on a GPU prefilling 3,000 tok/s."""
    cost = RestoreCost(4 * GiB, 300, 1.4e9, 3000.0)
    assert choose_restore(cost) is RestoreChoice.PREFILL


def test_a_slow_disk_makes_prefill_pay() -> None:
    slow = RestoreCost(GiB, 8192, 5e6, 300.0)  # a network share at 5 MB/s: 215 s to read
    assert choose_restore(slow) is RestoreChoice.PREFILL
    assert choose_restore(RestoreCost(GiB, 8192, 500e6, 300.0)) is RestoreChoice.RESTORE


def test_a_close_call_restores() -> None:
    """Prefill must be estimated cheaper by the margin: near even, the read goes on."""
    read_s = 10.0
    tokens = 1000
    at_margin = RestoreCost(int(read_s * 1e8), tokens, 1e8, tokens * MARGIN / read_s * 0.99)
    assert choose_restore(at_margin) is RestoreChoice.RESTORE
    beyond = RestoreCost(int(read_s * 1e8), tokens, 1e8, tokens * MARGIN / read_s * 1.01)
    assert choose_restore(beyond) is RestoreChoice.PREFILL


def test_tokens_back_counts_the_whole_state_when_the_request_goes_on_from_it() -> None:
    msgs = [{"role": "user", "content": "hi"}] * 4
    assert tokens_back(5000, 4, 4, msgs, {}) == 5000
    assert tokens_back(5000, 5, 4, msgs, {}) == 5000


def test_tokens_back_of_a_shared_prefix_counts_from_above() -> None:
    """Never fewer than the shared text could tokenise to (one token a UTF-8 byte at most),
    never more than the state holds."""
    system = {"role": "system", "content": "é" * 200}  # 400 bytes of UTF-8
    msgs = [system, {"role": "user", "content": "x" * 10_000}]
    got = tokens_back(50_000, 1, 10, msgs, {"tools": []})
    assert 400 <= got < 1000
    assert tokens_back(300, 1, 10, msgs, {}) == 300


def test_pace_measures_reads_from_big_restores_only() -> None:
    pace = Pace()
    assert pace.read_bytes_per_s is None
    pace.acted(SlotActionEvent("restore", True, 40, 1 << 20, 0.001))  # 1 MiB: latency
    assert pace.read_bytes_per_s is None
    pace.acted(SlotActionEvent("restore", True, 8000, GiB, 2.0))
    pace.acted(SlotActionEvent("restore", False, 8000, GiB, 9.0))  # failed: not a rate
    pace.acted(SlotActionEvent("save", True, 8000, GiB, 4.0))  # a write
    assert pace.read_bytes_per_s == GiB / 2.0


def _told(proxy: Any, read_bytes_per_s: float | None, tokens_per_s: float) -> None:
    """What the lane would have measured: restores at `read_bytes_per_s`, prefills at
    `tokens_per_s`."""
    lane = proxy.cache.lane
    if read_bytes_per_s is not None:
        lane.pace.acted(SlotActionEvent("restore", True, 1000, GiB, GiB / read_bytes_per_s))
    proxy.cache.events.rates.observe(lane.backend.name, 0, 1000, 1000 / tokens_per_s * 1000)


async def test_a_slow_disk_prefills_a_returning_conversation(make: Maker) -> None:
    """Told its disk reads 1 KB/s and its server prefills 1M tokens/s, kvproxy leaves the state
    on disk: the conversation is answered uncached, the entry kept, the choice counted."""
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    [entry] = proxy.cache.store.entries.values()
    _told(proxy, 1e3, 1e6)
    status, body, h = await chat(proxy, then(conv(1), r[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["choices"][0]["message"]["content"] == "Echo: next question"
    assert not [a for a in fake.actions if a[0] == "restore"]
    assert entry.key in proxy.cache.store.entries
    assert proxy.stats()["prefills_over_restores"] == 1


async def test_a_fast_disk_still_restores(make: Maker) -> None:
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    _told(proxy, 1e12, 10.0)
    _, _, h = await chat(proxy, then(conv(1), r[1]))
    assert h["X-KVProxy-Cache"] == "restored"
    assert proxy.stats()["prefills_over_restores"] == 0
