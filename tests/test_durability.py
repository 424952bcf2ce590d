"""A save a request waits for costs the server's write, not the commit (fsync, checksum,
index row): the commit follows in the background, and the state is only restored once it
is committed."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from kvproxy.store import Entry
from kvproxy.store.files import TMP_MARK, StoreFiles

from .conftest import Maker, committed
from .test_cache import chat, conv, settle, then


@pytest.fixture
def held_commits(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Every commit blocks (on its thread, as an fsync of a big state would) until the event
    is set; the test sets it before it ends."""
    release = threading.Event()
    commit = StoreFiles.commit

    def blocked(self: StoreFiles, entry: Entry, temp: str, old: Entry | None) -> Entry | None:
        release.wait(60)
        return commit(self, entry, temp, old)

    monkeypatch.setattr(StoreFiles, "commit", blocked)
    return release


async def test_the_request_that_vacates_a_slot_waits_for_no_commit(
    make: Maker, held_commits: threading.Event
) -> None:
    fake, proxy = await make(server={"n_slots": 1}, live_window=0)
    try:
        _, r1, _ = await chat(proxy, conv(1))
        # Conversation 2 takes the only slot: 1 is saved first, its commit held back.
        status, r2, h2 = await asyncio.wait_for(chat(proxy, conv(2)), 30)
        assert status == 200 and r2["choices"][0]["message"]["content"].startswith("Echo:")
        assert h2["X-KVProxy-Cache"] == "miss"
        saved = [a for a in fake.actions if a[0] == "save"]
        assert len(saved) == 1  # the server wrote conversation 1 ...
        assert committed(fake.save_dir) == set()  # ... and nothing is committed yet
        assert any(TMP_MARK in p.name for p in Path(fake.save_dir).iterdir())
        # Conversation 1 comes back while its commit is held: it waits for it, then restores.
        back = asyncio.ensure_future(chat(proxy, then(conv(1), r1)))
        await asyncio.sleep(0.3)
        assert not back.done()
        held_commits.set()
        status, _, h1 = await asyncio.wait_for(back, 30)
        assert status == 200 and h1["X-KVProxy-Cache"] == "restored"
    finally:
        held_commits.set()
    await settle(proxy)


def _state_files(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.endswith((".kv", ".msgs")))


async def test_a_save_bigger_than_the_whole_budget_is_not_attempted(make: Maker) -> None:
    """A ~26 KB state under a 10 KB --max-disk: the first is written (its size not known
    yet) and dropped; the next is not even asked of the server. Requests are all answered,
    nothing is left on disk, and /metrics counts both."""
    from .test_metrics import parse, scrape, total

    fake, proxy = await make(server={"n_slots": 1}, live_window=0, max_disk=10_000)
    for c in (1, 2, 3):
        status, body, _ = await chat(proxy, conv(c))
        assert status == 200 and body["choices"][0]["message"]["content"].startswith("Echo:")
    await settle(proxy)
    assert len([a for a in fake.actions if a[0] == "save"]) == 1  # 2's save never asked for
    assert _state_files(fake.save_dir) == [] and committed(fake.save_dir) == set()
    assert not [p for p in Path(fake.save_dir).iterdir() if TMP_MARK in p.name]
    _, text = await scrape(proxy)
    assert total(parse(text), "kvproxy_saves_over_budget_total") == 2


async def test_room_is_made_before_a_save_not_after(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-disk holds for two states: the third save evicts the oldest before the server
    writes it, so the dir never holds more than the budget, the write included."""
    fake, proxy = await make(server={"n_slots": 1}, live_window=0, max_disk=70_000)
    cache = Path(fake.save_dir)
    peaks: list[int] = []
    save = fake._save

    def measured(*args: Any) -> Any:
        status, body = save(*args)
        peaks.append(
            sum(
                p.stat().st_size
                for p in cache.iterdir()
                if TMP_MARK in p.name or p.name.endswith((".kv", ".msgs"))
            )
        )
        return status, body

    monkeypatch.setattr(fake, "_save", measured)
    for c in (1, 2, 3, 4, 5):
        status, _, _ = await chat(proxy, conv(c))
        assert status == 200
        await settle(proxy)
    assert len(peaks) == 4 and len(committed(cache)) == 2
    assert max(peaks) <= 70_000, peaks
