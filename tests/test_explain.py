"""Explaining misses: where a request parted from the closest known conversation."""

from __future__ import annotations

import asyncio
import logging
import stat
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvproxy import keys
from kvproxy.cache.reports.explain import MARK, excerpt, explain_miss
from kvproxy.store import DB_NAME, Entry, Store

from .conftest import NOT_ENTRIES, Maker, RunningProxy, start_proxy
from .test_cache import chat, settle
from .test_store import NS, state_bytes

SYSTEM = (
    "You are a coding agent working in /work/repo. Current time: {ts}. "
    "Answer briefly and cite files."
)
T1, T2 = "2026-11-29 12:01:07", "2026-11-29 12:03:44"


def turn(ts: str, question: str = "What changed since yesterday?") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SYSTEM.format(ts=ts)},
        {"role": "user", "content": question},
    ]


def first_difference(a: str, b: str) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


OFFSET = first_difference(SYSTEM.format(ts=T1), SYSTEM.format(ts=T2))


def test_offset_is_the_first_differing_character() -> None:
    assert SYSTEM.format(ts=T1)[OFFSET:].startswith("1:07")
    assert SYSTEM.format(ts=T2)[OFFSET:].startswith("3:44")


def test_timestamp_in_system_prompt() -> None:
    known = [*turn(T1), {"role": "assistant", "content": "Nothing."}]
    miss = explain_miss(turn(T2), [("slot 0", known)])
    assert miss is not None
    assert (miss.message_index, miss.char_offset, miss.where) == (0, OFFSET, "slot 0")
    assert f"12:0{MARK}3:44" in miss.ours and f"12:0{MARK}1:07" in miss.theirs
    assert miss.ours.startswith("…") and miss.ours.endswith("…")


def test_the_candidate_that_got_furthest_wins() -> None:
    request = [
        {"role": "system", "content": "s" * 100},
        {"role": "user", "content": "tell me about request 9f2c now please"},
    ]
    early = [{"role": "system", "content": "s" * 60 + "x" * 40}]
    later = [request[0], {"role": "user", "content": "tell me about request 1a7d now please"}]
    miss = explain_miss(request, [("slot 0", early), ("disk abc", later)])
    assert miss is not None
    assert (miss.message_index, miss.char_offset, miss.where) == (1, 22, "disk abc")


def test_unrelated_or_extending_conversations_explain_nothing() -> None:
    request = turn(T1)
    unrelated = [{"role": "system", "content": "You are a pirate."}]
    assert explain_miss(request, [("slot 0", unrelated)]) is None
    # One conversation extends the other: they never diverged.
    longer = [*request, {"role": "assistant", "content": "ok"}]
    assert explain_miss(request, [("slot 0", longer)]) is None
    assert explain_miss(longer, [("slot 0", request)]) is None
    # Differences keys ignore (surrounding whitespace) are not divergences.
    padded = [{**request[0], "content": request[0]["content"] + "\n"}, request[1], longer[2]]
    assert explain_miss(padded, [("slot 1", [*longer[:2], {"role": "user", "content": "x"}])])
    assert explain_miss(padded, [("slot 1", longer)]) is None
    # A malformed stored conversation is skipped, not an error.
    assert explain_miss(request, [("disk x", ["not a message"]), ("slot 0", [])]) is None


def test_tool_calls_and_parts_compare_as_rendered_text() -> None:
    call: dict[str, Any] = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"a": 1}'},
    }
    base: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "A long enough system prompt."}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    other = [
        base[0],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {"name": "f", "arguments": '{"a": 2}'}}],
        },
    ]
    miss = explain_miss(base, [("slot 0", other)])
    assert miss is not None and miss.message_index == 1
    assert f"{MARK}1" in miss.ours and f"{MARK}2" in miss.theirs
    # Same arguments, other spacing: keys treat them as equal, so no divergence.
    spaced = [base[0], {**base[1], "tool_calls": [{**call, "function": {"name": "f",
              "arguments": '{"a":1}'}}]}]  # fmt: skip
    assert explain_miss(base, [("slot 0", spaced)]) is None


def test_excerpts_escape_control_characters() -> None:
    text = "line one\nline two\ttab\x1b[31m red" + "z" * 50
    out = excerpt(text, 9, width=10)
    assert "\n" not in out and "\t" not in out and "\x1b" not in out
    assert out == "line one\\n" + MARK + "line two\\tt…"
    assert excerpt("short", 2) == "sh" + MARK + "ort"


# --- through the proxy


async def explained(caplog: pytest.LogCaptureFixture, proxy: RunningProxy) -> list[str]:
    """The miss explanations logged so far (they are logged right after the reply)."""
    for _ in range(200):
        await settle(proxy)
        lines = [r.getMessage() for r in caplog.records if "miss explained" in r.getMessage()]
        if lines:
            return lines
        await asyncio.sleep(0.01)
    return []


async def test_changing_timestamp_miss_is_explained(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.request")
    fake, proxy = await make()
    _, r1, h1 = await chat(proxy, turn(T1))
    assert h1["X-KVProxy-Cache"] == "miss"
    assert await explained(caplog, proxy) == []  # nothing was known: nothing to explain
    echoed = {"role": "assistant", "content": r1["choices"][0]["message"]["content"]}
    status, _, h2 = await chat(proxy, [*turn(T2), echoed, {"role": "user", "content": "And?"}])
    assert status == 200 and h2["X-KVProxy-Cache"] == "miss"
    [line] = await explained(caplog, proxy)
    assert f"diverged from slot 0 at message 0, char {OFFSET}:" in line
    assert f"12:0{MARK}3:44" in line and f"12:0{MARK}1:07" in line


async def test_restart_miss_is_explained_from_disk(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.request")
    fake, proxy = await make()
    await chat(proxy, turn(T1))
    await proxy.stop()  # graceful: the conversation is saved, with its text
    [entry_text] = list(fake.save_dir.glob("*.msgs"))
    again = await start_proxy(fake.url, fake.save_dir)
    try:
        for slot in fake.slots:
            slot.tokens.clear()
        status, _, h = await chat(again, turn(T2))
        assert status == 200 and h["X-KVProxy-Cache"] == "miss"
        [line] = await explained(caplog, again)
        key = entry_text.name.removesuffix(".msgs")
        assert f"diverged from disk {key[:12]} at message 0, char {OFFSET}:" in line
    finally:
        await again.stop()


async def test_another_tenants_conversation_never_explains(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.request")
    fake, proxy = await make()
    await chat(proxy, turn(T1), headers={"Authorization": "Bearer alice"})
    await chat(proxy, turn("2026-11-29 12:02:00"), headers={"Authorization": "Bearer alice"})
    await chat(proxy, turn("2026-11-29 12:02:30"), headers={"Authorization": "Bearer alice"})
    await settle(proxy)
    assert proxy.cache.store.entries  # alice's first conversation is on disk too
    caplog.clear()
    _, _, h = await chat(proxy, turn(T2), headers={"Authorization": "Bearer bob"})
    assert h["X-KVProxy-Cache"] == "miss"
    assert await explained(caplog, proxy) == []  # none of alice's text in bob's log lines


# --- the conversation's text on disk (what explains misses after a restart)


def _commit(store: Store, messages: list[dict[str, Any]] | None) -> Entry:
    chain = keys.chain(NS, [{"role": "user", "content": "m0"}])
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10))
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, 1, now, now, chain=chain, messages=messages)
    return store.commit(entry, temp)


def test_text_is_kept_beside_the_state(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    # Distinctive text: a short one like "m0" turns up by chance in the index's binary pages.
    text = "text-kept-only-in-the-msgs-file"
    messages = [{"role": "user", "content": text}]
    entry = _commit(store, messages)
    msgs = tmp_path / f"{entry.key}.msgs"
    assert stat.S_IMODE(msgs.stat().st_mode) == 0o600
    assert entry.messages is None  # on disk, not in memory
    assert not [
        p for p in tmp_path.glob(DB_NAME + "*") if text.encode() in p.read_bytes()
    ]  # nor index
    assert store.total_bytes == entry.state_bytes + msgs.stat().st_size
    assert store.files.read_many_messages(store.recent_with_text(NS)) == [(entry.key, messages)]
    assert store.recent_with_text(keys.namespace("m", {}, "another tenant")) == []

    again = Store(tmp_path, ttl=0, max_bytes=0)
    again.open()
    assert again.files.read_messages(entry.key) == messages
    assert again.total_bytes == store.total_bytes
    again.remove(entry.key)
    assert [p for p in tmp_path.iterdir() if not p.name.startswith(NOT_ENTRIES)] == []


def test_older_index_records_and_stray_text_files(tmp_path: Path) -> None:
    chain = keys.chain(NS, [{"role": "user", "content": "m0"}])
    entry = Entry(chain[-1], NS, 10, 1000, 1, 1.0, 1.0, chain=chain)
    (tmp_path / f"{entry.key}.kv").write_bytes(state_bytes(10))
    idx = tmp_path / f"{entry.key}.idx"  # an .idx record from before this feature
    record = orjson.loads(entry.to_json())
    del record["msgs_bytes"]
    record["added_by_a_newer_version"] = 1
    idx.write_bytes(orjson.dumps(record))
    stray = tmp_path / f"{'ab' * 16}.msgs"  # text of an entry that was never committed
    stray.write_bytes(b"[]")
    again = Store(tmp_path, ttl=0, max_bytes=0)
    again.open()
    assert list(again.entries) == [entry.key]
    assert again.files.read_messages(entry.key) is None
    assert not stray.exists()
