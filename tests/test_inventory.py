"""`kvproxy ls|rm|gc|stats` against real cache dirs (written by the proxy over the fake
server, or by the store as a save does), and a running proxy."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from kvproxy import keys
from kvproxy.cli import main
from kvproxy.cli.display import human_age
from kvproxy.readable import size as human_bytes
from kvproxy.server.managed import free_port
from kvproxy.store import Entry, Store

from .conftest import NOT_ENTRIES, Maker, RunningProxy, start_proxy
from .test_cache import actions, chat, conv, settle, then
from .test_store import state_bytes

NS = keys.namespace("m", {}, None)


async def filled(make: Maker) -> tuple[RunningProxy, Path, dict[int, dict[str, Any]]]:
    """A proxy whose cache dir holds three saved conversations (the proxy still runs): the
    ones evicted (background saves off, so exactly those)."""
    _fake, proxy = await make(live_window=0)
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3, 4, 5)}
    await settle(proxy)
    assert len(proxy.cache.store.entries) == 3
    return proxy, proxy.cache.store.root, replies


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def commit(store: Store, key: str, size: int = 1000, last_used: float | None = None) -> Entry:
    """What a save does: llama-server writes the temp file, the store commits it."""
    temp = store.temp_name(key)
    (store.root / temp).write_bytes(state_bytes(10, size))
    now = time.time()
    entry = Entry(key, NS, 10, 0, 2, now, now if last_used is None else last_used, chain=[key])
    entry.messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    return store.commit(entry, temp)


def names(root: Path) -> set[str]:
    """The cache dir's files but the index's own."""
    return {p.name for p in root.iterdir() if not p.name.startswith(NOT_ENTRIES)}


async def test_ls_lists_what_the_proxy_saved(
    make: Maker, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy, root, _ = await filled(make)
    entries = proxy.cache.store.entries
    code, out, _ = run(capsys, "ls", "--cache-dir", str(root))
    assert code == 0
    lines = out.splitlines()
    header = ["KEY", "TOKENS", "SIZE", "AGE", "LAST", "USED", "HITS", "MSGS", "MODEL"]
    assert lines[0].split() == header
    assert {line.split()[0] for line in lines[1:4]} == {k[:12] for k in entries}
    assert lines[4].startswith("3 entries, ")
    for entry in entries.values():
        row = next(line for line in lines if line.startswith(entry.key[:12])).split()
        assert row[1] == f"{entry.n_tokens:,}" and row[-2] == str(entry.n_messages)
        assert row[-3] == "0"  # hits
        assert row[-1] == "fake-model.gguf"  # the server's model file

    code, out, _ = run(capsys, "ls", "--json", "--sort", "size", "--cache-dir", str(root))
    listed = orjson.loads(out)
    assert {e["key"] for e in listed} == set(entries)
    assert [e["bytes"] for e in listed] == sorted((e["bytes"] for e in listed), reverse=True)
    on_disk = {p: (root / p).stat().st_size for p in names(root)}
    for e in listed:
        assert e["bytes"] == on_disk[f"{e['key']}.kv"] + on_disk[f"{e['key']}.msgs"]
        assert e["tokens"] == entries[e["key"]].n_tokens and e["hits"] == 0
        assert e["model"] == "fake-model.gguf"

    code, out, _ = run(capsys, "ls", "--json", "--limit", "1", "--cache-dir", str(root))
    assert len(orjson.loads(out)) == 1
    code, out, _ = run(capsys, "ls", "--json", "--older-than", "1h", "--cache-dir", str(root))
    assert orjson.loads(out) == []
    code, out, _ = run(capsys, "ls", "--json", "--min-size", "1GiB", "--cache-dir", str(root))
    assert orjson.loads(out) == []
    code, _, err = run(capsys, "ls", "--older-than", "soon", "--cache-dir", str(root))
    assert code == 1 and "not a duration" in err
    code, _, err = run(capsys, "ls", "--min-size", "big", "--cache-dir", str(root))
    assert code == 1 and "--min-size: not a size: 'big'" in err


async def test_ls_shows_hits_after_a_restore(
    make: Maker, capsys: pytest.CaptureFixture[str]
) -> None:
    proxy, root, replies = await filled(make)
    _, _, h = await chat(proxy, then(conv(1), replies[1]))
    assert h["X-KVProxy-Cache"] == "restored"
    await settle(proxy)
    code, out, _ = run(capsys, "ls", "--json", "--sort", "hits", "--cache-dir", str(root))
    assert orjson.loads(out)[0]["hits"] == 1


def test_ls_changes_nothing_on_disk(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = commit(store, "ab" * 16)
    # What a running proxy may have in flight: a save not yet committed, and an index
    # record whose state file is being replaced.
    (tmp_path / f"{'cd' * 16}.1a2b3c4d.tmp").write_bytes(state_bytes(5))
    (tmp_path / f"{'ef' * 16}.kv").write_bytes(state_bytes(5))
    before = on_disk(tmp_path)
    code, out, _ = run(capsys, "ls", "--cache-dir", str(tmp_path))
    assert code == 0 and entry.key[:12] in out and out.count("\n") == 3
    assert on_disk(tmp_path) == before


def on_disk(root: Path) -> dict[str, bytes]:
    """Every file's bytes but SQLite's shared-memory index (`-shm`): a reader records there
    how far into the WAL it reads (its read mark), which is coordination between the
    connections of the moment, not content; the database and its WAL are compared."""
    return {
        p.name: p.read_bytes()
        for p in root.iterdir()
        if p.is_file() and not p.name.endswith("-shm")
    }


def test_ls_without_a_cache_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "ls", "--cache-dir", str(tmp_path / "nope"))
    assert code == 1 and "no cache dir" in err


def test_ls_uses_the_env_var(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = commit(store, "ab" * 16)
    monkeypatch.setenv("KVPROXY_CACHE_DIR", str(tmp_path))
    code, out, _ = run(capsys, "ls")
    assert code == 0 and entry.key[:12] in out


def test_rm_by_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    a = commit(store, "abcdef" + "0" * 26)
    b = commit(store, "abcdef" + "1" * 26)
    c = commit(store, "123456" + "2" * 26)

    code, _, err = run(capsys, "rm", "abcdef", "--cache-dir", str(tmp_path))
    assert code == 1 and "ambiguous" in err and a.key in err and b.key in err
    code, _, err = run(capsys, "rm", "abc", "--cache-dir", str(tmp_path))
    assert code == 1 and "at least 6 hex" in err
    code, _, err = run(capsys, "rm", "ffffff", "--cache-dir", str(tmp_path))
    assert code == 1 and "no entry" in err
    # One bad key among good ones: nothing is removed.
    code, _, _ = run(capsys, "rm", "123456", "abcdef", "--cache-dir", str(tmp_path))
    assert code == 1 and len(names(tmp_path)) == 6

    code, out, _ = run(capsys, "rm", "ABCDEF0", "123456", "--cache-dir", str(tmp_path))
    assert code == 0 and f"removed {a.key[:12]}" in out and "removed 2 entries" in out
    assert names(tmp_path) == {f"{b.key}.kv", f"{b.key}.msgs"}
    assert list(store.entries) == [b.key]
    del c


async def test_rm_all_while_the_proxy_runs_gives_misses(
    make: Maker, capsys: pytest.CaptureFixture[str]
) -> None:
    fake, proxy = await make(live_window=0)  # background saves off: only the evicted one
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    root = proxy.cache.store.root
    [entry] = proxy.cache.store.entries.values()  # conversation 1, saved to make room
    code, out, _ = await asyncio.to_thread(run, capsys, "rm", "--all", "--cache-dir", str(root))
    assert code == 0 and "removed 1 entry," in out
    assert names(root) == set()
    # The row is the proxy's index too: its next lookup finds nothing, sends no restore and
    # answers uncached.
    assert entry.key not in proxy.cache.store.entries
    status, body, h = await chat(proxy, then(conv(1), replies[1]))
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["choices"][0]["message"]["content"] == "Echo: next question"
    assert actions(fake, "restore") == []


def test_gc_applies_ttl_then_budget(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    now = time.time()
    old = commit(store, "aa" * 16, last_used=now - 7200)
    mid = commit(store, "bb" * 16, last_used=now - 60)
    new = commit(store, "cc" * 16, last_used=now)
    size = old.on_disk

    code, out, _ = run(capsys, "gc", "--ttl", "1h", "--dry-run", "--cache-dir", str(tmp_path))
    assert code == 0 and f"would evict {old.key[:12]}" in out
    assert "would evict 1 of 3 entries (1 unused for over 2h" not in out  # ttl is 1h
    assert "would evict 1 of 3 entries (1 unused for over 1h, 0 over budget)" in out
    assert len(names(tmp_path)) == 6 and len(store.entries) == 3  # a dry run deletes nothing

    code, out, _ = run(
        capsys, "gc", "--ttl", "1h", "--max-disk", str(size + 10), "--cache-dir", str(tmp_path)
    )
    assert code == 0 and "evicted 2 of 3 entries (1 unused for over 1h, 1 over budget)" in out
    assert names(tmp_path) == {f"{new.key}.kv", f"{new.key}.msgs"}
    assert list(store.entries) == [new.key]
    del mid


async def test_stats_reads_a_running_proxy(make: Maker, capsys: pytest.CaptureFixture[str]) -> None:
    proxy, root, replies = await filled(make)
    await chat(proxy, then(conv(1), replies[1]))
    await settle(proxy)
    code, out, _ = await asyncio.to_thread(run, capsys, "stats", "--url", proxy.url)
    assert code == 0, out
    assert "requests     resident 0  restored 1  miss 5  bypass 0" in out
    assert f"disk         {len(proxy.cache.store.entries)} entries" in out
    assert "restores     1 ok, 0 failed" in out
    assert "model        fake-model.gguf" in out
    # Conversations 1-3 made room for 3-5, and 1's return for itself (background saves off).
    assert "saves        4 ok (0 in the background), 0 failed" in out
    assert out.splitlines()[-2].startswith("  0  idle")
    port = proxy.url.rsplit(":", 1)[1]
    code, out, _ = await asyncio.to_thread(run, capsys, "stats", "--port", port, "--json")
    assert code == 0 and orjson.loads(out)["restores"] == 1


async def test_stats_errors_are_clear(
    make: Maker, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await asyncio.to_thread(run, capsys, "stats", "--port", str(free_port()))
    assert code == 1 and "no kvproxy answering at http://127.0.0.1:" in err
    fake, _ = await make()
    exposed = await start_proxy(fake.url, tmp_path / "c2", host="0.0.0.0", admin_token="s3cret")
    try:
        code, _, err = await asyncio.to_thread(run, capsys, "stats", "--url", exposed.url)
        assert code == 1 and "admin token" in err
        code, out, _ = await asyncio.to_thread(
            run, capsys, "stats", "--url", exposed.url, "--admin-token", "s3cret"
        )
        assert code == 0 and "requests" in out
    finally:
        await exposed.stop()


def test_human_units() -> None:
    assert human_bytes(512) == "512 B" and human_bytes(7 * 1024**2 + 100) == "7.0 MiB"
    assert human_age(45) == "45s" and human_age(3 * 3600 + 15 * 60) == "3h15m"
    assert human_age(12 * 86400) == "12d"


def test_damaged_entries_are_shown_kept_by_ls_and_removed_by_rm_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A cache dir of kvproxy before the SQLite index: one record's state file is damaged.
    old = {}
    for key, data in (("12" * 16, state_bytes(10)), ("ef" * 16, b"short")):
        (tmp_path / f"{key}.kv").write_bytes(data)
        old[key] = Entry(key, NS, 10, 1000, 2, 1.0, 1.0, chain=[key])
        (tmp_path / f"{key}.idx").write_bytes(old[key].to_json())
    code, out, err = run(capsys, "ls", "--cache-dir", str(tmp_path))
    assert code == 0 and "12121212" in out and "efefefef" not in out
    assert "skipped 1 damaged entry (a starting proxy drops them): efefefefefef: size" in err
    assert (tmp_path / f"{'ef' * 16}.idx").exists()  # not imported, not deleted
    code, out, _ = run(capsys, "rm", "--all", "--cache-dir", str(tmp_path))
    assert code == 0 and "removed 1 entry and 1 damaged" in out
    assert names(tmp_path) == set()

    # A committed entry whose state file was damaged since: named by ls, not listed.
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    good, bad = commit(store, "ab" * 16), commit(store, "cd" * 16)
    (tmp_path / f"{bad.key}.kv").write_bytes(b"short")
    code, out, err = run(capsys, "ls", "--cache-dir", str(tmp_path))
    assert code == 0 and good.key[:12] in out and bad.key[:12] not in out
    assert "1 damaged entry not shown (a restore drops them, as does `kvproxy rm`): " in err
    assert f"{bad.key[:12]}: size" in err
    assert bad.key in store.entries  # ls changes nothing
    code, out, err = run(capsys, "rm", "--all", "--cache-dir", str(tmp_path))
    assert code == 0 and "removed 2 entries" in out
    assert names(tmp_path) == set()


async def test_a_running_proxy_notices_removals(
    make: Maker, capsys: pytest.CaptureFixture[str]
) -> None:
    fake, proxy = await make()
    for c in (1, 2, 3):
        await chat(proxy, conv(c))
    await settle(proxy)
    root = proxy.cache.store.root
    assert proxy.stats()["entries"] == 3  # 1 evicted; 2 and 3 saved in the background
    code, _, _ = await asyncio.to_thread(run, capsys, "rm", "--all", "--cache-dir", str(root))
    assert code == 0
    await proxy.cache.notice_removals()  # what housekeeping does every second
    stats = proxy.stats()
    assert stats["entries"] == 0 and stats["disk_bytes"] == 0
