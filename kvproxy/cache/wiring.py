"""The conversation cache, wired together: one llama-server (backend.py), the disk store,
the slot work, and the request path (keyed.py); its life cycle and housekeeping.

Saves happen in the background (background_saves.py: idle slots under slot pressure, or
after an idle while), at eviction when no background save came first, on shutdown
(write-back), or after every reply (write-through). Housekeeping runs every second on the
event loop: it notices entries removed by `kvproxy rm|gc`, checks the server is still the one
it knows, applies the TTL and the byte budget, and looks for idle slots to save.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from kvproxy.cache.backend import Backend
from kvproxy.cache.background_saves import Warmer
from kvproxy.cache.context import CacheContext
from kvproxy.cache.events import Events
from kvproxy.cache.faults import Faults
from kvproxy.cache.habits import Habits
from kvproxy.cache.habits.learning import HabitLearning
from kvproxy.cache.keyed import Conversations
from kvproxy.cache.leases import Background
from kvproxy.cache.openings import Openings
from kvproxy.cache.policy import RestoreGuard
from kvproxy.cache.prepare import Preparer
from kvproxy.cache.slotio import SlotWork
from kvproxy.cache.slots import ANYONE, NOBODY, QueueFull, Slot, SlotPool
from kvproxy.cache.unkeyed import Unkeyed
from kvproxy.config import Settings
from kvproxy.http.errors import loading_response
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.store import Store, dirfiles

log = logging.getLogger("kvproxy.cache")

HOUSEKEEPING_INTERVAL = 1.0


class ConversationCache:
    def __init__(self, settings: Settings, upstream: Upstream, events: Events) -> None:
        self.settings = settings
        self.upstream = upstream
        self.events = events
        self.backend = Backend(upstream, settings)
        self.store = Store(Path(settings.cache_dir), settings.ttl, int(settings.max_disk))
        self.habits = Habits()
        self.guard = RestoreGuard()
        self.faults = Faults()  # what fails in work nobody waits for (faults.py)
        self.background = Background(self.faults)
        self.store.on_orphaned_error = partial(self.faults.failed, "store operation")
        # The one place every part is built: each gets the context and the parts it uses.
        ctx = CacheContext(
            settings, self.backend, self.store, events, self.habits, self.guard, self.background
        )
        self.work = SlotWork(ctx)
        self.warmer = Warmer(
            self.backend.pool,
            self.work,
            self.background,
            settings.live_window,
            settings.effective_idle_save_after,
        )
        self.unkeyed = Unkeyed(ctx, self.work)
        self.openings = Openings(ctx, self.work)
        preparer = Preparer(ctx, self.work, self.openings, HabitLearning(ctx))
        self.conversations = Conversations(ctx, self.work, preparer, self.unkeyed, self.warmer)
        self._housekeeper: asyncio.Task[None] | None = None
        self._started = asyncio.Event()
        self._habits_written = 0  # habits.changes when they were last written out

    # --- what the scrape and the stats read

    @property
    def pool(self) -> SlotPool:
        return self.backend.pool

    @property
    def enabled(self) -> bool:
        return self.backend.enabled

    @property
    def disk_enabled(self) -> bool:
        return self.backend.disk_enabled

    def disk_usage(self) -> tuple[int, int, int]:
        summary = self.store.summary  # kept by the store's queries: no database read here
        return summary.entries, summary.bytes, self.store.max_bytes

    def fault_summary(self) -> dict[str, tuple[bool, int]]:
        """Per kind of background work: (failing now, errors so far) (faults.py)."""
        return self.faults.summary()

    def namespaces(self) -> dict[str, tuple[int, int]]:
        """Per kind of per-namespace memory (bounds.py): (namespaces kept, evicted so far)."""
        openings = self.openings.kept
        return {
            "habits": (len(self.habits.kept), self.habits.evicted),
            "openings": (len(openings), openings.evicted),
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
            "queue_waiting": self.pool.waiting,
            "live_conversations": self.warmer.live.count(now),
            "faults": self.faults.failing(),
            "namespaces": {kind: kept for kind, (kept, _) in self.namespaces().items()},
            "slots": [
                {
                    "id": s.id,
                    "busy": s.busy,
                    "key": s.holding.key if s.holding else None,
                    "n_tokens": s.holding.n_tokens if s.holding else 0,
                    "saved": s.saved,
                    "tenant": _tenant(s.occupant),
                    "idle_s": round(now - s.last_used, 1) if s.last_used and not s.busy else None,
                    "action": s.action or ("saving" if s.saving else None),
                }
                for s in self.pool.slots
            ],
        }

    # --- life cycle

    async def start(self) -> None:
        """Start opening the cache dir and return: the proxy binds its port and serves
        uncached (`backend.store_open` is false) while a large cache opens or imports."""
        self.backend.store_opening(True)
        self._started = asyncio.Event()
        self._housekeeper = asyncio.create_task(self._open_then_housekeep(self._started))

    async def _open_then_housekeep(self, started: asyncio.Event) -> None:
        began = time.perf_counter()
        try:
            await self.store.open_async()
        except Exception:
            log.exception("cannot open the cache dir %s: requests pass through", self.store.root)
            started.set()
            return
        log.info("cache dir open in %.2f s", time.perf_counter() - began)
        found = await asyncio.to_thread(
            dirfiles.read, self.store.root, dirfiles.HABITS, dirfiles.HABITS_READ_LIMIT
        )
        trimmed = self.habits.load(found)
        # A file past the bounds is written back trimmed at the next housekeeping tick.
        self._habits_written = self.habits.changes - int(trimmed)
        window = self.settings.live_window
        if window > 0:
            self.warmer.recall(await self.store.used_since_async(time.time() - window))
        self.backend.store_opening(False)
        try:
            await self.backend.discover()
        except UpstreamError as exc:
            log.warning("llama-server not ready (%s); will retry in the background", exc)
        self.warmer.enabled = True
        started.set()
        await self._housekeeping()

    @property
    def looked(self) -> bool:
        """The cache dir is open (or failed to) and the server was looked for once."""
        return self._started.is_set()

    async def until_discovered(self) -> web.Response | None:
        """Before a slot-using request: wait (at most --queue-timeout, as for a slot) until
        the cache dir is open and the server was looked for, and look again if it was not
        found. A request relayed before that would run unpinned, leaving a slot with tokens
        of no known occupant, which the cross-tenant guard then erases. None when the
        request may go; else the answer to give instead (what the server would say)."""
        if not self._started.is_set():
            try:
                await asyncio.wait_for(self._started.wait(), self.settings.queue_timeout)
            except TimeoutError:
                return loading_response("Loading model (kvproxy is opening its cache dir)")
        await self.backend.rediscover_if_off()
        return self.backend.not_ready()

    async def started(self) -> None:
        """Wait until the cache dir is open and the server was looked for once (what
        `start` did before it returned, when the port bound only after the load)."""
        await self._started.wait()

    async def stop(self, budget: float | None = None) -> None:
        """Save what would be lost, within `budget` seconds (the settings' shutdown deadline
        by default): first the slots nobody is using (each a quick save), then, once the
        work under way ends (a save, a long prefill), the others. A slot still busy or not
        saved by then is named in the log, and lost."""
        began = time.monotonic()
        budget = self.settings.shutdown_timeout if budget is None else budget
        self.warmer.enabled = False  # a save under way finishes; no new one starts
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        if not self.enabled or not self.store.ready:
            await self.background.wait(max(0.0, budget / 2))
            await asyncio.to_thread(self.store.close)
            return
        deadline = began + budget
        await self._save_all([s for s in self.pool.slots if not s.busy], deadline)
        await self.background.wait(max(0.0, deadline - time.monotonic()))
        lost = await self._save_all(self.pool.slots, deadline)
        if lost:
            log.warning("not saved by the shutdown deadline, lost: %s", ", ".join(lost))
        await self.background.wait(1.0)
        await self.write_habits()
        await asyncio.to_thread(self.store.close)

    async def _save_all(self, slots: list[Slot], deadline: float) -> list[str]:
        """Save each of `slots` worth saving, by `deadline`; what was not, named."""
        lost = []
        for slot in slots:
            if not slot.busy and not self.work.worth_saving(slot):
                continue
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(self._save_for_shutdown(slot.id), remaining)
            except TimeoutError:
                lost.append(_unsaved(slot))
        return lost

    async def _save_for_shutdown(self, slot_id: int) -> None:
        with contextlib.suppress(QueueFull, UpstreamError, OSError):
            got, _ = await self.pool.acquire(wanted=slot_id)
            try:
                await self.work.verify(got)
                # A slot that was busy is judged now that its work has ended.
                if self.work.worth_saving(got):
                    await self.work.save(got)
            finally:
                self.pool.release(got)

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
                if self.backend.props_check_due():
                    await self.notice_removals()
                    await self.backend.discover()
                else:
                    await self.store.refresh_async()  # one row: what kvproxy rm|gc changed
                await self.work.evict()
                await self.write_habits()
                if self.enabled:
                    self.warmer.kick()
            except UpstreamError as exc:
                log.debug("housekeeping: %s", exc)
            except Exception as exc:
                # A full disk or a broken index fails every tick: logged once (faults.py).
                self.faults.failed("housekeeping", exc)
            else:
                self.faults.succeeded("housekeeping")

    async def notice_removals(self) -> None:
        gone = await self.store.forget_removed_async()
        if gone:
            log.info("%d cache entries were removed by another process (kvproxy rm/gc)", len(gone))


def _tenant(occupant: str | None) -> str | None:
    """A slot's tenant as the status page shows it: a hash prefix, enough to tell tenants
    apart and never who they are; None when not known (or no tenant)."""
    if occupant is None or occupant in (ANYONE, NOBODY):
        return None
    return occupant[:8]


def _unsaved(slot: Slot) -> str:
    """A slot not saved at shutdown, as the log names it."""
    held = slot.holding
    if slot.busy:
        doing = slot.action or "a prefill or reply"
        return f"slot {slot.id} (busy: {doing} under way{f', {held.key[:12]}' if held else ''})"
    return (
        f"slot {slot.id} ({held.key[:12]}, {held.n_tokens} tokens)" if held else f"slot {slot.id}"
    )
