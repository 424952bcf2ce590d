"""Background saves: idle slots saved before a request needs them (the policy and why are in
cache/decisions/pressure.py), and the idle save after `idle_save_after`.

Runs on the event loop, one save at a time, started whenever a slot becomes idle, a new
conversation is seen, or housekeeping ticks. A save takes its slot from the pool like a
request does (so nothing else touches the slot meanwhile), but never while a request waits
for a slot, and gives it back without making it look recently used. It starts only in a
moment when it pauses nobody (cache/decisions/pressure.py, cache/decisions/moments.py: no other
slot at work, no request waiting, no tool result due, no other save under way on the server;
savegate.py marks it under way), and a save under way stops before its next step when that
moment ends; a timer looks again when a held-back save may go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from kvproxy.cache.decisions.pressure import (
    IdleView,
    LiveConversations,
    SaveDecision,
    ServerView,
    gives_way,
    next_background_save,
)
from kvproxy.cache.scheduling.savegate import SaveGate
from kvproxy.cache.servers.leases import Background
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.http.session import UpstreamError

log = logging.getLogger("kvproxy.cache")


class Warmer:
    def __init__(
        self,
        pool: SlotPool,
        work: SlotWork,
        background: Background,
        live_window: float,
        idle_save_after: float,
        max_wait: float,
        gate: SaveGate,
    ) -> None:
        self.pool = pool
        self.work = work
        self.gate = gate
        self.tool_loops = gate.tool_loops
        self.background = background
        self.live = LiveConversations(live_window)
        self.idle_save_after = idle_save_after
        self.max_wait = max_wait
        self.enabled = False  # set once the cache serves (and cleared when it stops)
        self._running: asyncio.Future[None] | None = None
        # Holdings whose save failed: not tried again in the background (a request's own
        # eviction still tries), else a failing disk would be retried in a tight loop.
        self._failed: set[str] = set()
        self._retry: asyncio.TimerHandle | None = None  # a look when a held-back save is due
        self._gave_way = False  # the save under way stopped for another slot's request

    def recall(self, used: Iterable[tuple[str, float]]) -> None:
        """At start-up: the conversations on disk used within the live window (key, last
        used by the wall clock) are live."""
        if self.live.window <= 0:
            return
        wall, mono = time.time(), time.monotonic()
        self.live.recall([(key, mono - (wall - last)) for key, last in used], mono)

    def seen(self, keys: list[str]) -> None:
        """A keyed request came; a conversation not live before may start the pressure."""
        if self.live.window > 0 and self.live.seen(keys, time.monotonic()):
            self.kick()

    def kick(self) -> None:
        """Look for a slot to save, unless a look is already under way."""
        if self.enabled and (self._running is None or self._running.done()):
            if self._choose() is not None:
                self._running = asyncio.ensure_future(self._run())
                self.background.track(self._running)

    def _views(self) -> list[IdleView]:
        now = time.monotonic()
        return [
            IdleView(
                s.id,
                s.busy,
                s.holding is not None
                and s.holding.key not in self._failed
                and self.work.worth_saving(s),
                now - s.last_used,
                serving=s.working,
                awaited=self.pool.awaited(s),
                save_s=self.gate.save_seconds(s),
            )
            for s in self.pool.slots
        ]

    def _server(self, mine: Slot | None = None) -> ServerView:
        """The server beside the slots; `mine`: the slot whose save is under way."""
        return ServerView(
            waiting=self.pool.waiting,
            saving=self.gate.saving is not None and self.gate.saving is not mine,
            tool_wait=self.tool_loops.due_in(time.monotonic()),
            token_gap_s=self.gate.pace.token_gap_s,
        )

    def _live(self) -> int:
        return self.live.count(time.monotonic()) if self.live.window > 0 else 0

    def _choose(self) -> Slot | None:
        decision = next_background_save(
            self._views(),
            live=self._live(),
            waiting=self.pool.waiting,
            idle_save_after=self.idle_save_after,
            max_wait=self.max_wait,
            server=self._server(),
        )
        self._look_again(decision)
        return None if decision.slot is None else self.pool.slots[decision.slot]

    def _look_again(self, decision: SaveDecision) -> None:
        """A held-back save is looked at again when its hold is up (a slot released earlier
        kicks sooner)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if decision.retry_in is not None:
            # A little past the bound, so the look finds the save overdue.
            delay = decision.retry_in + 0.01
            self._retry = asyncio.get_running_loop().call_later(delay, self.kick)

    def _give_way(self, slot: Slot) -> bool:
        """Called before each step of a background save (SlotWork.save)."""
        if gives_way(
            self._views(),
            slot.id,
            idle_save_after=self.idle_save_after,
            max_wait=self.max_wait,
            server=self._server(slot),
        ):
            self._gave_way = True
        return self._gave_way

    async def _run(self) -> None:
        while self.enabled:
            slot = self._choose()
            if slot is None or not self.pool.try_take(slot):
                return
            slot.begin_background_save()
            with self.gate.holding(slot):
                await self._save(slot)

    async def _save(self, slot: Slot) -> None:
        key = slot.holding.key if slot.holding is not None else ""
        saved = False
        self._gave_way = False
        try:
            if await self.work.backend.asleep():
                # Asleep, the server emptied its slots; a save would wake it for nothing.
                slot.forget()
                return
            with self.gate.pace.timing():
                await self.work.verify(slot)
                saved = await self.work.save_if_worth(
                    slot,
                    background=True,
                    give_way=lambda: self._give_way(slot),
                    commit_later=True,  # a request's save then waits for no fsync of this one
                )
        except (UpstreamError, OSError) as exc:
            log.debug("background save of slot %d: %s", slot.id, exc)
        finally:
            held_back = slot.claimed or self._gave_way
            if not saved and not held_back and slot.holding is not None and not slot.saved:
                self._failed.add(key)
            # Only the holdings still in a slot can come up again.
            self._failed &= {s.holding.key for s in self.pool.slots if s.holding is not None}
            self.pool.release(slot, used=False)
