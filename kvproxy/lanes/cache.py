"""The conversation cache, wired together: a lane per llama-server (lane.py), the disk store
and what the lanes share, the dispatch among them; its life cycle and housekeeping.

Saves happen in the background (cache/scheduling/background_saves.py: idle slots under slot
pressure, or after an idle while), at eviction when no background save came first, on shutdown
(write-back), or after every reply (write-through). Housekeeping runs every second on the event
loop: it notices entries removed by `kvproxy rm|gc`, checks the server is still the one it
knows, applies the TTL and the byte budget, and looks for idle slots to save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import RestoreGuard
from kvproxy.cache.habits import Habits
from kvproxy.cache.reports.events import Events
from kvproxy.cache.reports.faults import Faults
from kvproxy.cache.servers.backend import Backend
from kvproxy.cache.servers.leases import Background
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.config import Settings
from kvproxy.http.errors import loading_response
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.lanes import shutdown
from kvproxy.lanes.discovery import Discovery
from kvproxy.lanes.dispatch import Dispatch
from kvproxy.lanes.lane import Lane, make_lane
from kvproxy.lanes.stats import backend_state, slot_state
from kvproxy.server.api import key_refused
from kvproxy.store import Store, dirfiles

log = logging.getLogger("kvproxy.cache")

HOUSEKEEPING_INTERVAL = 1.0
# A cache dir that cannot be opened (a full disk, a read-only dir) is tried again after 1 s,
# then twice as long each time, up to 30 s.
OPEN_RETRY_S = 1.0
OPEN_RETRY_MAX_S = 30.0
OPENING = "opening the cache dir"


class ConversationCache:
    def __init__(self, settings: Settings, upstreams: Sequence[Upstream], events: Events) -> None:
        self.settings = settings
        self.events = events
        self.store = Store(Path(settings.cache_dir), settings.ttl, int(settings.max_disk))
        self.habits = Habits()
        self.guard = RestoreGuard()
        self.faults = Faults()  # what fails in work nobody waits for (cache/reports/faults.py)
        self.background = Background(self.faults)
        self.store.on_orphaned_error = partial(self.faults.failed, "store operation")
        # The one place every part is built: each lane gets a context with its own backend
        # and the parts every lane shares.
        several = len(upstreams) > 1
        self._several = several
        self.lanes = [self._lane(upstream, several) for upstream in upstreams]
        # A router-mode server's lanes are its models' (discovery.py), found once it answers.
        self.discovery = Discovery(self.lanes, self._model_lane)
        self.dispatch = Dispatch(
            self.lanes, self.discovery.groups, self.opened, self.discovery.find_new
        )
        self._housekeeper: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._habits_written = 0  # habits.changes when they were last written out

    def _model_lane(self, upstream: Upstream, model: str) -> Lane:
        return self._lane(upstream, True, model)

    def _lane(self, upstream: Upstream, several: bool, model: str | None = None) -> Lane:
        backend = Backend(upstream, self.settings, several, model)
        if self._several:
            # Requests waiting on it when it is found hung may go to another
            # (cache/servers/liveness.py).
            backend.liveness.elsewhere = lambda: self.dispatch.elsewhere(backend)
        ctx = CacheContext(
            self.settings,
            backend,
            self.store,
            self.events,
            self.habits,
            self.guard,
            self.background,
        )
        return make_lane(ctx)

    # --- the first (with one server, the only) lane

    @property
    def lane(self) -> Lane:
        return self.lanes[0]

    @property
    def backend(self) -> Backend:
        return self.lane.backend

    # --- what the scrape and the stats read

    @property
    def pool(self) -> SlotPool:
        return self.lane.pool

    def pools(self) -> list[tuple[str, SlotPool, bool]]:
        """Per llama-server: its name, slot pool, and whether it is in rotation."""
        return [(lane.name, lane.pool, lane.in_rotation) for lane in self.lanes]

    @property
    def enabled(self) -> bool:
        return any(lane.backend.enabled for lane in self.lanes)

    @property
    def disk_enabled(self) -> bool:
        return any(lane.backend.disk_enabled for lane in self.lanes)

    def disk_usage(self) -> tuple[int, int, int]:
        summary = self.store.summary  # kept by the store's queries: no database read here
        return summary.entries, summary.bytes, self.store.max_bytes

    def fault_summary(self) -> dict[str, tuple[bool, int]]:
        """Per kind of background work: (failing now, errors so far) (cache/reports/faults.py)."""
        return self.faults.summary()

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """Per kind of per-namespace memory (cache/decisions/bounds.py): (namespaces kept,
        evicted so far)."""
        kept = sum(len(lane.openings.kept) for lane in self.lanes)
        evicted = sum(lane.openings.kept.evicted for lane in self.lanes)
        return {
            "habits": (len(self.habits.kept), self.habits.evicted),
            "openings": (kept, evicted),
        }

    def state(self) -> dict[str, Any]:
        """What the cache holds now (`/kvproxy/stats` adds the counters)."""
        entries, used, budget = self.disk_usage()
        now = time.monotonic()
        return {
            "enabled": self.enabled,
            "disk_enabled": self.disk_enabled,
            "cache_open": self.store.ready,
            "model_class": self.backend.model_class,
            "entries": entries,
            "disk_bytes": used,
            "disk_budget_bytes": budget,
            "queue_waiting": sum(lane.pool.waiting for lane in self.lanes),
            "live_conversations": sum(lane.warmer.live.count(now) for lane in self.lanes),
            "faults": self.faults.failing(),
            "namespaces": {kind: kept for kind, (kept, _) in self.namespaces().items()},
            "backends": [backend_state(lane) for lane in self.lanes],
            "slots": [
                slot_state(slot, lane, now) for lane in self.lanes for slot in lane.pool.slots
            ],
        }

    # --- life cycle

    async def start(self) -> None:
        """Start opening the cache dir and return: the proxy binds its port and serves
        uncached (`backend.store_open` is false) while a large cache opens or imports."""
        for lane in self.lanes:
            lane.backend.store_opening(True)
        self._started = asyncio.Event()
        self._housekeeper = asyncio.create_task(self._open_then_housekeep(self._started))

    async def _open_then_housekeep(self, started: asyncio.Event) -> None:
        began = time.perf_counter()
        retry = OPEN_RETRY_S
        while True:
            try:
                await self.store.open_async()
                break
            except Exception as exc:
                # A full disk or a read-only dir at start-up goes away without a restart:
                # requests pass through (uncached) meanwhile, the fault logged once
                # (cache/reports/faults.py).
                self.faults.failed(OPENING, exc)
                started.set()
                await asyncio.sleep(retry)
                retry = min(retry * 2, OPEN_RETRY_MAX_S)
        self.faults.succeeded(OPENING)
        log.info("cache dir open in %.2f s", time.perf_counter() - began)
        found = await asyncio.to_thread(
            dirfiles.read, self.store.root, dirfiles.HABITS, dirfiles.HABITS_READ_LIMIT
        )
        trimmed = self.habits.load(found)
        # A file past the bounds is written back trimmed at the next housekeeping tick.
        self._habits_written = self.habits.changes - int(trimmed)
        await self.discovery.find()
        window = self.settings.live_window
        used = await self.store.used_since_async(time.time() - window) if window > 0 else []
        for lane in self.lanes:
            lane.warmer.recall(used)
            lane.backend.store_opening(False)
        await asyncio.gather(*(self._discover(lane) for lane in self.lanes))
        for lane in self.lanes:
            lane.serving(True)
        self.discovery.serving = True
        started.set()
        await self._housekeeping()

    async def _discover(self, lane: Lane) -> None:
        try:
            await lane.backend.discover()
        except UpstreamError as exc:
            refused = key_refused(exc, lane.backend.upstream.api_key is not None)
            if refused is not None:
                log.warning(
                    "%s (%s refuses kvproxy's own calls: %s); until then requests pass "
                    "through uncached",
                    refused,
                    lane.name,
                    exc,
                )
                return
            # A router's model not loaded yet answers 400: its first request loads it.
            (log.info if lane.backend.model else log.warning)(
                "llama-server %s not ready (%s); will retry in the background", lane.name, exc
            )

    @property
    def looked(self) -> bool:
        """The cache dir is open (or failed to) and the server was looked for once."""
        return self._started.is_set()

    async def opened(self) -> web.Response | None:
        """Wait (at most --queue-timeout, as for a slot) until the cache dir is open and the
        servers were looked for once: a request relayed before that would run unpinned,
        leaving a slot with tokens of no known occupant, which the cross-tenant guard then
        erases. None when that is done; else what the client gets instead."""
        if not self._started.is_set():
            try:
                await asyncio.wait_for(self._started.wait(), self.settings.queue_timeout)
            except TimeoutError:
                return loading_response("Loading model (kvproxy is opening its cache dir)")
        return None

    async def started(self) -> None:
        """Wait until the cache dir is open and the server was looked for once (what
        `start` did before it returned, when the port bound only after the load)."""
        await self._started.wait()

    async def stop(self, budget: float | None = None) -> None:
        """Save what would be lost, within `budget` seconds (the settings' shutdown deadline
        by default): first the slots nobody is using, then, once the work under way ends (a
        save, a long prefill), the others; on each server what fits in the time left, the most
        valuable first (lanes/shutdown.py). Every slot not saved is named in the log, and
        lost."""
        began = time.monotonic()
        budget = self.settings.shutdown_timeout if budget is None else budget
        self.discovery.serving = False  # a model found from now on starts no saves either
        for lane in self.lanes:
            lane.serving(False)  # a save under way finishes; no new one starts
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        lanes = [lane for lane in self.lanes if lane.backend.enabled]
        if not lanes or not self.store.ready:
            await self.background.wait(max(0.0, budget / 2))
            await asyncio.to_thread(self.store.close)
            return
        deadline = began + budget
        several = len(self.lanes) > 1
        saves = [
            shutdown.ShutdownSaves(lane, deadline, f" on {lane.name}" if several else "")
            for lane in lanes
        ]
        # Every server at once: first the slots nobody uses, then, once the work under way
        # has ended, the others.
        lost = await _gathered(s.first() for s in saves)
        await self.background.wait(max(0.0, deadline - time.monotonic()))
        lost += await _gathered(s.rest() for s in saves)
        if lost:
            log.warning("not saved by the shutdown deadline, lost: %s", "; ".join(lost))
        await self.background.wait(1.0)
        await self.write_habits()
        await asyncio.to_thread(self.store.close)

    async def write_habits(self) -> None:
        """Write what the clients were seen to do, when something new was learnt."""
        changes = self.habits.changes
        if changes == self._habits_written or not self.store.ready:
            return
        try:
            await asyncio.to_thread(
                dirfiles.write, self.store.root, dirfiles.HABITS, self.habits.to_json()
            )
        except OSError as exc:
            self.faults.failed(f"writing {dirfiles.HABITS}", exc)
            return
        self.faults.succeeded(f"writing {dirfiles.HABITS}")
        self._habits_written = changes

    # --- housekeeping

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                due = [lane for lane in self.lanes if lane.backend.props_check_due()]
                if due:
                    await self.notice_removals()
                else:
                    await self.store.refresh_async()  # one row: what kvproxy rm|gc changed
                if due:
                    await self.discovery.look()  # models unloaded, asleep, new; routers come up
                # At once: a hung server's check must not hold back the others'.
                await asyncio.gather(*(self._look_again(lane) for lane in due))
                await self.lane.work.evict()
                await self.write_habits()
                for lane in self.lanes:
                    if lane.backend.enabled:
                        lane.kick()
            except UpstreamError as exc:
                log.debug("housekeeping: %s", exc)
            except Exception as exc:
                # A full disk or a broken index fails every tick: logged once
                # (cache/reports/faults.py).
                self.faults.failed("housekeeping", exc)
            else:
                self.faults.succeeded("housekeeping")

    async def _look_again(self, lane: Lane) -> None:
        """One server's periodic check; with several, one that is down does not keep the
        others from theirs."""
        if len(self.lanes) == 1:
            await lane.backend.discover()
            return
        try:
            await lane.backend.discover()
        except UpstreamError as exc:
            log.debug("housekeeping: %s: %s", lane.name, exc)

    async def notice_removals(self) -> None:
        gone = await self.store.forget_removed_async()
        if gone:
            log.info("%d cache entries were removed by another process (kvproxy rm/gc)", len(gone))


async def _gathered(steps: Iterable[Awaitable[list[str]]]) -> list[str]:
    return [name for names in await asyncio.gather(*steps) for name in names]
