"""The disk store: commit marker, sweep, eviction, sidecars — on a real directory."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvproxy import keys
from kvproxy.store import DB_NAME, STATE_MAGIC, Entry, IndexDB, Store

from .conftest import NOT_ENTRIES

NS = keys.namespace("m", {}, None)


def state_bytes(n_tokens: int, size: int = 1000) -> bytes:
    head = STATE_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little")
    head += (n_tokens + 3).to_bytes(4, "little")
    return head + b"\0" * (size - len(head))


def save(
    store: Store,
    messages: int,
    size: int = 1000,
    sidecar: bool = False,
    model: str = "",
    kind: str = "",
) -> Entry:
    """Do what a save does: the server writes the temp file (and sidecar), we commit."""
    chain = keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(messages)])
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10, size))
    if sidecar:
        (store.root / f"{temp}.ckpt").write_bytes(b"c" * 100)
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, messages, now, now, chain=chain, model=model, kind=kind)
    return store.commit(entry, temp)


def legacy(root: Path, messages: int, size: int = 1000, sidecar: bool = False) -> Entry:
    """An entry as kvproxy before the SQLite index left it: `<key>.kv` and `<key>.idx`."""
    chain = keys.chain(NS, [{"role": "user", "content": f"old{i}"} for i in range(messages)])
    entry = Entry(chain[-1], NS, 10, size, messages, 1.0, 2.0 + messages, chain=chain)
    (root / f"{entry.key}.kv").write_bytes(state_bytes(10, size))
    if sidecar:
        (root / f"{entry.key}.kv.ckpt").write_bytes(b"c" * 100)
        entry.state_bytes += 100
    (root / f"{entry.key}.idx").write_bytes(entry.to_json())
    return entry


def names(root: Path) -> list[str]:
    """The cache dir's files but the index's own."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(NOT_ENTRIES))


def test_commit_writes_state_then_row(tmp_path: Path) -> None:
    store = Store(tmp_path / "c", ttl=3600, max_bytes=0)
    store.open()
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.root / DB_NAME).st_mode) == 0o600
    entry = save(store, 3)
    assert (store.root / f"{entry.key}.kv").stat().st_size == 1000
    assert store.entries[entry.key] == entry  # the row is the commit marker
    assert names(store.root) == [f"{entry.key}.kv"]  # no .idx, no temp
    assert stat.S_IMODE(os.stat(store.root / f"{entry.key}.kv").st_mode) == 0o600
    found = store.lookup(
        keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(5)]), NS
    )
    assert found is not None and found[0].key == entry.key and found[1] == 3
    assert store.total_bytes == 1000 and store.summary.entries == 1


def test_reopen_keeps_the_rows_and_sweeps_orphans(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2, sidecar=True)
    orphan = "ab" * 16
    (tmp_path / f"{orphan}.kv").write_bytes(state_bytes(5))  # a .kv with no row
    (tmp_path / f"{entry.key}.1234abcd.tmp").write_bytes(b"half a save")
    (tmp_path / "notes.txt").write_text("not ours")
    store.close()  # a restart: a kvproxy still running keeps its files in flight

    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert list(again.entries) == [entry.key]
    assert again.entries[entry.key].state_bytes == 1100  # state + sidecar
    assert names(tmp_path) == sorted([f"{entry.key}.kv", f"{entry.key}.kv.ckpt", "notes.txt"])


def test_state_without_row_is_never_used(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2)
    IndexDB(tmp_path).delete(entry.key)  # a crash between the state's rename and its row
    store.close()
    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert again.entries == {}
    assert again.lookup(entry.chain, NS) is None
    assert not (tmp_path / f"{entry.key}.kv").exists()


def test_a_row_whose_state_file_is_gone_is_dropped_at_start(tmp_path: Path) -> None:
    """An older kvproxy opened the dir meanwhile (it sweeps every .kv with no .idx)."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    entry = save(store, 2)
    (tmp_path / f"{entry.key}.kv").unlink()
    again = Store(tmp_path, ttl=3600, max_bytes=0)
    again.open()
    assert again.entries == {} and again.total_bytes == 0


def test_old_idx_records_are_imported_once(tmp_path: Path) -> None:
    a, b = legacy(tmp_path, 2, sidecar=True), legacy(tmp_path, 3)
    (tmp_path / f"{b.key}.msgs").write_bytes(b'[{"role":"user","content":"x"}]')
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    assert set(store.entries) == {a.key, b.key}
    assert store.entries[a.key].sidecars == (".ckpt",)
    assert store.entries[b.key].msgs_bytes == 31
    assert store.total_bytes == 1100 + 1000 + 31
    # The records are gone: an older kvproxy opening the dir sweeps rather than trusts them.
    assert not list(tmp_path.glob("*.idx"))
    assert store.files.check_state_file(store.entries[a.key]) is None
    found = store.lookup(b.chain, NS)
    assert found is not None and found[0].key == b.key and found[1] == 3
    again = Store(tmp_path, ttl=0, max_bytes=0)
    again.open()
    assert again.entries == store.entries


@pytest.mark.parametrize("damage", ["truncate", "zero", "magic", "symlink", "index", "foreign"])
def test_damaged_old_records_are_not_imported(tmp_path: Path, damage: str) -> None:
    entry = legacy(tmp_path, 2)
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
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    store.open()
    assert store.entries == {} and store.problems
    assert not list(tmp_path.glob("*.kv"))  # swept


def test_ttl_eviction(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=60, max_bytes=0)
    store.open()
    old, new = save(store, 1), save(store, 2)
    store.set_last_used(old.key, time.time() - 120)
    victims = store.select_victims()
    assert [v.key for v in victims] == [old.key]
    assert old.key not in store.entries  # the row went first
    store.delete_files(victims)
    assert not (tmp_path / f"{old.key}.kv").exists()
    assert (tmp_path / f"{new.key}.kv").exists()
    assert store.lookup(old.chain, NS) is not None  # new's chain holds old's key ...
    assert store.lookup(old.chain, NS)[0].key == new.key  # type: ignore[index]


def test_size_eviction_is_lru_and_takes_sidecars(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=2500)
    store.open()
    a = save(store, 1, sidecar=True)  # 1100 bytes
    b = save(store, 2)
    c = save(store, 3)
    store.set_last_used(a.key, 1)
    store.set_last_used(b.key, 3)
    store.set_last_used(c.key, 2)
    assert [v.key for v in store.select_victims(dry_run=True)] == [a.key]
    assert len(store.entries) == 3  # a dry run changes nothing
    victims = store.select_victims()
    assert [v.key for v in victims] == [a.key]
    store.delete_files(victims)
    assert not list(tmp_path.glob(f"{a.key}*"))
    assert store.total_bytes == 2000


def test_pinned_entries_are_not_evicted(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=1, max_bytes=0)
    store.open()
    a = save(store, 1)
    store.set_last_used(a.key, 0)
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
    assert names(tmp_path) == [f"{entry.key}.kv"]
    assert store.total_bytes == 2000 and store.summary.entries == 1


def test_check_state_file(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = save(store, 1)
    assert store.files.check_state_file(entry) is None
    (tmp_path / f"{entry.key}.kv").write_bytes(b"x" * 1000)
    assert "not a llama.cpp" in (store.files.check_state_file(entry) or "")
    (tmp_path / f"{entry.key}.kv").unlink()
    assert store.files.check_state_file(entry) is not None


def test_entries_of_another_model_never_match(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    save(store, 2)
    conversation = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    other_model = keys.namespace("another-model.gguf", {}, None)
    assert store.lookup(keys.chain(other_model, conversation), other_model) is None
    assert store.lookup(keys.chain(NS, conversation), NS) is not None


def test_lookup_prefers_the_entry_ending_closest_then_the_latest(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    short, long_ = save(store, 2), save(store, 4)
    request = keys.chain(NS, [*_msgs(2), {"role": "user", "content": "z"}])
    found = store.lookup(request, NS)  # shares 2 keys with both: the one ending there wins
    assert found is not None and found[0].key == short.key and found[1] == 2
    found = store.lookup(keys.chain(NS, _msgs(3)), NS)
    assert found is not None and found[0].key == long_.key and found[1] == 3
    # Two entries of one depth sharing the request's first key: the latest used wins.
    x = keys.chain(NS, [{"role": "user", "content": "m0"}, {"role": "user", "content": "x"}])
    (tmp_path / "t").write_bytes(state_bytes(10))
    other = store.commit(Entry(x[-1], NS, 10, 0, 2, 0, 0, chain=x), "t")
    probe = keys.chain(NS, [{"role": "user", "content": "m0"}, {"role": "user", "content": "y"}])
    store.set_last_used(short.key, 10)
    store.set_last_used(other.key, 20)
    assert store.lookup(probe, NS)[0].key == other.key  # type: ignore[index]
    store.set_last_used(short.key, 30)
    assert store.lookup(probe, NS)[0].key == short.key  # type: ignore[index]
    got = {e.key: d for e, d in store.candidates(keys.chain(NS, _msgs(5)), NS)}
    assert got == {long_.key: 4, short.key: 2}


def _msgs(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"m{i}"} for i in range(n)]


def test_a_commit_of_nothing_keeps_the_old_entry(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    store.open()
    entry = save(store, 2)
    again = Entry(entry.key, NS, 10, 0, 2, 0, 0, chain=entry.chain)
    with pytest.raises(FileNotFoundError, match="wrote no file"):
        store.commit(again, store.temp_name(entry.key))  # the server wrote nothing there
    assert store.entries == {entry.key: entry}
    assert store.files.check_state_file(entry) is None


def test_another_process_sees_the_same_rows(tmp_path: Path) -> None:
    """`kvproxy rm` in another process: the proxy's next query has it, with no rescan."""
    proxy = Store(tmp_path, ttl=0, max_bytes=0)
    proxy.open()
    entry = save(proxy, 2)
    with ThreadPoolExecutor(1) as pool:  # its own connection, as another process has
        cli = Store(tmp_path, ttl=0, max_bytes=0)
        assert pool.submit(cli.open_readonly).result() == []
        assert pool.submit(lambda: list(cli.entries)).result() == [entry.key]
        assert pool.submit(cli.remove, entry.key).result() == entry
    assert proxy.lookup(entry.chain, NS) is None
    assert proxy.entries == {} and not (tmp_path / f"{entry.key}.kv").exists()


# --- the proxy's calls: the database on its thread, file I/O in threads


async def save_async(store: Store, messages: int, size: int = 1000) -> Entry:
    chain = keys.chain(NS, [{"role": "user", "content": f"m{i}"} for i in range(messages)])
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10, size))
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, messages, now, now, chain=chain)
    return await store.commit_async(entry, temp)


def on_disk(root: Path) -> set[str]:
    return {p.name[:-3] for p in root.iterdir() if p.suffix == ".kv"}


async def test_async_calls_keep_index_and_disk_in_step(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    a, b = await save_async(store, 1), await save_async(store, 2)
    assert set(store.entries) == on_disk(tmp_path) == {a.key, b.key}
    assert store.entries[a.key].state_bytes == 1000
    await store.touch_async(a.key)
    assert store.entries[a.key].hits == 1
    assert await store.contains_async(a.key)
    found = await store.lookup_async(b.chain, NS)
    assert found is not None and found[0].key == b.key
    await store.remove_async(a)
    assert set(store.entries) == on_disk(tmp_path) == {b.key}
    assert not list(tmp_path.glob(f"{a.key}*"))
    Store(tmp_path, 0, 0).remove(b.key)  # what `kvproxy rm` does
    assert store.total_bytes == 1000  # the summary is as of the last query ...
    assert await store.forget_removed_async() == []
    assert store.total_bytes == 0  # ... and housekeeping's refresh sees the removal
    assert await store.lookup_async(b.chain, NS) is None
    store.close()


async def test_a_use_cannot_bring_back_a_removed_entry(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    entry = await save_async(store, 1)
    await store.remove_async(entry)
    await store.touch_async(entry.key)
    assert store.entries == {} and names(tmp_path) == []
    store.close()


async def test_a_cancelled_commit_still_lands_in_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    commit = store.files.commit

    def slow_commit(entry: Entry, temp: str, old: Entry | None) -> Entry | None:
        time.sleep(0.2)
        return commit(entry, temp, old)

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
    store.close()


async def test_an_eviction_racing_a_commit_of_its_victim_keeps_the_new_files(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=1500)
    await store.open_async()
    first = await save_async(store, 1)
    store.max_bytes = 500  # over budget: the eviction's victim is the entry being re-saved
    saving = asyncio.ensure_future(save_async(store, 1, size=400))
    victims = await store.select_victims_async()
    await store.delete_files_async(victims)
    again = await saving
    assert victims == [] or victims[0].key != first.key
    assert store.entries[first.key].state_bytes == 400
    assert store.files.check_state_file(again) is None
    store.close()
