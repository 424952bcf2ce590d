"""Bounds on what one client can make kvproxy keep per namespace (cache/decisions/bounds.py): habits and
openings are LRUs per tenant and in total, habits.json stays under its read limit, and one
that is over it is trimmed to the most recently used entries, never discarded whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson

from kvproxy.cache.decisions import bounds
from kvproxy.cache.decisions.bounds import NamespaceLRU
from kvproxy.cache.habits import BYTE_BUDGET, Habits
from kvproxy.edge.app import SERVICE
from kvproxy.store import dirfiles

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_rewrites import SYSTEM, assistant, ctx, user


def learn_drop(habits: Habits, ns: str, tenant: str) -> None:
    """A DROP rewrite (OpenClaw's context message) learnt for `ns`."""
    ours = [SYSTEM, user("q1"), ctx(1), assistant("a1")]
    assert habits.learn(
        ns, ours, [SYSTEM, user("q1"), assistant("a1"), user("q2"), ctx(2)], 2, tenant
    )


def learn_cut(habits: Habits, ns: str, tenant: str, size: int = 16_000) -> None:
    """A CUT rewrite of `size` characters (the largest kind of habit) learnt for `ns`."""
    reminder = "\nREMINDER " + ns + " " + "x" * size
    ours = [SYSTEM, user("q1" + reminder), assistant("a1")]
    assert habits.learn(ns, ours, [SYSTEM, user("q1"), assistant("a1"), user("q2")], 1, tenant)


def test_the_lru_caps_a_tenant_then_takes_from_the_tenant_with_most() -> None:
    lru = NamespaceLRU(per_tenant=3, total=5)
    assert lru.add("a1", "A") == [] and lru.add("a2", "A") == []
    for i in range(10):
        lru.add(f"b{i}", "B")
    assert set(lru.owners()) == {"a1", "a2", "b7", "b8", "b9"}  # B's own cap; A untouched
    lru.add("c1", "C")  # past the total: B, holding the most, loses its oldest
    assert set(lru.owners()) == {"a1", "a2", "b8", "b9", "c1"}
    lru.touch("b8")
    lru.add("c2", "C")  # A, B and C hold as many: C, adding, pays
    assert set(lru.owners()) == {"a1", "a2", "b8", "b9", "c2"}
    assert lru.evicted == 9


def test_one_tenants_flood_of_namespaces_never_removes_another_tenants_habits(
    tmp_path: Path,
) -> None:
    habits = Habits()
    learn_drop(habits, "victim-ns", "tenant-a")
    for i in range(3 * bounds.TOTAL):
        learn_drop(habits, f"pad-{i}", "tenant-b")
    assert habits.rewrites.get("victim-ns")
    assert len(habits.kept) <= bounds.PER_TENANT + 1
    assert habits.evicted == 3 * bounds.TOTAL - bounds.PER_TENANT
    dirfiles.write(tmp_path, dirfiles.HABITS, habits.to_json())
    again = Habits()
    again.load(dirfiles.read(tmp_path, dirfiles.HABITS))
    assert again.rewrites.get("victim-ns") == habits.rewrites.get("victim-ns")
    assert again.kept.tenant_of("victim-ns") == "tenant-a"


def test_habits_json_stays_readable_and_the_biggest_tenant_pays_for_bytes(
    tmp_path: Path,
) -> None:
    habits = Habits()
    learn_cut(habits, "victim-ns", "tenant-a", size=2_000)
    for i in range(bounds.PER_TENANT):
        for j in range(4):  # four large rules per namespace
            learn_cut(habits, f"pad-{i}", "tenant-b", size=15_000 + j)
    raw = orjson.dumps(habits.to_json())
    assert len(raw) <= BYTE_BUDGET < dirfiles.MAX_BYTES
    assert habits.rewrites.get("victim-ns")
    assert habits.rewrites.get(f"pad-{bounds.PER_TENANT - 1}")  # the most recent of B's stay
    assert not habits.rewrites.get("pad-0")
    dirfiles.write(tmp_path, dirfiles.HABITS, habits.to_json())
    assert dirfiles.read(tmp_path, dirfiles.HABITS) is not None  # the default 1 MiB limit


def old_oversized_file(n: int) -> bytes:
    """habits.json as an earlier kvproxy wrote it after a flood: no owners, past 1 MiB."""
    rule = [["cut", "user", "\nREMINDER " + "y" * 4000]]
    rewrites = {"victim-ns": [["drop", "user", "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>"]]}
    rewrites.update({f"pad-{i}": rule * 4 for i in range(n)})
    return orjson.dumps({"version": 1, "echo": {}, "rewrites": rewrites})


def test_an_over_limit_habits_file_is_trimmed_not_discarded(tmp_path: Path) -> None:
    (tmp_path / dirfiles.HABITS).write_bytes(old_oversized_file(80))
    assert (tmp_path / dirfiles.HABITS).stat().st_size > dirfiles.MAX_BYTES
    habits = Habits()
    assert habits.load(dirfiles.read(tmp_path, dirfiles.HABITS, dirfiles.HABITS_READ_LIMIT))
    assert habits.rewrites.get("pad-79") and len(habits.kept) > 40  # the most recent kept
    assert not habits.rewrites.get("pad-0")
    assert len(orjson.dumps(habits.to_json())) <= BYTE_BUDGET


async def test_a_restarted_proxy_trims_an_over_limit_habits_file_and_writes_it_back(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (cache / dirfiles.HABITS).write_bytes(old_oversized_file(80))
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    proxy = await start_proxy(fake.url, cache)
    try:
        habits = proxy.app[SERVICE].cache.habits
        assert habits.rewrites.get("pad-79")
        for _ in range(100):  # housekeeping writes it back, trimmed
            if (cache / dirfiles.HABITS).stat().st_size <= dirfiles.MAX_BYTES:
                break
            await asyncio.sleep(0.05)
        kept = orjson.loads((cache / dirfiles.HABITS).read_bytes())
        assert "pad-79" in kept["rewrites"] and "pad-0" not in kept["rewrites"]
        exposition = proxy.app[SERVICE].metrics.exposition().decode()
        assert 'kvproxy_namespace_evictions_total{kind="habits"}' in exposition
        evicted = [
            line
            for line in exposition.splitlines()
            if line.startswith('kvproxy_namespace_evictions_total{kind="habits"}')
        ]
        assert float(evicted[0].split()[-1]) > 0
    finally:
        await proxy.stop()
        await fake.stop()


def test_openings_are_bounded_per_tenant() -> None:
    from kvproxy.cache.prefixes.openings import Openings

    openings = Openings.__new__(Openings)
    openings._seen = {}
    openings.kept = NamespaceLRU()
    openings._note("victim-ns", "k", 1, "tenant-a")
    for i in range(3 * bounds.TOTAL):
        openings._note(f"pad-{i}", "k", 1, "tenant-b")
    assert "victim-ns" in openings._seen
    assert len(openings._seen) == bounds.PER_TENANT + 1
    assert openings.kept.evicted == 3 * bounds.TOTAL - bounds.PER_TENANT
