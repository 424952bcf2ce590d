"""GET /metrics (Prometheus) and GET /kvproxy/stats: the same numbers, matching what happened."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvproxy.obs.metrics import quantile

from .conftest import NOT_ENTRIES, Maker, RunningProxy, start_proxy
from .test_cache import actions, chat, conv, settle, then

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(proxy: RunningProxy, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(proxy.url + "/metrics", headers=headers or {}) as r,
    ):
        return r.status, await r.text()


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lb), v in samples.items()
        if n == name and all(dict(lb).get(k) == want for k, want in labels.items())
    )


async def stats(proxy: RunningProxy) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/kvproxy/stats") as r:
        body: dict[str, Any] = await r.json()
        return body


async def until_requests(proxy: RunningProxy, n: int) -> Samples:
    """Metrics once `n` requests are counted (events land just after each reply)."""
    for _ in range(300):
        await settle(proxy)
        samples = parse((await scrape(proxy))[1])
        if total(samples, "kvproxy_requests_total") >= n:
            return samples
        await asyncio.sleep(0.01)
    raise AssertionError("requests were not counted")


async def test_metrics_match_what_happened(make: Maker) -> None:
    fake, proxy = await make({"prompt_delay": 0.0002})  # prefill costs: the saving shows
    replies, bodies = {}, []
    for c in (1, 2, 3):  # three misses; conversation 1 is saved to make room for 3
        _, replies[c], _ = await chat(proxy, conv(c))
        bodies.append(replies[c])
    await settle(proxy)
    _, body, h = await chat(proxy, then(conv(1), replies[1]))
    assert h["X-KVProxy-Cache"] == "restored"
    bodies.append(body)
    restore_ms = float(h["X-KVProxy-Restore-Ms"])
    _, body, h = await chat(proxy, then(conv(3), replies[3]))
    assert h["X-KVProxy-Cache"] == "resident"
    bodies.append(body)
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/v1/models") as r:
        assert r.status == 200  # plain pass-through: not a cache request
    s_ = await until_requests(proxy, 5)

    assert total(s_, "kvproxy_requests_total", decision="miss") == 3
    assert total(s_, "kvproxy_requests_total", decision="restored") == 1
    assert total(s_, "kvproxy_requests_total", decision="resident") == 1
    assert total(s_, "kvproxy_requests_total", route="/v1/chat/completions", status="2xx") == 5
    saves, restores = actions(fake, "save"), actions(fake, "restore")
    assert len(restores) == 1
    assert total(s_, "kvproxy_slot_actions_total", action="restore", result="ok") == 1
    assert total(s_, "kvproxy_slot_actions_total", action="save", result="ok") == len(saves)
    assert total(s_, "kvproxy_slot_action_seconds_count", action="restore") == 1
    assert total(s_, "kvproxy_slot_action_tokens_total", action="restore") == int(
        h_restored := proxy.stats()["restored_tokens"]
    )
    assert h_restored > 300
    assert (
        total(s_, "kvproxy_slot_action_bytes_sum", action="save") == (proxy.stats()["saved_bytes"])
    )

    cache_n = sum(b["timings"]["cache_n"] for b in bodies)
    prompt_n = sum(b["timings"]["prompt_n"] for b in bodies)
    # Cached tokens priced at the cold misses' prefill speed, less the restore's time.
    cold = [b["timings"] for b in bodies[:3]]
    rate = sum(t["prompt_ms"] for t in cold) / sum(t["prompt_n"] for t in cold)
    saved = sum(
        max(b["timings"]["cache_n"] * rate - (restore_ms if n == 3 else 0), 0) / 1000
        for n, b in enumerate(bodies)
    )
    assert cache_n > 600 and saved > 0.05
    assert total(s_, "kvproxy_tokens_cached_total") == cache_n
    assert total(s_, "kvproxy_tokens_prefilled_total") == prompt_n
    assert total(s_, "kvproxy_prefill_seconds_saved_total") == pytest.approx(saved, rel=1e-3)
    assert total(s_, "kvproxy_request_seconds_count") == 5
    assert total(s_, "kvproxy_queue_wait_seconds_count") == 5

    store = proxy.cache.store
    entries = [p for p in store.root.iterdir() if not p.name.startswith(NOT_ENTRIES)]
    on_disk = sum(p.stat().st_size for p in entries)
    assert total(s_, "kvproxy_cache_entries") == len(store.entries) >= 1
    assert total(s_, "kvproxy_cache_bytes") == store.total_bytes == on_disk
    assert total(s_, "kvproxy_queue_depth") == 0
    assert total(s_, "kvproxy_slots") == 2
    assert total(s_, "kvproxy_evictions_total") == proxy.stats()["evictions"]
    assert total(s_, "kvproxy_miss_explained_total") == 0  # three unrelated conversations

    # /kvproxy/stats carries the same numbers.
    js = await stats(proxy)
    assert js["requests"] == {"resident": 1, "restored": 1, "miss": 3, "bypass": 0, "busy": 0}
    assert js["restores"] == 1 and js["saves"] == len(saves)
    assert js["tokens_cached"] == js["cache_n"] == cache_n
    assert js["tokens_prefilled"] == prompt_n
    assert js["prefill_seconds_saved"] == pytest.approx(saved, rel=1e-3)
    assert js["restored_tokens"] == h_restored
    assert js["entries"] == len(store.entries) and js["disk_bytes"] == on_disk
    assert js["histograms"]["restore_seconds"]["count"] == 1
    assert js["histograms"]["request_seconds"]["count"] == 5
    assert js["histograms"]["request_seconds"]["sum"] == pytest.approx(
        total(s_, "kvproxy_request_seconds_sum")
    )
    assert js["histograms"]["request_seconds"]["p50"] is not None
    assert js["miss_explained"] == 0


async def test_bypass_and_ineffective_restores_are_counted(make: Maker) -> None:
    fake, proxy = await make(server={"reuse": "none"})
    replies = {c: (await chat(proxy, conv(c)))[1] for c in range(1, 6)}
    await settle(proxy)
    for c in range(1, 4):  # restored, but the server reuses none of it
        _, _, h = await chat(proxy, then(conv(c), replies[c]))
        assert h["X-KVProxy-Cache"] == "restored"
    _, _, h = await chat(proxy, conv(9), n=2)  # not keyable: bypass
    assert h["X-KVProxy-Cache"] == "bypass"
    s_ = await until_requests(proxy, 9)
    assert total(s_, "kvproxy_requests_total", decision="bypass") == 1
    assert total(s_, "kvproxy_ineffective_restores_total") == 3
    assert (await stats(proxy))["ineffective_restores"] == 3


async def test_explained_misses_are_counted(make: Maker) -> None:
    fake, proxy = await make()
    prompt = "You are a helpful agent. Request id: {}. Follow the repository's rules."
    await chat(proxy, [{"role": "system", "content": prompt.format("a1b2")}])
    await chat(proxy, [{"role": "system", "content": prompt.format("c3d4")}])
    s_ = await until_requests(proxy, 2)
    for _ in range(100):
        if total(s_, "kvproxy_miss_explained_total") == 1:
            break
        await asyncio.sleep(0.01)
        s_ = parse((await scrape(proxy))[1])
    assert total(s_, "kvproxy_miss_explained_total", source="slot") == 1
    assert (await stats(proxy))["miss_explained"] == 1


async def test_metrics_need_the_admin_token_off_loopback(make: Maker, tmp_path: Path) -> None:
    fake, proxy = await make()
    status, text = await scrape(proxy)
    assert status == 200 and "kvproxy_requests" in text
    exposed = await start_proxy(fake.url, tmp_path / "c2", host="0.0.0.0", admin_token="s3cret")
    try:
        assert (await scrape(exposed))[0] == 401
        assert (await scrape(exposed, {"Authorization": "Bearer nope"}))[0] == 401
        status, text = await scrape(exposed, {"Authorization": "Bearer s3cret"})
        assert status == 200 and parse(text)
    finally:
        await exposed.stop()
    assert not [r for r in fake.requests if r[1] == "/metrics"]  # never reaches the server


def test_quantile_interpolates_like_prometheus() -> None:
    inf = float("inf")
    assert quantile([(1.0, 0.0), (inf, 0.0)], 0.5) is None
    assert quantile([(1.0, 2.0), (2.0, 4.0), (inf, 4.0)], 0.5) == 1.0
    assert quantile([(1.0, 0.0), (2.0, 4.0), (inf, 4.0)], 0.5) == 1.5
    assert quantile([(1.0, 0.0), (inf, 3.0)], 0.5) == 1.0
