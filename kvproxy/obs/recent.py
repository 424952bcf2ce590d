"""What the status page (`/kvproxy/`) shows of the recent past: the last requests, the last
weak hits and explained misses, and per-minute totals over the last hour.

A cache listener like the metrics: bounded (a ring of events, one bucket per minute), fed on
the event loop, read when the page polls `/kvproxy/status.json`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.reports.events import Count, RequestEvent, SlotActionEvent
from kvproxy.cache.reports.explain import describe

RECENT_REQUESTS = 20
RECENT_REASONS = 10
WINDOW_S = 3600
BUCKET_S = 60
HITS = frozenset({Decision.RESIDENT, Decision.RESTORED})


@dataclass
class _Minute:
    start: float
    requests: int = 0  # cache decisions (bypass not counted: nothing to hit)
    hits: int = 0
    tokens_cached: int = 0
    tokens_prefilled: int = 0
    saved_s: float = 0.0
    priced: int = 0  # requests whose cached tokens had a price (a cold prefill seen)


class Recent:
    """A cache listener keeping the last requests and an hour of per-minute totals."""

    def __init__(self, clock: Callable[[], float] = time.time, excerpts: bool = True) -> None:
        self.clock = clock
        # Whether reasons quote the client's text around a divergence: not when clients are
        # tenants (the page shows every tenant's requests; the log keeps the excerpts).
        self.excerpts = excerpts
        self.requests: deque[dict[str, Any]] = deque(maxlen=RECENT_REQUESTS)
        self.reasons: deque[dict[str, Any]] = deque(maxlen=RECENT_REASONS)
        self.minutes: deque[_Minute] = deque(maxlen=WINDOW_S // BUCKET_S + 1)

    def on_request(self, event: RequestEvent) -> None:
        now = self.clock()
        saved = event.prefill_saved_s
        self.requests.append(
            {
                "at": now,
                "route": event.route,
                "key": event.key[:12],
                "decision": str(event.decision),
                "slot": event.slot,
                "status": event.status,
                "cached": event.cache_n,
                "prefilled": event.prompt_n,
                "duration_s": round(event.duration_s, 4),
                "saved_s": None if saved is None else round(saved, 4),
            }
        )
        for kind, why in (("weak hit", event.weak), ("miss", event.miss)):
            if why is not None:
                text = describe(why, self.excerpts)
                self.reasons.append({"at": now, "kind": kind, "key": event.key[:12], "why": text})
        if event.decision in (Decision.BYPASS, Decision.BUSY):
            return
        minute = self._minute(now)
        minute.requests += 1
        minute.hits += event.decision in HITS
        minute.tokens_cached += event.cache_n or 0
        minute.tokens_prefilled += event.prompt_n or 0
        if saved is not None:
            minute.saved_s += saved
            minute.priced += 1

    def on_slot_action(self, event: SlotActionEvent) -> None:
        del event

    def on_count(self, what: Count, n: int) -> None:
        del what, n

    def _minute(self, now: float) -> _Minute:
        start = now - now % BUCKET_S
        if not self.minutes or self.minutes[-1].start != start:
            self.minutes.append(_Minute(start))
        return self.minutes[-1]

    def snapshot(self) -> dict[str, Any]:
        """The last requests (newest first), weak hits and misses, and the last hour."""
        now = self.clock()
        hour = [m for m in self.minutes if m.start > now - WINDOW_S]
        requests = sum(m.requests for m in hour)
        hits = sum(m.hits for m in hour)
        cached = sum(m.tokens_cached for m in hour)
        prefilled = sum(m.tokens_prefilled for m in hour)
        return {
            "now": now,
            "recent": list(reversed(self.requests)),
            "reasons": list(reversed(self.reasons)),
            "last_hour": {
                "requests": requests,
                "hits": hits,
                "hit_rate": hits / requests if requests else None,
                "tokens_cached": cached,
                "tokens_prefilled": prefilled,
                "cached_share": cached / (cached + prefilled) if cached + prefilled else None,
                # None (the page shows "—") until a cold prefill priced a cached token.
                "prefill_seconds_saved": round(sum(m.saved_s for m in hour), 3)
                if any(m.priced for m in hour)
                else None,
            },
        }
