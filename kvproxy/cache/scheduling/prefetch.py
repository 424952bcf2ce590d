"""Prefetches: a conversation waiting for a tool's result (cache/decisions/toolloops.py) that
had to leave its slot is restored into the next slot that frees, before its request comes.

Background work like the saves of background_saves.py: a prefetch takes an idle slot from the
pool (never one busy on the server: nothing else touches it meanwhile), saves what that slot
holds when it would be lost, and restores the conversation's newest state from disk into it;
the slot is taken for that conversation (`Slot.begin_prefetch`), so its request, coming
meanwhile, waits for that slot rather than take another, and claims it: the prefetch stops
before its next step and the request does the rest itself. It also stops when any request
waits for a slot. Its steps on the server go in a moment when they pause nobody: no other
slot at work, no other save under way (a restore pauses the other slots' streams as a save
does); the tool results due are not waited for, as this is the work their own requests would
do on their paths. The slot it takes is idle and holds no other conversation waiting for a
tool's result: an empty one first, then one whose state is on disk, then the least recently
used.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvproxy import readable
from kvproxy.cache.decisions.toolloops import Awaited, ToolLoops
from kvproxy.cache.reports.events import Count
from kvproxy.cache.scheduling.savegate import SaveGate
from kvproxy.cache.servers.leases import Background
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry

log = logging.getLogger("kvproxy.cache")


class Prefetcher:
    def __init__(
        self, pool: SlotPool, work: SlotWork, gate: SaveGate, background: Background
    ) -> None:
        self.pool = pool
        self.work = work
        self.gate = gate
        self.tool_loops: ToolLoops = gate.tool_loops
        self.background = background
        self.enabled = False  # set once the cache serves (and cleared when it stops)
        self._running: asyncio.Future[None] | None = None
        # Conversations not to try again: nothing on disk holds them whole, or their restore
        # failed (each is tried once; they leave with the tool loop's window).
        self._tried: set[str] = set()

    def kick(self) -> None:
        """Look for a prefetch to do, unless one is under way."""
        if self.enabled and (self._running is None or self._running.done()):
            if self._next() is not None:
                self._running = asyncio.ensure_future(self._run())
                self.background.track(self._running)

    def _next(self) -> tuple[Awaited, Slot] | None:
        """A waiting conversation that no slot holds, and the slot to restore it into, when
        the server is idle: no request at work or waiting, no save under way (its save and
        its restore would pause them; the tool results due are left out: the work is what the
        conversation's own request would do on its path)."""
        now = time.monotonic()
        waiting = self.tool_loops.waiting(now)
        self._tried &= {a.key for a in waiting}
        if not waiting or self.pool.waiting or self.gate.saving is not None:
            return None
        if any(s.working for s in self.pool.slots):
            return None
        for awaited in waiting:
            if awaited.key in self._tried or self._placed(awaited):
                continue
            slot = self._target(now)
            return None if slot is None else (awaited, slot)
        return None

    def _placed(self, awaited: Awaited) -> bool:
        """A slot holds it, or is taken for it (its request, or a prefetch)."""
        for slot in self.pool.slots:
            if awaited.held_by(slot.holding.chain if slot.holding else None, _ns(slot)):
                return True
            if slot.busy and slot.serving is not None and awaited.key in slot.serving:
                return True
        return False

    def _target(self, now: float) -> Slot | None:
        idle = [
            s
            for s in self.pool.slots
            if not s.busy
            and not self.tool_loops.holds_awaited(
                s.holding.chain if s.holding else None, _ns(s), now
            )
        ]
        if not idle:
            return None
        return min(
            idle,
            key=lambda s: (s.holding is not None, self.work.worth_saving(s), s.last_used),
        )

    async def _run(self) -> None:
        while self.enabled:
            picked = self._next()
            if picked is None:
                return
            awaited, slot = picked
            # Its state may still be committing (its slot went to a newcomer): waited for.
            await self.work.saves_done(list(awaited.chain))
            found = await self.work.store.lookup_async(list(awaited.chain), awaited.namespace)
            if found is None or found[1] < len(awaited.chain):
                self._tried.add(awaited.key)  # not on disk whole: its request will prefill
                continue
            # Looked again after the index's answer: the pool may have moved meanwhile.
            again = self._next()
            if again is None or again[0] != awaited or not self.pool.try_take(again[1]):
                return
            slot = again[1]
            slot.begin_prefetch(awaited.chain)
            try:
                with self.gate.holding(slot):
                    await self._prefetch(slot, awaited, found[0])
            finally:
                self.pool.release(slot, used=False)

    def _stop(self, slot: Slot) -> bool:
        """Before each step: a request needs the slot, or waits for any."""
        return slot.claimed or self.pool.waiting > 0

    async def _prefetch(self, slot: Slot, awaited: Awaited, entry: Entry) -> None:
        try:
            if await self.work.backend.asleep():
                return
            await self.work.verify(slot)
            if self._stop(slot):
                return
            if self.work.worth_saving(slot):
                with self.gate.pace.timing():
                    saved = await self.work.save_if_worth(
                        slot, background=True, give_way=lambda: self._stop(slot), commit_later=True
                    )
                if not saved:
                    return
            if self._stop(slot) or any(s.working for s in self.pool.slots if s is not slot):
                return
            outcome = await self.work.restore(slot, entry)
        except (UpstreamError, OSError) as exc:
            log.debug("prefetch into slot %d: %s", slot.id, exc)
            self._tried.add(awaited.key)
            return
        if outcome is None:
            self._tried.add(awaited.key)
            return
        self.work.events.count(Count.PREFETCH)
        log.info(
            "prefetched %s into slot %d: %d tokens in %s (a tool's result is due)",
            awaited.key[:12],
            slot.id,
            outcome.n_restored,
            readable.duration(outcome.ms / 1000),
        )


def _ns(slot: Slot) -> str | None:
    return slot.holding.namespace if slot.holding is not None else None
