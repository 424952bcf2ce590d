"""The status page (`/kvproxy/`) and what it polls (`/kvproxy/status.json`): the slots, the
last requests with their decisions, weak hits and explained misses, the last hour, the disk;
rendered by a real headless chromium against a proxy with traffic (the fake llama-server
here; tests/test_real_status_page.py has a real one)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.reports.events import MissExplanation, RequestEvent
from kvproxy.obs.recent import RECENT_REQUESTS, Recent

from .browser import dump_dom, screenshot
from .conftest import Maker, RunningProxy, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then
from .test_readable import big_entry


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, headers=headers or {}, allow_redirects=False) as r,
    ):
        return r.status, await r.text(), r.headers


async def status_json(proxy: RunningProxy) -> dict[str, Any]:
    status, text, _ = await get(proxy.url + "/kvproxy/status.json")
    assert status == 200
    body: dict[str, Any] = orjson.loads(text)
    return body


async def traffic(proxy: RunningProxy) -> None:
    """Three misses (two slots: one is saved), a restore, a resident turn, and a miss the
    cache explains (a system prompt that differs only by a request id)."""
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    assert (await chat(proxy, then(conv(1), replies[1])))[2]["X-KVProxy-Cache"] == "restored"
    assert (await chat(proxy, then(conv(3), replies[3])))[2]["X-KVProxy-Cache"] == "resident"
    prompt = "You are a helpful agent. Request id: {}. Follow the repository's rules."
    await chat(proxy, [{"role": "system", "content": prompt.format("a1b2")}])
    await chat(proxy, [{"role": "system", "content": prompt.format("c3d4")}])
    for _ in range(300):
        await settle(proxy)
        if proxy.stats()["miss_explained"]:
            return
    raise AssertionError("the miss was not explained")


async def test_status_json_shows_slots_requests_and_the_hour(make: Maker) -> None:
    fake, proxy = await make()
    await traffic(proxy)
    body = await status_json(proxy)
    assert [s["id"] for s in body["slots"]] == [0, 1]
    held = [s for s in body["slots"] if s["key"]]
    assert held and all(s["n_tokens"] > 0 and s["idle_s"] is not None for s in held)
    assert all(s["action"] is None and not s["busy"] for s in body["slots"])
    decisions = [r["decision"] for r in body["recent"]]
    assert decisions[::-1][:5] == ["miss", "miss", "miss", "restored", "resident"]
    assert body["recent"][0]["at"] >= body["recent"][-1]["at"]  # newest first
    restored = next(r for r in body["recent"] if r["decision"] == "restored")
    assert restored["cached"] > 0 and restored["prefilled"] is not None
    [miss] = [r for r in body["reasons"] if r["kind"] == "miss"]
    assert "diverged from slot" in miss["why"] and "a1b2" in miss["why"]
    hour = body["last_hour"]
    assert hour["requests"] == 7 and hour["hits"] == 2
    assert 0 < hour["hit_rate"] < 1 and 0 < hour["cached_share"] < 1
    assert body["disk_bytes"] > 0 and body["disk_budget_bytes"] == proxy.cache.store.max_bytes
    assert body["requests_total"] == 7
    # A tenant (here the client's API key) is shown as a prefix of its hash, never the key.
    await chat(proxy, conv(8), headers={"Authorization": "Bearer alice-key"})
    await settle(proxy)
    tenants = [s["tenant"] for s in (await status_json(proxy))["slots"] if s["tenant"]]
    assert len(tenants) == 1 and re.fullmatch("[0-9a-f]{8}", tenants[0])
    assert "alice" not in (await get(proxy.url + "/kvproxy/status.json"))[1]


async def test_with_tenants_reasons_say_where_texts_part_never_what_they_say(
    make: Maker,
) -> None:
    """With client API keys the page (for the admin token only) still explains misses and
    weak hits, by message and character, but quotes no tenant's prompt: the page shows
    every tenant's requests, and who reads it is not each of them."""
    fake, proxy = await make(client_api_keys="alice,bob", admin_token="root")
    alice = {"Authorization": "Bearer alice"}
    prompt = "You are a helpful agent. Request id: {}. Follow the repository's rules."
    for rid in ("q1w2", "x3z4"):  # not hex: never found in a key by chance
        await chat(proxy, [{"role": "system", "content": prompt.format(rid)}], headers=alice)
    for _ in range(300):
        await settle(proxy)
        if proxy.stats()["miss_explained"]:
            break
    status, text, _ = await get(
        proxy.url + "/kvproxy/status.json", {"Authorization": "Bearer root"}
    )
    assert status == 200
    [miss] = [r for r in orjson.loads(text)["reasons"] if r["kind"] == "miss"]
    assert miss["why"] == "diverged from slot 0 at message 0, char 37"
    for secret in ("q1w2", "x3z4", "Request id", "helpful agent"):
        assert secret not in text


async def test_the_page_is_one_self_contained_file(make: Maker) -> None:
    fake, proxy = await make()
    status, _, headers = await get(proxy.url + "/kvproxy")
    assert status == 302 and headers["Location"] == "/kvproxy/"
    status, html, headers = await get(proxy.url + "/kvproxy/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    policy = headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "unsafe-inline" not in policy
    assert policy.count("'sha256-") == 2  # the page's one script and one style, by hash
    # Nothing from elsewhere: no external script, style, image or font; works offline.
    assert not re.search(r"""(src|href)\s*=|@import|url\(|//[a-z]""", html, re.I)
    # Client text (keys, routes, miss excerpts) is only ever written as text.
    assert "innerHTML" not in html and "insertAdjacentHTML" not in html
    assert 'aria-live="polite"' in html and '<th scope="col">' in html
    assert len(html) < 12_000


async def test_the_page_has_the_stats_access_rule(make: Maker, tmp_path: Path) -> None:
    fake, _ = await make()
    exposed = await start_proxy(fake.url, tmp_path / "c2", host="0.0.0.0", admin_token="s3cret")
    try:
        for path in ("/kvproxy/", "/kvproxy/status.json"):
            assert (await get(exposed.url + path))[0] == 401
            ok = await get(exposed.url + path, {"Authorization": "Bearer s3cret"})
            assert ok[0] == 200
    finally:
        await exposed.stop()


def test_recent_requests_are_bounded_and_the_hour_slides() -> None:
    now = [10_000.0]
    recent = Recent(clock=lambda: now[0])
    miss = MissExplanation(1, 4, "abc", "abd", "disk")
    recent.on_request(RequestEvent("/v1/chat/completions", Decision.MISS, 200, "k" * 16, miss=miss))
    for n in range(RECENT_REQUESTS + 5):
        recent.on_request(
            RequestEvent(
                "/v1/chat/completions",
                Decision.RESIDENT,
                200,
                f"{n:016x}",
                cache_n=90,
                prompt_n=10,
                prompt_ms=20.0,
                prefill_saved_s=0.18,
                weak="the server reused less" if n == 0 else None,
            )
        )
    recent.on_request(RequestEvent("/v1/models", Decision.BYPASS, 200))
    snap = recent.snapshot()
    assert len(snap["recent"]) == RECENT_REQUESTS and snap["recent"][0]["decision"] == "bypass"
    assert [r["kind"] for r in snap["reasons"]] == ["weak hit", "miss"]
    assert snap["reasons"][1]["why"] == 'diverged from disk at message 1, char 4: "abc" vs "abd"'
    quiet = Recent(excerpts=False)  # clients are tenants: where, never what
    quiet.on_request(RequestEvent("/v1/chat/completions", Decision.MISS, 200, "k" * 16, miss=miss))
    weak = RequestEvent("/v1/chat/completions", Decision.RESIDENT, 200, "k" * 16, weak=miss)
    quiet.on_request(weak)
    assert [r["why"] for r in quiet.snapshot()["reasons"]] == 2 * [
        "diverged from disk at message 1, char 4"
    ]
    hour = snap["last_hour"]
    assert hour["requests"] == RECENT_REQUESTS + 6 and hour["hits"] == RECENT_REQUESTS + 5
    assert hour["cached_share"] == 0.9
    assert abs(hour["prefill_seconds_saved"] - (RECENT_REQUESTS + 5) * 0.18) < 1e-6
    now[0] += 3700  # an hour later, the totals are gone; the last requests stay listed
    snap = recent.snapshot()
    assert snap["last_hour"]["requests"] == 0 and snap["last_hour"]["hit_rate"] is None
    assert len(snap["recent"]) == RECENT_REQUESTS
    assert len(recent.minutes) <= 61


async def test_status_page_in_headless_chromium(make: Maker, tmp_path: Path) -> None:
    fake, proxy = await make()
    await traffic(proxy)
    dom, slots = await dump_settled(proxy)
    text = visible_text(dom)
    assert "Cannot reach" not in text and "Updated " in text
    for slot in slots:
        if slot["key"]:
            assert slot["key"][:12] in text  # each slot's conversation, by key prefix
    for decision in ("miss", "restored", "resident"):
        assert re.search(rf"<td class=\"d-{decision}\">{decision}</td>", dom), decision
    assert "diverged from slot" in text  # the explained miss, with its reason
    assert "28.6 %" in text  # hit rate: 2 of 7
    await screenshot(proxy.url + "/kvproxy/", tmp_path / "status.png")


async def dump_settled(proxy: RunningProxy) -> tuple[str, list[dict[str, Any]]]:
    """The page's DOM and the slots it shows: dumped again if background work (a save
    under slot pressure rewrites a slot's key and tokens) changed them meanwhile."""

    def held() -> list[dict[str, Any]]:
        return [{k: s[k] for k in ("id", "key", "n_tokens")} for s in proxy.stats()["slots"]]

    for _ in range(5):
        await settle(proxy)
        slots = held()
        dom = await dump_dom(proxy.url + "/kvproxy/")
        if held() == slots:
            return dom, slots
    raise AssertionError("the slots never held still")


def visible_text(dom: str) -> str:
    """The rendered body's text, without the page's own script."""
    body = dom.split("<script>")[0]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))


def test_the_readme_shows_the_status_page() -> None:
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert "](docs/img/status.png)" in readme and (root / "docs/img/status.png").stat().st_size
    assert len(readme.splitlines()) < 250


async def test_a_save_and_a_restore_under_way_are_shown(make: Maker) -> None:
    fake, proxy = await make()
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2)}
    await settle(proxy)
    fake.action_delay = 0.4  # every slot save and restore now takes a while
    seen: set[str] = set()

    async def watch() -> None:
        while True:
            body = await status_json(proxy)
            seen.update(s["action"] for s in body["slots"] if s["action"])
            await asyncio.sleep(0.02)

    watcher = asyncio.create_task(watch())
    try:
        await chat(proxy, conv(3))  # a third conversation: one of the two is saved first
        await settle(proxy)
        _, _, h = await chat(proxy, then(conv(1), replies[1]))
    finally:
        watcher.cancel()
    assert h["X-KVProxy-Cache"] == "restored"
    assert seen == {"saving", "restoring"}
    await settle(proxy)
    assert all(s["action"] is None for s in (await status_json(proxy))["slots"])


async def test_the_page_names_the_server_its_model_and_why_a_slot_is_not_saved(
    make: Maker,
) -> None:
    """A conversation under --min-tokens is never saved: its slot says why, not "not yet";
    the page names the server, its model, the mode and the settings that decide saving."""
    fake, proxy = await make(min_tokens=256)
    status, _, _ = await chat(proxy, [{"role": "user", "content": "hi"}])
    assert status == 200
    dom, slots = await dump_settled(proxy)
    text = visible_text(dom)
    assert [s["key"] is not None for s in slots].count(True) == 1
    assert "no: under --min-tokens (256)" in text and "not yet" not in text
    [backend] = proxy.stats()["backends"]
    assert backend["model"] and f"llama-server {backend['name']} ({backend['model']})" in text
    assert "sidecar · --min-tokens 256 · --idle-save-after" in text, text


async def test_the_page_reads_big_states_and_short_times(tmp_path: Path) -> None:
    """A cache dir holding an 8B model's 8k-token state under `--max-disk 50GiB`: the page
    says GiB; a request of a few milliseconds keeps its tenths, as the log says it."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    await asyncio.to_thread(big_entry, cache)
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    proxy = await start_proxy(fake.url, cache, max_disk=50 * 1024**3)
    try:
        await chat(proxy, conv(1))
        dom, _ = await dump_settled(proxy)
        text = visible_text(dom)
        assert "1.2 GiB in 1 entries of 50.0 GiB (--max-disk)" in text
        assert re.search(r"\b\d\.\d ms\b", text), "a request under 10 ms, in tenths"
    finally:
        await proxy.stop()
        await fake.stop()
