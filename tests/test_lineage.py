"""One conversation, one state on disk: the rule on plain data (cache/disk/lineage.py), and the store
removing what it names once the newer state is committed; room under --max-disk before a
save (cache/disk/room.py)."""

from __future__ import annotations

import time
from pathlib import Path

from kvproxy import keys
from kvproxy.cache.disk.lineage import Older, superseded
from kvproxy.store import Entry, Store
from kvproxy.store.entry import SHARED, TURN

from .test_store import NS, names, state_bytes

TURNS = [Older("t1", 3, True), Older("t3", 7, True), Older("t2", 5, True)]


def test_a_dense_model_keeps_only_the_newest_state() -> None:
    assert sorted(superseded("prefix", TURNS)) == ["t1", "t2", "t3"]


def test_window_and_extension_models_keep_one_turn_back() -> None:
    for rule in ("window", "extension", None):
        assert sorted(superseded(rule, TURNS)) == ["t1", "t2"]  # t3, the deepest, stays


def test_shared_starts_and_unkinded_entries_are_never_superseded() -> None:
    opening = Older("opening", 1, False)
    assert superseded("prefix", [opening]) == []
    assert superseded("extension", [opening, Older("t1", 3, True)]) == []
    assert superseded("prefix", [opening, Older("t1", 3, True)]) == ["t1"]


def test_a_state_another_layout_saved_is_never_superseded() -> None:
    """Refused by this server (saved with flash attention on, say): kept for when the server
    runs that way again, whatever newer state this layout saves."""
    refused = Older("t1", 3, True, set_aside=True)
    assert superseded("prefix", [refused]) == []
    assert superseded("prefix", [refused, Older("t2", 5, True)]) == ["t2"]
    assert superseded("extension", [refused, Older("t2", 5, True), Older("t3", 7, True)]) == ["t2"]


def commit(store: Store, turns: int, kind: str = TURN, size: int = 1000) -> Entry:
    messages = [{"role": "user", "content": f"m{i}"} for i in range(turns)]
    chain = keys.chain(NS, messages)
    temp = store.temp_name(chain[-1])
    (store.root / temp).write_bytes(state_bytes(10, size))
    now = time.time()
    entry = Entry(chain[-1], NS, 10, 0, turns, now, now, chain=chain, kind=kind)
    return store.commit(entry, temp)


async def test_the_store_removes_the_superseded_rows_and_files(tmp_path: Path) -> None:
    store = Store(tmp_path / "cache", ttl=0, max_bytes=0)
    store.open()
    try:
        opening = commit(store, 1, SHARED)
        older = [commit(store, n) for n in (2, 3, 4)]
        newest = commit(store, 5)
        before = store.summary.bytes
        removed = await store.supersede_async(
            newest,
            lambda found: superseded(
                "extension", [Older(e.key, len(e.chain), e.kind == TURN) for e in found]
            ),
        )
        assert {e.key for e in removed} == {older[0].key, older[1].key}
        assert set(store.entries) == {opening.key, older[2].key, newest.key}
        assert {n.split(".")[0] for n in names(store.root)} == set(store.entries)
        assert store.summary.bytes == before - sum(e.on_disk for e in removed)
    finally:
        store.close()


def test_room_for_a_save_counts_the_states_still_committing() -> None:
    from kvproxy.cache.disk.room import Room, room_for

    assert room_for(0, 5_000, 100) == Room(True, 0)  # no budget: nothing to make room for
    assert room_for(10_000, None, 100) == Room(True, 0)  # size not known: evicted after
    assert room_for(10_000, 4_000, 3_000) == Room(True, 7_000)
    assert room_for(10_000, 10_001, 0) == Room(False, 0)  # bigger than all of it: not written
