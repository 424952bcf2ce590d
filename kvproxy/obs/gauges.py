"""The gauges `/metrics` reads off the cache when scraped: entries and bytes on disk, queue
depth, slots, namespaces kept, background faults."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvproxy.cache.servers.slotpool import SlotPool


class Gauged(Protocol):
    """What the scrape reads off the cache."""

    def pools(self) -> Sequence[tuple[str, SlotPool, bool]]:
        """Per llama-server: (its name, its slot pool, whether it is in rotation)."""
        ...

    @property
    def enabled(self) -> bool: ...

    @property
    def disk_enabled(self) -> bool: ...

    def disk_usage(self) -> tuple[int, int, int]:
        """(entries, bytes, budget)."""
        ...

    def namespaces(self) -> Mapping[str, tuple[int, int]]:
        """Per kind of per-namespace memory: (namespaces kept, evicted so far)."""
        ...

    def fault_summary(self) -> Mapping[str, tuple[bool, int]]:
        """Per kind of background work: (failing now, errors so far)."""
        ...


class CacheCollector:
    """What is read off the cache at scrape time."""

    def __init__(self, cache: Gauged) -> None:
        self.cache = cache

    def collect(self) -> Iterator[Metric]:
        cache = self.cache
        pools = cache.pools()
        slots = [slot for _, pool, _ in pools for slot in pool.slots]
        entries, used, budget = cache.disk_usage()
        yield _gauge("kvproxy_cache_entries", "Entries in the cache dir.", entries)
        yield _gauge(
            "kvproxy_cache_bytes",
            "Bytes of the entries in the cache dir (states, sidecars, conversation text).",
            used,
        )
        yield _gauge(
            "kvproxy_cache_budget_bytes",
            "The cache dir's byte budget (--max-disk; 0 = none).",
            budget,
        )
        yield _gauge(
            "kvproxy_queue_depth",
            "Requests waiting for a slot.",
            sum(pool.waiting for _, pool, _ in pools),
        )
        yield _gauge("kvproxy_slots", "llama-server slots.", len(slots))
        yield _gauge(
            "kvproxy_slots_busy",
            "Slots serving a request or a save/restore.",
            sum(1 for s in slots if s.busy),
        )
        held = GaugeMetricFamily(
            "kvproxy_slot_tokens",
            "Tokens of the conversation each slot holds, by server and slot.",
            labels=["backend", "slot"],
        )
        up = GaugeMetricFamily(
            "kvproxy_backend_up",
            "1 while a llama-server is in rotation (answers, pins slots), by server.",
            labels=["backend"],
        )
        busy = GaugeMetricFamily(
            "kvproxy_backend_slots_busy",
            "Busy slots by server.",
            labels=["backend"],
        )
        for name, pool, in_rotation in pools:
            up.add_metric([name], int(in_rotation))
            busy.add_metric([name], sum(1 for s in pool.slots if s.busy))
            for slot in pool.slots:
                tokens = slot.holding.n_tokens if slot.holding else 0
                held.add_metric([name, str(slot.id)], tokens)
        yield held
        yield up
        yield busy
        yield _gauge(
            "kvproxy_caching_enabled",
            "1 when slot pinning works (GET /slots answered).",
            int(cache.enabled),
        )
        kept = GaugeMetricFamily(
            "kvproxy_namespaces",
            "Namespaces whose learnt state is kept, by kind (habits, openings).",
            labels=["kind"],
        )
        evicted = CounterMetricFamily(
            "kvproxy_namespace_evictions",
            "Namespaces whose learnt state was dropped to keep within the per-tenant and "
            "total bounds (least recently used first), by kind.",
            labels=["kind"],
        )
        for kind, (n_kept, n_evicted) in cache.namespaces().items():
            kept.add_metric([kind], n_kept)
            evicted.add_metric([kind], n_evicted)
        yield kept
        yield evicted
        failing = GaugeMetricFamily(
            "kvproxy_background_failing",
            "1 while a kind of background work (a store update, housekeeping, writing habits) "
            "keeps failing, e.g. on a full disk; logged once when it starts and once when it "
            "ends.",
            labels=["kind"],
        )
        errors = CounterMetricFamily(
            "kvproxy_background_errors",
            "Failures of background work, by kind.",
            labels=["kind"],
        )
        for kind, (now, n_errors) in cache.fault_summary().items():
            failing.add_metric([kind], int(now))
            errors.add_metric([kind], n_errors)
        yield failing
        yield errors
        yield _gauge(
            "kvproxy_disk_cache_enabled",
            "1 while slot save/restore works (llama-server has --slot-save-path).",
            int(cache.disk_enabled),
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)
