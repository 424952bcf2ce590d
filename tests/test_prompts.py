"""Text-completion routes (`/completion`, `/v1/completions`) cached like chats, against the
fake server: each prompt goes to the slot holding its longest common prefix (as the server
alone would choose), comes back from disk after an eviction and a restart, stays apart
from other tenants, and is labelled truthfully."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy.edge.app import SERVICE

from .conftest import Maker, RunningProxy, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import settle
from .test_openings import as_class

ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}


def prompt(name: str) -> str:
    return f"Document {name}.\n" + f"{name} says something long. " * 60


async def complete(
    url: str, text: str, route: str = "/completion", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any], str]:
    field = "n_predict" if route == "/completion" else "max_tokens"
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + route, json={"prompt": text, field: 4}, headers=headers) as r,
    ):
        return r.status, await r.json(), r.headers.get("X-KVProxy-Cache", "")


def cache_n(body: dict[str, Any]) -> int:
    return int(body["timings"]["cache_n"])


async def restarted(fake: FakeLlamaServer, proxy: RunningProxy) -> RunningProxy:
    """kvproxy restarts, and the server's slots are wiped (it restarted too)."""
    await settle(proxy)
    await proxy.stop()
    for slot in fake.slots:
        slot.tokens = []
    return await start_proxy(fake.url, fake.save_dir)


async def test_the_same_prompt_twice_reuses_it_all_as_the_server_alone_does(make: Maker) -> None:
    fake, proxy = await make()
    text = prompt("A")
    _, first, label1 = await complete(proxy.url, text)
    await settle(proxy)
    _, again, label2 = await complete(proxy.url, text)
    assert (label1, label2) == ("miss", "resident")
    # Every prompt token but the last one the server must evaluate again.
    assert cache_n(again) >= first["timings"]["prompt_n"] - 1
    slots = [b["id_slot"] for _, p, b in fake.requests if p == "/completion"]
    assert slots[0] == slots[1]


async def test_two_prompts_alternating_each_keep_their_slot(make: Maker) -> None:
    fake, proxy = await make()
    a, b = prompt("A"), prompt("B")
    for text in (a, b):
        await complete(proxy.url, text)
        await settle(proxy)
    for _ in range(2):
        for text in (a, b):
            status, body, label = await complete(proxy.url, text + " and more")
            await settle(proxy)
            assert status == 200 and label == "resident"
            assert body["timings"]["prompt_n"] <= 20, body["timings"]


async def test_openai_completions_share_the_prompt_cache(make: Maker) -> None:
    fake, proxy = await make()
    text = prompt("A")
    await complete(proxy.url, text, "/v1/completions")
    await settle(proxy)
    status, body, label = await complete(proxy.url, text + " more", "/v1/completions")
    assert status == 200 and label == "resident"
    assert body["usage"]["prompt_tokens"] - cache_n(body) <= 20


async def test_an_evicted_prompt_comes_back_from_disk_and_after_a_restart(
    make: Maker,
) -> None:
    fake, proxy = await make()
    texts = [prompt(n) for n in "ABC"]
    for text in texts:  # three prompts on two slots: A's slot is given to C, A saved first
        await complete(proxy.url, text)
        await settle(proxy)
    status, body, label = await complete(proxy.url, texts[0] + " again")
    assert status == 200 and label == "restored"
    assert body["timings"]["prompt_n"] <= 20, body["timings"]
    proxy = await restarted(fake, proxy)
    try:
        status, body, label = await complete(proxy.url, texts[1] + " again")
        assert status == 200 and label == "restored", label
        assert body["timings"]["prompt_n"] <= 20, body["timings"]
    finally:
        await proxy.stop()


async def test_another_tenants_identical_prompt_reuses_nothing(make: Maker) -> None:
    fake, proxy = await make(client_api_keys="alice,bob")
    text = prompt("secret")
    await complete(proxy.url, text, headers=ALICE)
    await settle(proxy)
    status, body, label = await complete(proxy.url, text, headers=BOB)
    assert status == 200 and label == "miss"
    assert cache_n(body) == 0
    await settle(proxy)
    status, body, label = await complete(proxy.url, text, headers=ALICE)
    assert label in ("resident", "restored")
    assert cache_n(body) > 0


async def test_an_editor_back_at_a_line_restores_the_state_saved_further_along_it(
    make: Maker,
) -> None:
    """FIM in an editor on a sliding-window model: completions at three cursor positions
    on one line (each prompt the one before plus what was typed), then a restart; the first
    position comes again. Its own state was never saved (the slot went on from it), but the
    state saved further along the line parts from it near its end, within the window the
    server serves after a restore: restored, not prefilled again."""
    fake, proxy = await make({"reuse": "window", "window": 512, "n_ctx": 16384})
    as_class(proxy, "swa", 1024)
    line = prompt("file") + "\nresult = compute("
    cursors = [line, line + "alpha, beta", line + "alpha, beta, gamma=3"]
    for text in cursors:
        status, _, _ = await complete(proxy.url, text, "/v1/completions")
        assert status == 200
    proxy = await restarted(fake, proxy)
    try:
        as_class(proxy, "swa", 1024)
        status, body, label = await complete(proxy.url, cursors[0], "/v1/completions")
        assert status == 200 and label == "restored", label
        assert body["usage"]["prompt_tokens"] - cache_n(body) <= 20, body["timings"]
    finally:
        await proxy.stop()


async def test_with_write_through_every_completion_comes_back_whole_after_a_restart(
    make: Maker,
) -> None:
    """An editor's completions on one line, each prompt its cursor's prefix, then the text
    after the cursor (as llama.vscode's OpenAI mode sends them). Write-back keeps only the
    last one's state (the slot went on from the others); --write-through saves each after
    its reply, so after a restart each earlier cursor comes back with nothing to prefill
    but the last token."""
    fake, proxy = await make(write_through=True)
    line = prompt("file") + "\nresult = compute("
    after = "<|fim_suffix|>)\n" + "print(result) " * 12 + "<|fim_middle|>"
    cursors = [line + typed + after for typed in ("", "alpha, beta", "alpha, beta, gamma=3")]
    for text in cursors:
        status, _, _ = await complete(proxy.url, text, "/v1/completions")
        assert status == 200
    await settle(proxy)
    assert len(proxy.cache.store.entries) == 3
    proxy = await restarted(fake, proxy)
    try:
        for text in cursors:
            status, body, label = await complete(proxy.url, text, "/v1/completions")
            assert status == 200 and label == "restored", label
            assert body["usage"]["prompt_tokens"] - cache_n(body) <= 1, body["timings"]
    finally:
        await proxy.stop()


async def test_write_back_keeps_the_last_completion_of_a_line_only(make: Maker) -> None:
    """The same line without --write-through: the earlier cursors' own states are gone,
    and each comes back from a state that parts from it before the text after its cursor."""
    fake, proxy = await make()
    line = prompt("file") + "\nresult = compute("
    after = "<|fim_suffix|>)\n" + "print(result) " * 12 + "<|fim_middle|>"
    cursors = [line + typed + after for typed in ("", "alpha, beta", "alpha, beta, gamma=3")]
    for text in cursors:
        await complete(proxy.url, text, "/v1/completions")
    proxy = await restarted(fake, proxy)
    try:
        prefilled = []
        for text in cursors:
            status, body, _ = await complete(proxy.url, text, "/v1/completions")
            assert status == 200
            prefilled.append(body["usage"]["prompt_tokens"] - cache_n(body))
        assert max(prefilled) > 12, prefilled
    finally:
        await proxy.stop()


# --- the one keyed driver: what chats have, prompts have


async def test_a_prompts_report_counts_what_came_from_cache_and_what_was_prefilled(
    make: Maker,
) -> None:
    fake, proxy = await make()
    text = prompt("A")
    _, first, _ = await complete(proxy.url, text)
    await settle(proxy)
    _, again, label = await complete(proxy.url, text + " And one more line.")
    await settle(proxy)
    assert label == "resident"
    stats = proxy.stats()
    # Every prompt's reply timings reach the counters `/metrics`, the status page and
    # `kvproxy stats` show.
    assert stats["tokens_cached"] == cache_n(first) + cache_n(again) > 0
    assert stats["tokens_prefilled"] == first["timings"]["prompt_n"] + again["timings"]["prompt_n"]
    recent = proxy.app[SERVICE].recent.snapshot()["recent"]  # newest first
    assert [r["route"] for r in recent[:2]] == ["/completion", "/completion"]
    assert (recent[0]["cached"], recent[0]["prefilled"]) == (
        cache_n(again),
        again["timings"]["prompt_n"],
    )


async def test_a_prompt_finding_every_slot_busy_and_the_queue_full_is_reported_busy(
    make: Maker,
) -> None:
    fake, proxy = await make(server={"token_delay": 0.05}, max_queue=0)
    long = [
        asyncio.create_task(complete(proxy.url, prompt(name), "/v1/completions"))
        for name in ("A", "B")
    ]
    for _ in range(500):  # until both hold their slots
        if all(s.busy for s in proxy.cache.pool.slots):
            break
        await asyncio.sleep(0.01)
    status, body, label = await complete(proxy.url, prompt("C"))
    assert status == 503 and body["error"]["code"] == "slots_busy"
    assert proxy.stats()["requests"]["busy"] == 1
    await asyncio.gather(*long)


async def test_prompts_across_two_servers_go_where_their_prefix_is(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fakes = [FakeLlamaServer(slot_save_path=cache) for _ in range(2)]
    for fake in fakes:
        await fake.start()
    proxy = await start_proxy([f.url for f in fakes], cache)
    try:
        texts = [prompt(name) for name in "ABCD"]
        for text in texts:  # four prompts over 2 × 2 slots
            status, _, _ = await complete(proxy.url, text)
            assert status == 200
            await settle(proxy)
        home = {text: _server_of(fakes, text) for text in texts}
        assert sorted(home.values()) == [0, 0, 1, 1]
        for _ in range(2):
            for text in texts:
                text_more = text + " More."
                status, body, label = await complete(proxy.url, text_more)
                await settle(proxy)
                assert (status, label) == (200, "resident")
                assert _server_of(fakes, text_more) == home[text]
                assert body["timings"]["prompt_n"] <= 20, body["timings"]
    finally:
        await proxy.stop()
        for fake in fakes:
            await fake.stop()


def _server_of(fakes: list[FakeLlamaServer], text: str) -> int:
    """Which server this prompt went to (each time to the same one)."""
    servers = {
        i
        for i, fake in enumerate(fakes)
        for _, path, body in fake.requests
        if path == "/completion" and body.get("prompt") == text
    }
    assert len(servers) == 1, servers
    return servers.pop()
