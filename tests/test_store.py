"""The disk store: commit marker, sweep, eviction, sidecars — on a real directory."""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvproxy import keys
from kvproxy.store import STATE_MAGIC, Entry, Store

NS = keys.namespace("m", {}, None)


def state_bytes(n_tokens: int, size: int = 1000) -> bytes:
    head = STATE_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little")
    head += (n_tokens + 3).to_bytes(4, "little")
    return head + b"\0" * (size - len(head))


def save(store: Store, messages: int, size: int = 1000, sidecar: bool = False) -> Entry:
    """Do what a save does: the server writes the temp file (and sidecar), we commit."""
    chain = keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(messages)])
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10, size))
    if sidecar:
        (store.root / f"{temp}.ckpt").write_bytes(b"c" * 100)
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, messages, now, now, chain=chain)
    return store.commit(entry, temp)


def test_commit_writes_state_then_index(tmp_path: Path) -> None:
    store = Store(tmp_path / "c", ttl=3600, max_bytes=0)
    store.open()
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    entry = save(store, 3)
    assert (store.root / f"{entry.key}.kv").stat().st_size == 1000
    assert (store.root / f"{entry.key}.idx").exists()
    assert stat.S_IMODE(os.stat(store.root / f"{entry.key}.kv").st_mode) == 0o600
    assert not [p for p in store.root.iterdir() if ".tmp" in p.name]
    found = store.lookup(
        keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(5)]), NS
    )
    assert found is not None and found[0].key == entry.key and found[1] == 3


def test_reopen_loads_index_and_sweeps_orphans(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2, sidecar=True)
    orphan = "ab" * 16
    (tmp_path / f"{orphan}.kv").write_bytes(state_bytes(5))  # a .kv with no .idx
    (tmp_path / f"{entry.key}.1234abcd.tmp").write_bytes(b"half a save")
    (tmp_path / "notes.txt").write_text("not ours")

    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert list(again.entries) == [entry.key]
    assert again.entries[entry.key].state_bytes == 1100  # state + sidecar
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(
        [f"{entry.key}.idx", f"{entry.key}.kv", f"{entry.key}.kv.ckpt", "notes.txt"]
    )


def test_state_without_index_is_never_used(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2)
    (tmp_path / f"{entry.key}.idx").unlink()  # crash between state and commit marker
    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert again.entries == {}
    assert not (tmp_path / f"{entry.key}.kv").exists()


@pytest.mark.parametrize("damage", ["truncate", "zero", "magic", "symlink", "index", "foreign"])
def test_damaged_entries_are_dropped_at_start(tmp_path: Path, damage: str) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2)
    kv = tmp_path / f"{entry.key}.kv"
    if damage == "truncate":
        kv.write_bytes(kv.read_bytes()[:100])
    elif damage == "zero":
        kv.write_bytes(b"")
    elif damage == "foreign":  # a record copied in under another entry's name
        other = "cd" * 16
        (tmp_path / f"{other}.idx").write_bytes((tmp_path / f"{entry.key}.idx").read_bytes())
        (tmp_path / f"{other}.kv").write_bytes(kv.read_bytes())
        (tmp_path / f"{entry.key}.idx").unlink()
    elif damage == "magic":
        kv.write_bytes(b"\0" * 1000)
    elif damage == "symlink":
        target = tmp_path / "elsewhere"
        target.write_bytes(kv.read_bytes())
        kv.unlink()
        kv.symlink_to(target)
    else:
        (tmp_path / f"{entry.key}.idx").write_bytes(b"{not json")
    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert again.entries == {}


def test_ttl_eviction(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=60, max_bytes=0)
    store.open()
    old, new = save(store, 1), save(store, 2)
    store.entries[old.key].last_used = time.time() - 120
    victims = store.select_victims()
    assert [v.key for v in victims] == [old.key]
    store.delete_files(victims)
    assert not (tmp_path / f"{old.key}.kv").exists() and not (tmp_path / f"{old.key}.idx").exists()
    assert (tmp_path / f"{new.key}.kv").exists()


def test_size_eviction_is_lru_and_takes_sidecars(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=2500)
    store.open()
    a = save(store, 1, sidecar=True)  # 1100 bytes
    b = save(store, 2)
    c = save(store, 3)
    store.entries[a.key].last_used = 1
    store.entries[b.key].last_used = 3
    store.entries[c.key].last_used = 2
    victims = store.select_victims()
    assert [v.key for v in victims] == [a.key]
    store.delete_files(victims)
    assert not list(tmp_path.glob(f"{a.key}*"))
    assert store.total_bytes == 2000


def test_pinned_entries_are_not_evicted(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=1, max_bytes=0)
    store.open()
    a = save(store, 1)
    store.entries[a.key].last_used = 0
    store.pin(a.key)
    assert store.select_victims() == []
    store.unpin(a.key)
    assert [v.key for v in store.select_victims()] == [a.key]


def test_resave_replaces_the_entry(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    save(store, 2, size=1000, sidecar=True)
    entry = save(store, 2, size=2000)
    assert store.entries[entry.key].state_bytes == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{entry.key}.idx", f"{entry.key}.kv"]


def test_check_state_file(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = save(store, 1)
    assert store.check_state_file(entry) is None
    (tmp_path / f"{entry.key}.kv").write_bytes(b"x" * 1000)
    assert "not a llama.cpp" in (store.check_state_file(entry) or "")
    (tmp_path / f"{entry.key}.kv").unlink()
    assert store.check_state_file(entry) is not None


def test_entries_of_another_model_never_match(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    save(store, 2)
    conversation = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    other_model = keys.namespace("another-model.gguf", {}, None)
    assert store.lookup(keys.chain(other_model, conversation), other_model) is None
    assert store.lookup(keys.chain(NS, conversation), NS) is not None


def test_a_commit_of_nothing_keeps_the_old_entry(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = save(store, 2)
    again = Entry(entry.key, NS, 10, 0, 2, 0, 0, chain=entry.chain)
    with pytest.raises(FileNotFoundError, match="wrote no file"):
        store.commit(again, store.temp_name(entry.key))  # the server wrote nothing there
    assert store.entries == {entry.key: entry}
    assert store.check_state_file(entry) is None


def test_the_index_changes_only_on_its_own_thread(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    with ThreadPoolExecutor(1) as pool, pytest.raises(RuntimeError, match="off its thread"):
        pool.submit(save, store, 1).result()  # what asyncio.to_thread(store.commit) did
    assert store.entries == {}


# --- the proxy's calls: file I/O in a thread, the index on the loop


async def save_async(store: Store, messages: int, size: int = 1000) -> Entry:
    chain = keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(messages)])
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10, size))
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, messages, now, now, chain=chain)
    return await store.commit_async(entry, temp)


def on_disk(root: Path) -> set[str]:
    return {p.name[:-4] for p in root.iterdir() if p.suffix == ".idx"}


async def test_async_calls_keep_index_and_disk_in_step(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    a, b = await save_async(store, 1), await save_async(store, 2)
    assert store._owner == threading.get_ident()  # the loop's thread
    assert set(store.entries) == on_disk(tmp_path) == {a.key, b.key}
    assert store.entries[a.key].state_bytes == 1000
    await store.touch_async(a.key)
    assert store.entries[a.key].hits == 1
    assert Entry.from_json((tmp_path / f"{a.key}.idx").read_bytes()).hits == 1
    await store.remove_async(a)
    assert set(store.entries) == on_disk(tmp_path) == {b.key}
    assert not list(tmp_path.glob(f"{a.key}*"))
    (tmp_path / f"{b.key}.idx").unlink()  # what `kvproxy rm` does first
    assert await store.forget_removed_async() == [b.key]
    assert store.entries == {}
    reopened = Store(tmp_path, ttl=0, max_bytes=0)
    await reopened.open_async()
    assert reopened.entries == {} and list(tmp_path.iterdir()) == []  # b's state was swept


async def test_a_record_rewrite_cannot_outlive_a_later_delete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    entry = await save_async(store, 1)
    rewrite = store.files.rewrite_record

    def slow_rewrite(key: str, record: bytes) -> None:
        time.sleep(0.2)  # a slow disk: the eviction below is issued meanwhile
        rewrite(key, record)

    monkeypatch.setattr(store.files, "rewrite_record", slow_rewrite)
    touch = asyncio.ensure_future(store.touch_async(entry.key))
    await asyncio.sleep(0)  # the rewrite is under way
    await store.remove_async(entry)
    await touch
    assert list(tmp_path.iterdir()) == []  # no .idx came back without its state


async def test_a_cancelled_commit_still_lands_in_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    commit = store.files.commit

    def slow_commit(entry: Entry, temp: str) -> Entry | None:
        time.sleep(0.2)
        return commit(entry, temp)

    monkeypatch.setattr(store.files, "commit", slow_commit)
    saving = asyncio.ensure_future(save_async(store, 1))
    await asyncio.sleep(0.05)
    saving.cancel()  # the client hung up mid-save
    with pytest.raises(asyncio.CancelledError):
        await saving
    for _ in range(100):
        if store.entries:
            break
        await asyncio.sleep(0.01)
    assert set(store.entries) == on_disk(tmp_path) and len(store.entries) == 1


async def test_forget_removed_keeps_an_entry_committed_again_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    entry = await save_async(store, 1)
    (tmp_path / f"{entry.key}.idx").unlink()  # `kvproxy rm` ...
    missing = store.files.missing_records

    def slow_listing(keys: list[str]) -> list[str]:
        gone = missing(keys)
        time.sleep(0.2)  # ... and the proxy saves the same conversation again meanwhile
        return gone

    monkeypatch.setattr(store.files, "missing_records", slow_listing)
    checking = asyncio.ensure_future(store.forget_removed_async())
    await asyncio.sleep(0)
    again = await save_async(store, 1)
    assert await checking == []
    assert store.entries == {again.key: again} and on_disk(tmp_path) == {again.key}
