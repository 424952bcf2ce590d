"""Prometheus metrics (`GET /metrics`) and the same numbers as JSON (`GET /kvproxy/stats`).

The one set of counters kvproxy keeps. Counters and histograms are fed by the cache's events
(a listener); gauges (entries and bytes on disk, queue depth, slots) are read off the cache
when scraped. Each proxy has its own registry: nothing global. The JSON stats
(`/kvproxy/stats`, `kvproxy stats`) are computed from the same metric objects, so both
always agree.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.reports.events import Count, RequestEvent, SlotActionEvent
from kvproxy.obs.gauges import CacheCollector, Gauged

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DECISIONS = tuple(d.value for d in Decision)
ACTIONS = ("save", "restore")

REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
ACTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BYTE_BUCKETS = tuple(float(1 << s) for s in range(20, 37, 2))  # 1 MiB … 64 GiB, ×4


class Metrics:
    """A cache listener that keeps Prometheus metrics for one proxy."""

    def __init__(self, routes: Iterable[str]) -> None:
        self.routes = frozenset(routes)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kvproxy_requests",
            "Requests by cache decision (resident, restored, miss, bypass, busy), route and "
            "status class.",
            ["decision", "route", "status"],
            registry=r,
        )
        self.backend_requests = Counter(
            "kvproxy_backend_requests",
            "Requests by llama-server (with several behind kvproxy) and cache decision.",
            ["backend", "decision"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvproxy_request_seconds",
            "Time from request to the end of the relayed reply, by cache decision.",
            ["decision"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvproxy_queue_wait_seconds",
            "Time a cached request waited for a slot.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.actions = Counter(
            "kvproxy_slot_actions",
            "Slot saves and restores kvproxy asked llama-server for, by result.",
            ["action", "result"],
            registry=r,
        )
        self.action_tokens = Counter(
            "kvproxy_slot_action_tokens",
            "Tokens in successful slot saves and restores.",
            ["action"],
            registry=r,
        )
        self.action_seconds = Histogram(
            "kvproxy_slot_action_seconds",
            "Latency of slot saves and restores (successful ones).",
            ["action"],
            buckets=ACTION_BUCKETS,
            registry=r,
        )
        self.action_bytes = Histogram(
            "kvproxy_slot_action_bytes",
            "Size on disk of the states saved and restored.",
            ["action"],
            buckets=BYTE_BUCKETS,
            registry=r,
        )
        self.tokens_cached = Counter(
            "kvproxy_tokens_cached",
            "Prompt tokens served from the KV cache (timings.cache_n of each reply).",
            registry=r,
        )
        self.tokens_prefilled = Counter(
            "kvproxy_tokens_prefilled",
            "Prompt tokens llama-server had to prefill (timings.prompt_n of each reply).",
            registry=r,
        )
        self.prefill_seconds = Counter(
            "kvproxy_prefill_seconds",
            "Time llama-server spent prefilling prompts (timings.prompt_ms of each reply).",
            registry=r,
        )
        self.prefill_saved = Counter(
            "kvproxy_prefill_seconds_saved",
            "Estimated prefill time saved: per reply, its cached tokens at the server's "
            "measured cold-prefill speed (recent replies that prefilled >= 256 tokens with "
            "little cache), less the time spent restoring them.",
            registry=r,
        )
        self.priced = 0  # replies the counter above priced (none before a cold prefill)
        self.miss_explained = Counter(
            "kvproxy_miss_explained",
            "Misses although a known conversation of the same namespace shared their "
            "beginning (logged with where they diverged), by where that conversation was.",
            ["source"],
            registry=r,
        )
        for decision in DECISIONS:
            self.request_seconds.labels(decision)
        for action in ACTIONS:
            for result in ("ok", "error"):
                self.actions.labels(action, result)
            self.action_tokens.labels(action)
            self.action_seconds.labels(action)
            self.action_bytes.labels(action)
        for source in ("slot", "disk"):
            self.miss_explained.labels(source)
        self.weak_hits = Counter(
            "kvproxy_weak_hits",
            "Resident or restored requests whose timings.cache_n fell below half of what the "
            "decision expected (logged with why), by decision.",
            ["decision"],
            registry=r,
        )
        for decision in (Decision.RESIDENT, Decision.RESTORED):
            self.weak_hits.labels(decision.value)
        self.background_saves = Counter(
            "kvproxy_background_saves",
            "Saves made off every request's path (idle slots saved under slot pressure or "
            "after --idle-save-after); the rest of kvproxy_slot_actions' saves ran on one.",
            registry=r,
        )
        self.counts = {
            Count.EVICTION: Counter(
                "kvproxy_evictions", "Cache entries evicted (TTL or byte budget).", registry=r
            ),
            Count.WASTED_RESTORE: Counter(
                "kvproxy_ineffective_restores",
                "Restores llama-server did not reuse (timings.cache_n far below the restored "
                "tokens): typically a sliding-window model without --swa-full.",
                registry=r,
            ),
            Count.SLOT_RESET: Counter(
                "kvproxy_slot_resets",
                "Times a slot was found changed behind kvproxy's back (server restart, idle "
                "wipe, another client).",
                registry=r,
            ),
            Count.PREFETCH: Counter(
                "kvproxy_prefetches",
                "Conversations waiting for a tool's result restored into a freed slot before "
                "their request came (cache/scheduling/prefetch.py).",
                registry=r,
            ),
            Count.SUPERSEDED: Counter(
                "kvproxy_superseded_states",
                "Older states of a conversation removed once a newer state of it that stands "
                "for them was committed (one conversation, one state on disk).",
                registry=r,
            ),
            Count.SAVE_TOO_BIG: Counter(
                "kvproxy_saves_over_budget",
                "Saves not attempted: the state (as estimated) is bigger than all of --max-disk.",
                registry=r,
            ),
            Count.PREFILL_OVER_RESTORE: Counter(
                "kvproxy_prefills_over_restores",
                "Stored states not restored because prefilling what they give back was measured "
                "cheaper than reading them (this disk's restores against this server's prefills).",
                registry=r,
            ),
        }

    def watch(self, cache: Gauged) -> None:
        """Read the gauges off `cache` at every scrape."""
        self.registry.register(CacheCollector(cache))

    # --- the listener

    def on_request(self, event: RequestEvent) -> None:
        self.requests.labels(
            event.decision, self._route(event.route), f"{event.status // 100}xx"
        ).inc()
        self.request_seconds.labels(event.decision).observe(event.duration_s)
        if event.backend is not None:
            self.backend_requests.labels(event.backend, event.decision).inc()
        if event.decision != "bypass":
            self.queue_wait.observe(event.queue_wait_s)
        if event.cache_n is not None:
            self.tokens_cached.inc(event.cache_n)
        if event.prompt_n is not None:
            self.tokens_prefilled.inc(event.prompt_n)
        if event.prompt_ms is not None:
            self.prefill_seconds.inc(event.prompt_ms / 1000)
        if event.prefill_saved_s is not None:
            self.prefill_saved.inc(event.prefill_saved_s)
            self.priced += 1
        if event.miss is not None:
            source = "slot" if event.miss.where.startswith("slot") else "disk"
            self.miss_explained.labels(source).inc()
        if event.weak is not None:
            self.weak_hits.labels(str(event.decision)).inc()

    def on_count(self, what: Count, n: int) -> None:
        self.counts[what].inc(n)

    def on_slot_action(self, event: SlotActionEvent) -> None:
        self.actions.labels(event.action, "ok" if event.ok else "error").inc()
        if event.ok:
            self.action_tokens.labels(event.action).inc(event.tokens)
            self.action_seconds.labels(event.action).observe(event.seconds)
            self.action_bytes.labels(event.action).observe(event.bytes)
            if event.background:
                self.background_saves.inc()

    def _route(self, path: str) -> str:
        # Label values must stay few: a client could otherwise mint one per path spelling.
        norm = posixpath.normpath("/" + path.lstrip("/"))
        return norm if norm in self.routes else "other"

    # --- output

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def snapshot(self) -> dict[str, Any]:
        """The counters and histogram summaries as JSON-friendly numbers."""
        requests = dict.fromkeys(DECISIONS, 0)
        by_status: dict[str, int] = {}
        for labels, value in _values(self.requests, "_total"):
            requests[labels["decision"]] = requests.get(labels["decision"], 0) + int(value)
            by_status[labels["status"]] = by_status.get(labels["status"], 0) + int(value)
        actions = {
            (lb["action"], lb["result"]): int(v) for lb, v in _values(self.actions, "_total")
        }
        tokens = {lb["action"]: int(v) for lb, v in _values(self.action_tokens, "_total")}
        histograms = {
            "request_seconds": _summary(self.request_seconds),
            "queue_wait_seconds": _summary(self.queue_wait),
            "save_seconds": _summary(self.action_seconds, action="save"),
            "restore_seconds": _summary(self.action_seconds, action="restore"),
            "save_bytes": _summary(self.action_bytes, action="save"),
            "restore_bytes": _summary(self.action_bytes, action="restore"),
        }
        cached = int(_total(self.tokens_cached))
        prefilled = int(_total(self.tokens_prefilled))
        return {
            "requests": requests,
            "requests_by_status": by_status,
            "saves": actions.get(("save", "ok"), 0),
            "save_failures": actions.get(("save", "error"), 0),
            "background_saves": int(_total(self.background_saves)),
            "restores": actions.get(("restore", "ok"), 0),
            "restore_failures": actions.get(("restore", "error"), 0),
            "saved_tokens": tokens.get("save", 0),
            "restored_tokens": tokens.get("restore", 0),
            "saved_bytes": int(histograms["save_bytes"]["sum"] or 0),
            "restored_bytes": int(histograms["restore_bytes"]["sum"] or 0),
            "tokens_cached": cached,
            "tokens_prefilled": prefilled,
            # Older names of the two above, kept so existing readers see the same numbers.
            "cache_n": cached,
            "prompt_n": prefilled,
            "prefill_seconds": _total(self.prefill_seconds),
            # None until a cold prefill priced a cached token (an estimate, not a guess).
            "prefill_seconds_saved": _total(self.prefill_saved) if self.priced else None,
            "miss_explained": int(sum(v for _, v in _values(self.miss_explained, "_total"))),
            "weak_hits": int(_total(self.weak_hits)),
            "evictions": int(_total(self.counts[Count.EVICTION])),
            "ineffective_restores": int(_total(self.counts[Count.WASTED_RESTORE])),
            "slot_resets_seen": int(_total(self.counts[Count.SLOT_RESET])),
            "prefetches": int(_total(self.counts[Count.PREFETCH])),
            "prefills_over_restores": int(_total(self.counts[Count.PREFILL_OVER_RESTORE])),
            "histograms": histograms,
        }


def _values(metric: Any, suffix: str) -> Iterator[tuple[dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith(suffix):
                yield sample.labels, sample.value


def _total(metric: Any) -> float:
    return sum(v for _, v in _values(metric, "_total"))


def _summary(metric: Any, **want: str) -> dict[str, float | None]:
    """Count, sum, p50 and p90 of a histogram (summed over label sets matching `want`)."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for family in metric.collect():
        for s in family.samples:
            if any(s.labels.get(k) != v for k, v in want.items()):
                continue
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_sum"):
                total += s.value
    ordered = sorted(buckets.items())
    return {
        "count": int(count),
        "sum": total,
        "p50": quantile(ordered, 0.5),
        "p90": quantile(ordered, 0.9),
    }


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear interpolation inside the bucket holding the
    q-th observation. `buckets`: (upper bound, cumulative count), ascending, +Inf last."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower_bound  # beyond the last finite bucket: its bound is all we know
            if cumulative == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                cumulative - lower_count
            )
        lower_bound, lower_count = bound, cumulative
    return lower_bound
