"""The disk store: commit marker, sweep, eviction, sidecars — on a real directory."""

from __future__ import annotations

import os
import stat
import time
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
    assert again.entries[entry.key].bytes == 1100  # state + sidecar
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
    assert store.entries[entry.key].bytes == 2000
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
