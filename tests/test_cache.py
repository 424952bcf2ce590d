"""The conversation cache against the fake llama-server: every decision path, fast."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvproxy_fake.model import default_reply, render_chat

from .conftest import NOT_ENTRIES, Maker, RunningProxy, committed, start_proxy
from .fakeserver import FakeLlamaServer


def conv(n: int, length: int = 300) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"System prompt of conversation {n}. " + "pad " * length},
        {"role": "user", "content": f"first question {n}"},
    ]


class Served(Protocol):
    """What `chat` needs of a proxy: where it listens (a RunningProxy, or one in another
    process)."""

    url: str


async def chat(
    proxy: Served,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            proxy.url + "/v1/chat/completions",
            json={"messages": messages, **extra},
            headers=headers or {},
        ) as r,
    ):
        raw = await r.read()
        if extra.get("stream"):
            return r.status, {"raw": raw}, dict(r.headers)
        return r.status, orjson.loads(raw), dict(r.headers)


def then(
    messages: list[dict[str, Any]], reply: dict[str, Any], text: str = "next question"
) -> list[dict[str, Any]]:
    msg = reply["choices"][0]["message"]
    echoed = {"role": "assistant", "content": msg.get("content")}
    if msg.get("tool_calls"):
        echoed["tool_calls"] = msg["tool_calls"]
    return [*messages, echoed, {"role": "user", "content": text}]


def prompt_tokens(body: dict[str, Any]) -> int:
    timings: dict[str, int] = body["timings"]
    return timings["cache_n"] + timings["prompt_n"]


def actions(fake: FakeLlamaServer, kind: str) -> list[tuple[str, int, str | None, bool]]:
    return [a for a in fake.actions if a[0] == kind]


async def settle(proxy: RunningProxy) -> None:
    """Let detached bookkeeping (after each reply) finish (seconds on a loaded machine)."""
    for _ in range(1000):
        if not len(proxy.cache.background) and not any(s.busy for s in proxy.cache.pool.slots):
            return
        await asyncio.sleep(0.01)


async def test_resident_conversation_needs_no_disk(make: Maker) -> None:
    fake, proxy = await make()
    _, r1, h1 = await chat(proxy, conv(1))
    assert h1["X-KVProxy-Cache"] == "miss"
    _, r2, h2 = await chat(proxy, then(conv(1), r1))
    assert h2["X-KVProxy-Cache"] == "resident"
    assert r2["timings"]["prompt_n"] <= 100  # the new turn only (tokens are bytes here)
    # Only the erase of a slot the server shows no task on yet (it may hold a state a killed
    # proxy restored, anyone's), before its first use: nothing saved or restored.
    assert fake.actions == [("erase", 0, None, True)]


async def test_evicted_conversation_is_saved_then_restored(make: Maker) -> None:
    fake, proxy = await make()
    replies = {}
    for c in (1, 2, 3):
        _, replies[c], _ = await chat(proxy, conv(c))
    await settle(proxy)
    # Conversation 1 made room for 3 on 3's path; with 3 live conversations on 2 slots, 2 and
    # 3 were then saved in the background.
    assert len(actions(fake, "save")) == 3
    assert proxy.stats()["saves"] - proxy.stats()["background_saves"] == 1
    status, r, h = await chat(proxy, then(conv(1), replies[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert int(h["X-KVProxy-Restored-Tokens"]) > 300 and float(h["X-KVProxy-Restore-Ms"]) >= 0
    assert r["timings"]["cache_n"] / prompt_tokens(r) > 0.9
    assert r["choices"][0]["message"]["content"] == "Echo: next question"
    assert fake.deferred_actions == 0


async def test_order_1212_is_all_resident(make: Maker) -> None:
    fake, proxy = await make()
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2)}
    for c in (1, 2):
        _, _, h = await chat(proxy, then(conv(c), r[c]))
        assert h["X-KVProxy-Cache"] == "resident"
    assert proxy.stats()["saves"] == 0 and proxy.stats()["restores"] == 0
    assert sorted(fake.actions) == [("erase", 0, None, True), ("erase", 1, None, True)]


async def test_streamed_replies_are_captured(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.001})
    _, streamed, _ = await chat(proxy, conv(1), stream=True)
    assert b"data: [DONE]" in streamed["raw"]
    _, plain, _ = await chat(proxy, conv(2))
    await chat(proxy, conv(3))  # pushes conversation 1 out to disk
    reply = {
        "choices": [
            {"message": {"content": plain["choices"][0]["message"]["content"].replace("2", "1")}}
        ]
    }
    _, r, h = await chat(proxy, then(conv(1), reply))
    assert h["X-KVProxy-Cache"] == "restored"


async def test_tool_call_replies_key_as_echoed(make: Maker) -> None:
    fake, proxy = await make()
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    msgs = [*conv(1)[:1], {"role": "user", "content": "please CALL_TOOL now"}]
    _, r1, _ = await chat(proxy, msgs, tools=tools)
    call = r1["choices"][0]["message"]["tool_calls"][0]
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                **call,
                "function": {
                    **call["function"],
                    "arguments": orjson.dumps(orjson.loads(call["function"]["arguments"])).decode(),
                },
            }
        ],
    }
    nxt = [*msgs, echoed, {"role": "tool", "tool_call_id": call["id"], "content": "42"}]
    _, _, h = await chat(proxy, nxt, tools=tools)
    assert h["X-KVProxy-Cache"] == "resident"


async def test_a_state_damaged_on_disk_is_never_restored(make: Maker) -> None:
    """Same size, same header, other bytes: the checksum recorded at commit catches it (beside
    the server's restore); the slot is erased before the request goes, which is answered
    uncached, and the entry is gone."""
    # Background saves off: the one entry on disk is conversation 1's.
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    [entry] = proxy.cache.store.entries.values()
    assert entry.checksum
    kv = proxy.cache.store.root / f"{entry.key}.kv"
    data = bytearray(kv.read_bytes())
    data[-20:] = bytes(20)  # zeroed KV bytes: a state the server loads without complaint
    kv.write_bytes(bytes(data))
    status, body, h = await chat(proxy, then(conv(1), r[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["choices"][0]["message"]["content"] == "Echo: next question"
    # The check ran beside the server's restore; the slot was erased before the request went.
    assert [a[0] for a in fake.actions][-2:] == ["restore", "erase"]
    assert body["timings"]["cache_n"] == 0, "nothing of the damaged state served"
    assert not kv.exists() and entry.key not in proxy.cache.store.entries


async def test_a_state_checked_once_then_damaged_is_never_restored(make: Maker) -> None:
    """A file that passed its check is not hashed again while unchanged; a write to it after
    that check is still caught at its next restore, before any request is served from it."""
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    [entry] = proxy.cache.store.entries.values()
    _, _, h = await chat(proxy, then(conv(1), r[1]))
    assert h["X-KVProxy-Cache"] == "restored"  # checked, and remembered as checked
    for c in (2, 3):
        await chat(proxy, then(conv(c), r[c]))
    await settle(proxy)
    assert entry.key in proxy.cache.store.entries
    kv = proxy.cache.store.root / f"{entry.key}.kv"
    data = bytearray(kv.read_bytes())
    data[-20:] = bytes(20)
    kv.write_bytes(bytes(data))
    # The same state again (a branch of the first turn's reply): restored, checked, erased.
    status, body, h = await chat(proxy, then(conv(1), r[1], "another question"))
    assert status == 200
    assert body["choices"][0]["message"]["content"] == "Echo: another question"
    # Its restore was erased before the request went (another entry may serve it then).
    restores = [n for n, a in enumerate(fake.actions) if a[0] == "restore" and a[2] == kv.name]
    assert len(restores) == 2 and fake.actions[restores[1] + 1][0] == "erase"
    assert not kv.exists() and entry.key not in proxy.cache.store.entries


async def test_failed_restore_drops_entry_and_answers_uncached(make: Maker) -> None:
    """A state the checksum passes but the server refuses (damaged before it was committed):
    the failed restore erased the slot, the request goes through uncached, the entry goes."""
    # Background saves off: the one entry on disk is conversation 1's.
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    [entry] = proxy.cache.store.entries.values()
    kv = proxy.cache.store.root / f"{entry.key}.kv"
    data = bytearray(kv.read_bytes())
    data[40:60] = b"\xff" * 20  # corrupt, same size: only the server can tell
    kv.write_bytes(bytes(data))
    entry.checksum = ""  # as a record written before kvproxy kept checksums
    status, body, h = await chat(proxy, then(conv(1), r[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["choices"][0]["message"]["content"] == "Echo: next question"
    assert not kv.exists() and entry.key not in proxy.cache.store.entries
    assert proxy.stats()["restore_failures"] == 1


async def test_truncated_state_file_is_never_sent_to_the_server(make: Maker) -> None:
    # Background saves off: the one entry on disk is conversation 1's.
    fake, proxy = await make(live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    [entry] = proxy.cache.store.entries.values()
    kv = proxy.cache.store.root / f"{entry.key}.kv"
    kv.write_bytes(kv.read_bytes()[:100])
    _, _, h = await chat(proxy, then(conv(1), r[1]))
    assert h["X-KVProxy-Cache"] == "miss"
    assert actions(fake, "restore") == []
    assert not kv.exists()


async def test_checkpoint_sidecars_live_and_die_with_their_entry(make: Maker) -> None:
    # Background saves off: the one entry on disk is conversation 1's.
    fake, proxy = await make(server={"write_sidecar": True}, max_disk=0, live_window=0)
    for c in (1, 2, 3):
        await chat(proxy, conv(c))
    await settle(proxy)
    root = proxy.cache.store.root
    [first] = proxy.cache.store.entries.values()
    sidecar = root / f"{first.key}.kv.ckpt"
    assert sidecar.exists()
    assert first.state_bytes == (root / f"{first.key}.kv").stat().st_size + sidecar.stat().st_size
    budget = int(first.state_bytes * 2.5)
    proxy.cache.store.max_bytes = budget
    for c in (4, 5, 6, 7):  # more saves than the budget holds: the oldest goes, sidecar too
        await chat(proxy, conv(c))
    await settle(proxy)
    assert first.key not in proxy.cache.store.entries
    assert not list(root.glob(f"{first.key}*"))
    assert 0 < proxy.cache.store.total_bytes <= budget

    def on_disk() -> int:
        return sum(p.stat().st_size for p in root.iterdir() if not p.name.startswith(NOT_ENTRIES))

    for _ in range(100):  # an evicted state's files go on a thread, a moment after its row
        if on_disk() == proxy.cache.store.total_bytes:
            break
        await asyncio.sleep(0.1)
    assert on_disk() == proxy.cache.store.total_bytes, sorted(p.name for p in root.iterdir())


async def test_ttl_eviction_before_lookup(make: Maker) -> None:
    # Background saves off: the one entry on disk is conversation 1's.
    fake, proxy = await make(ttl=0.3, live_window=0)
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    assert len(proxy.cache.store.entries) == 1
    await asyncio.sleep(0.5)
    _, _, h = await chat(proxy, then(conv(1), r[1]))
    assert h["X-KVProxy-Cache"] == "miss"
    assert actions(fake, "restore") == []


async def test_short_conversations_are_not_saved(make: Maker) -> None:
    fake, proxy = await make(min_tokens=10_000)
    for c in (1, 2, 3):
        await chat(proxy, conv(c))
    await settle(proxy)
    assert actions(fake, "save") == []


async def test_write_through_saves_every_reply(make: Maker) -> None:
    fake, proxy = await make(write_through=True)
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    assert len(proxy.cache.store.entries) == 1
    _, _, h = await chat(proxy, then(conv(1), r1))
    assert h["X-KVProxy-Cache"] == "resident"  # saved, and still in its slot
    await settle(proxy)
    assert len(proxy.cache.store.entries) == 2


async def test_idle_slots_are_saved(make: Maker) -> None:
    fake, proxy = await make(idle_save_after=0.1)
    await chat(proxy, conv(1))
    for _ in range(50):
        if proxy.cache.store.entries:
            break
        await asyncio.sleep(0.1)
    assert len(proxy.cache.store.entries) == 1


async def test_proxy_restart_restores_from_disk(make: Maker, tmp_path: Path) -> None:
    fake, proxy = await make()
    r = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2)}
    await proxy.stop()  # graceful: both resident conversations are saved
    assert len(list(fake.save_dir.glob("*.kv"))) == 2
    again = await start_proxy(fake.url, fake.save_dir)
    assert len(again.cache.store.entries) == 2  # both rows were committed
    try:
        for slot in fake.slots:  # the server restarted too: its slots are empty
            slot.tokens.clear()
        for c in (1, 2):
            _, body, h = await chat(again, then(conv(c), r[c]))
            assert h["X-KVProxy-Cache"] in ("restored", "resident")
            assert body["timings"]["cache_n"] / prompt_tokens(body) > 0.9
    finally:
        await again.stop()


async def test_wiped_slot_is_not_trusted(make: Maker) -> None:
    fake, proxy = await make(server={"wipe_idle_slots": True}, write_through=True)
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)  # 1 is on disk (a save racing the wipe: the next test)
    await chat(proxy, conv(2))  # the server wipes slot 0 while slot 1 starts
    await settle(proxy)
    _, body, h = await chat(proxy, then(conv(1), r1))
    assert h["X-KVProxy-Cache"] == "restored"  # not "resident": the slot was checked
    assert body["timings"]["cache_n"] / prompt_tokens(body) > 0.9
    assert proxy.stats()["slot_resets_seen"] >= 1


async def test_a_slot_wiped_before_its_save_commits_no_empty_state(make: Maker) -> None:
    """The wipe lands between kvproxy's last look and the save: the server saves 0 tokens.
    That file is not the conversation's state; restoring it would serve nothing."""
    fake, proxy = await make(write_through=True)
    fake.wipe_before_save = True
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    assert fake.slot_save_path is not None
    assert committed(fake.slot_save_path) == set() and not proxy.cache.store.entries
    assert proxy.stats()["slot_resets_seen"] >= 1
    fake.wipe_before_save = False
    _, body, h = await chat(proxy, then(conv(1), r1))
    assert h["X-KVProxy-Cache"] == "miss"  # not "restored" with nothing reused
    assert body["choices"][0]["message"]["content"] == "Echo: next question"


async def hang_up_mid_reply(proxy: RunningProxy, messages: list[dict[str, Any]]) -> None:
    """A user's Esc or Ctrl-C: the client reads the reply's first event and hangs up."""
    async with aiohttp.ClientSession() as s:
        resp = await s.post(
            proxy.url + "/v1/chat/completions", json={"messages": messages, "stream": True}
        )
        await resp.content.readline()
        resp.close()


async def test_an_interrupted_turn_keeps_its_prompt_in_the_slot(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.05})
    await hang_up_mid_reply(proxy, conv(1))
    await asyncio.sleep(0.3)
    await settle(proxy)
    # The request's line is reported (499, as a client that closed), and the next turn,
    # which starts with the interrupted prompt, is served from the slot.
    assert proxy.stats()["requests_by_status"].get("4xx") == 1
    nxt = [*conv(1), {"role": "assistant", "content": "Ec"}, {"role": "user", "content": "go on"}]
    status, r, h = await chat(proxy, nxt)
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    assert r["timings"]["cache_n"] >= len(render_chat(conv(1))) - 20
    assert r["timings"]["prompt_n"] <= 100
    assert fake.deferred_actions == 0


async def test_an_interrupted_turn_is_saved_when_its_slot_is_needed(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.05, "n_slots": 1}, live_window=0)
    await hang_up_mid_reply(proxy, conv(1))
    await asyncio.sleep(0.3)
    await settle(proxy)
    await chat(proxy, conv(2))  # takes the only slot: conversation 1's prompt is saved first
    await settle(proxy)
    nxt = [*conv(1), {"role": "assistant", "content": "Ec"}, {"role": "user", "content": "go on"}]
    status, r, h = await chat(proxy, nxt)
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert r["timings"]["cache_n"] / prompt_tokens(r) > 0.9
    assert fake.deferred_actions == 0


async def test_a_client_gone_while_its_state_is_restored_is_reported(make: Maker) -> None:
    """Hung up while kvproxy restores its conversation (on a slow disk, or during an opening's
    long evaluation): the request still has its log line, as one that closed (499)."""
    fake, proxy = await make(server={"n_slots": 1}, live_window=0)
    _, r1, _ = await chat(proxy, conv(1))
    await chat(proxy, conv(2))  # conversation 1 goes to disk
    await settle(proxy)
    fake.action_delay = 1.0
    body = {"messages": then(conv(1), r1)}
    async with aiohttp.ClientSession() as s:
        with contextlib.suppress(TimeoutError):
            async with s.post(
                proxy.url + "/v1/chat/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=0.3),
            ) as resp:
                await resp.read()
    await asyncio.sleep(1.5)
    await settle(proxy)
    assert proxy.stats()["requests_by_status"].get("4xx") == 1


async def test_queue_bound_gives_503_with_retry_after(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.02}, max_queue=1)
    slow = [asyncio.create_task(chat(proxy, conv(c))) for c in (1, 2, 3)]
    await asyncio.sleep(0.2)  # two running, one queued
    async with (
        aiohttp.ClientSession() as s,
        s.post(proxy.url + "/v1/chat/completions", json={"messages": conv(4)}) as r,
    ):
        assert r.status == 503 and r.headers["Retry-After"]
        assert (await r.json())["error"]["code"] == "slots_busy"
    assert [s for s, _, _ in await asyncio.gather(*slow)] == [200, 200, 200]


async def test_queue_timeout_gives_503(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.03}, queue_timeout=0.2)
    slow = [asyncio.create_task(chat(proxy, conv(c))) for c in (1, 2)]
    for _ in range(500):  # until both hold their slots (a loaded machine takes its time)
        if all(s.busy for s in proxy.cache.pool.slots):
            break
        await asyncio.sleep(0.01)
    status, body, headers = await chat(proxy, conv(3))
    assert status == 503 and "Retry-After" in headers
    await asyncio.gather(*slow)


async def test_many_clients_few_slots_no_deferred_actions(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.001})
    first = await asyncio.gather(*(chat(proxy, conv(c, 100)) for c in range(12)))
    assert all(s == 200 for s, _, _ in first)
    second = await asyncio.gather(
        *(chat(proxy, then(conv(c, 100), first[c][1])) for c in range(12))
    )
    assert all(s == 200 for s, _, _ in second)
    assert all(b["choices"][0]["message"]["content"] == "Echo: next question" for _, b, _ in second)
    assert fake.deferred_actions == 0
    assert proxy.stats()["restores"] > 0


async def test_tenants_never_share_entries(make: Maker) -> None:
    fake, proxy = await make()
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    _, r1, _ = await chat(proxy, conv(1), headers=alice)
    await chat(proxy, conv(2), headers=alice)
    await chat(proxy, conv(3), headers=alice)  # alice's conversation 1 goes to disk
    await settle(proxy)
    _, _, h = await chat(proxy, then(conv(1), r1), headers=bob)
    assert h["X-KVProxy-Cache"] == "miss"
    assert actions(fake, "restore") == []
    _, _, h = await chat(proxy, then(conv(1), r1), headers=alice)
    assert h["X-KVProxy-Cache"] == "restored"


async def test_requests_the_cache_cannot_key_are_pinned_bypass(make: Maker) -> None:
    fake, proxy = await make()
    _, r1, _ = await chat(proxy, conv(1))
    status, _, h = await chat(proxy, conv(2), n=2)
    assert status == 200 and h["X-KVProxy-Cache"] == "bypass"
    status, _, h = await chat(proxy, [{"role": "user", "content": 5}])
    assert h["X-KVProxy-Cache"] == "bypass"
    # n=2 holds every slot instead (the server runs the second completion on another slot).
    chats = [b for m, p, b in fake.requests if p.startswith("/v1/chat") and b]
    assert [b for b in chats if "id_slot" not in b] == [{"messages": conv(2), "n": 2}]
    async with (
        aiohttp.ClientSession() as s,
        s.post(proxy.url + "/completion", json={"prompt": ["a", "b"], "n_predict": 4}) as r,
    ):
        # Several prompts: not keyed (tests/test_prompts.py has the keyed ones), still pinned.
        assert r.status == 200 and r.headers["X-KVProxy-Cache"] == "bypass"
    assert fake.requests[-1][2]["id_slot"] in (0, 1)


async def test_client_id_slot_is_overridden(make: Maker) -> None:
    fake, proxy = await make()
    await chat(proxy, conv(1), id_slot=7)
    body = next(b for m, p, b in fake.requests if p.startswith("/v1/chat"))
    assert (body["id_slot"] in (0, 1) and body["id_slot"] != 7 % 2) or body["id_slot"] == 0


async def test_ineffective_restores_stop_after_a_few(make: Maker) -> None:
    """A server that never reuses a restored state (SWA without --swa-full): kvproxy notices
    from timings.cache_n, stops restoring, and the answers stay right."""
    fake, proxy = await make(server={"reuse": "none"})
    replies = {c: (await chat(proxy, conv(c)))[1] for c in range(1, 8)}
    await settle(proxy)
    outcomes = []
    for c in range(1, 7):
        status, body, h = await chat(proxy, then(conv(c), replies[c]))
        assert status == 200 and body["choices"][0]["message"]["content"] == "Echo: next question"
        outcomes.append(h["X-KVProxy-Cache"])
    assert outcomes[:3] == ["restored"] * 3
    assert outcomes[3:] == ["miss"] * 3
    assert proxy.stats()["ineffective_restores"] == 3
    assert len([a for a in fake.actions if a[0] == "restore"]) == 3


async def test_a_reply_tells_what_its_slot_holds_without_asking_the_server(make: Maker) -> None:
    """After a reply kvproxy asks the server nothing: the reply's timings give what the slot
    holds (the prompt and the reply but its last token), and the next turn, at once, is
    resident with no GET /slots between the two."""
    fake, proxy = await make()
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    slot = next(s for s in proxy.cache.pool.slots if s.holding is not None)
    assert slot.holding is not None
    assert slot.holding.n_tokens == len(fake.slots[slot.id].tokens)
    _, r2, h = await chat(proxy, then(conv(1), r1))
    assert h["X-KVProxy-Cache"] == "resident"
    assert r2["timings"]["prompt_n"] <= 100  # the new turn only
    paths = [p for m, p, _ in fake.requests if p in ("/slots", "/v1/chat/completions")]
    first, second = [i for i, p in enumerate(paths) if p == "/v1/chat/completions"]
    assert paths[first + 1 : second] == []


async def test_a_slot_used_behind_kvproxys_back_after_a_reply_is_noticed(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another client of the server takes the slot between two turns: the check before the
    slot is trusted again (here at once: no trust window) sees a task kvproxy did not send
    leaving a size its reply did not, and the turn is not served as resident."""
    monkeypatch.setattr("kvproxy.handlers.prepare.SNAPSHOT_TRUST", 0.0)
    fake, proxy = await make(server={"n_slots": 1})
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fake.url + "/v1/chat/completions",
            json={"messages": conv(2, length=20), "id_slot": 0},
        ) as r,
    ):
        assert r.status == 200
    status, r2, h = await chat(proxy, then(conv(1), r1))
    assert status == 200 and h["X-KVProxy-Cache"] != "resident"
    assert r2["choices"][0]["message"]["content"] == "Echo: next question"
    assert r2["timings"]["cache_n"] < 100  # the slot held the other client's prompt
    assert proxy.stats()["slot_resets_seen"] == 1


@pytest.mark.parametrize("stop_at", ["finish_reason", "[DONE]"])
async def test_a_client_that_hangs_up_after_the_last_event_keeps_its_slot(
    make: Maker, stop_at: str
) -> None:
    """Codex stops reading at `response.completed` and closes the connection, before the
    server ends the stream (an SDK may stop at `[DONE]`): the reply was whole, so the slot
    holds the conversation and the request is reported like any other."""
    fake, proxy = await make(server={"end_delay": 0.5})
    messages = conv(1)
    text = ""
    async with aiohttp.ClientSession() as s:
        body = {"messages": messages, "stream": True}
        async with s.post(proxy.url + "/v1/chat/completions", json=body) as resp:
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    break
                if line.startswith(b"data: {"):
                    chunk = orjson.loads(line[6:])
                    for choice in chunk.get("choices") or []:
                        text += (choice.get("delta") or {}).get("content") or ""
                        if choice.get("finish_reason") and stop_at == "finish_reason":
                            break
                    else:
                        continue
                    break
            resp.close()  # hang up before the stream's end
    await asyncio.sleep(0.7)
    await settle(proxy)
    assert proxy.stats()["requests"]["miss"] == 1, proxy.stats()["requests"]
    reply = {"choices": [{"message": {"role": "assistant", "content": text}}]}
    status, r, headers = await chat(proxy, then(messages, reply))
    assert status == 200 and headers["X-KVProxy-Cache"] == "resident"
    assert r["timings"]["prompt_n"] <= 100, r["timings"]  # the new turn only


async def test_a_client_gone_when_the_stream_ends_keeps_its_slot(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's hang-up found by the write of the chunked body's end, not by the loop
    (its reset noticed in the same tick as the last event's write; seen in CI with Codex):
    the reply was whole, so it is reported and the slot holds the conversation."""
    _, proxy = await make()
    port = int(proxy.url.rsplit(":", 1)[1])
    real_write_eof = web.StreamResponse.write_eof

    async def reset_first(self: web.StreamResponse, data: bytes = b"") -> None:
        transport = self._req.transport if self._req is not None else None
        if transport is not None and transport.get_extra_info("sockname")[1] == port:
            transport.abort()  # closing at once; the loop hears of it a tick later
        await real_write_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", reset_first)
    messages = conv(1)
    async with aiohttp.ClientSession() as s:
        body = {"messages": messages, "stream": True}
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(proxy.url + "/v1/chat/completions", json=body) as resp:
                await resp.read()
    monkeypatch.undo()
    await settle(proxy)
    assert proxy.stats()["requests"]["miss"] == 1, proxy.stats()["requests"]
    reply = {"choices": [{"message": {"role": "assistant", "content": default_reply(messages)}}]}
    status, r, headers = await chat(proxy, then(messages, reply))
    assert status == 200 and headers["X-KVProxy-Cache"] == "resident"
    assert r["timings"]["prompt_n"] <= 100, r["timings"]  # the new turn only


async def test_a_resident_hit_the_server_barely_reuses_is_counted_and_explained(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    """Keys ignore surrounding whitespace; tokens do not. A client that adds a leading space
    to its system prompt stays `resident`, but the server recomputes nearly everything: that
    weak hit is counted and logged with why, not reported like a perfect one."""
    fake, proxy = await make()
    _, r1, _ = await chat(proxy, conv(1))
    turn2 = then(conv(1), r1)
    turn2[0] = {**turn2[0], "content": "  " + turn2[0]["content"]}
    with caplog.at_level(logging.INFO, logger="kvproxy.request"):
        _, r2, h = await chat(proxy, turn2)
    assert h["X-KVProxy-Cache"] == "resident"
    assert r2["timings"]["cache_n"] < r2["timings"]["prompt_n"]
    assert proxy.stats()["weak_hits"] == 1
    weak = [r for r in caplog.records if r.getMessage().startswith("weak hit")]
    assert weak and "resident" in weak[0].getMessage()
    # A good resident turn is not a weak one.
    _, r3, _ = await chat(proxy, then(turn2, r2))
    assert proxy.stats()["weak_hits"] == 1


async def test_a_save_then_restore_reads_the_slots_once_before_it_is_forwarded(
    make: Maker,
) -> None:
    """A request that saves what its slot holds and restores its own state in its place asks
    GET /slots at most once before it is forwarded: the slot is ours meanwhile, and kvproxy's
    own evaluations (the canonical prefix) leave a state it knows without asking."""
    fake, proxy = await make(server={"n_slots": 1}, live_window=0)
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    await chat(proxy, conv(2))
    await settle(proxy)
    before = len(fake.requests)
    m2 = then(conv(1), r1)
    status, r2, h = await chat(proxy, m2)
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    sent = [(m, p) for m, p, _ in fake.requests[before:]]
    forwarded = sent.index(("POST", "/v1/chat/completions"))
    path = sent[:forwarded]
    assert ("POST", "/slots/0?action=save") in path  # conversation 2, on the request's path
    assert ("POST", "/slots/0?action=restore") in path
    assert path.count(("GET", "/slots")) <= 1, path
    await settle(proxy)
    # Nothing kvproxy knows of the slot was lost by not asking: turn 3 finds it resident.
    _, r3, h3 = await chat(proxy, then(m2, r2))
    assert h3["X-KVProxy-Cache"] == "resident"
    assert r3["timings"]["prompt_n"] <= 100


async def test_min_tokens_0_keys_and_caches_small_conversations(make: Maker) -> None:
    """`--min-tokens 0`: a conversation of a few tokens is keyed, saved when it must leave its
    slot, and restored when it comes back (the default, 256, would not save it)."""
    from kvproxy.cli.flags import load_settings

    assert load_settings({"min_tokens": "0"}).min_tokens == 0
    fake, proxy = await make(min_tokens=0, live_window=0)
    small = {c: [{"role": "user", "content": f"hi {c}"}] for c in (1, 2, 3)}
    replies = {}
    for c in (1, 2, 3):
        _, replies[c], h = await chat(proxy, small[c])
        assert h["X-KVProxy-Cache"] == "miss"  # keyed (not "bypass")
    await settle(proxy)
    assert actions(fake, "save")  # conversation 1 made room for 3, saved on the way
    status, r, h = await chat(proxy, then(small[1], replies[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert prompt_tokens(r) < 256  # below the default --min-tokens


async def test_small_conversations_are_not_saved_by_default(make: Maker) -> None:
    fake, proxy = await make(min_tokens=256, live_window=0)
    small = {c: [{"role": "user", "content": f"hi {c}"}] for c in (1, 2, 3)}
    replies = {}
    for c in (1, 2, 3):
        _, replies[c], _ = await chat(proxy, small[c])
    await settle(proxy)
    assert not actions(fake, "save")
    _, _, h = await chat(proxy, then(small[1], replies[1]))
    assert h["X-KVProxy-Cache"] == "miss"
