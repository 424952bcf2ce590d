"""One save at a time on a server, each in a moment when it pauses nobody's stream: the wait
cache/decisions/moments.py decides, for the saves requests need and the background's.

A request whose slot must be saved first (its content would be lost) waits here for an idle
moment, at most `max_wait` (then it goes anyway); background work (background_saves.py,
prefetch.py) decides on its own when to start and only marks the save under way, so that a
request's save waits for it rather than run beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator

from kvproxy.cache.decisions.moments import ServerNow, may_start
from kvproxy.cache.decisions.toolloops import ToolLoops
from kvproxy.cache.servers.pace import Pace
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import Slot

log = logging.getLogger("kvproxy.cache")


class SaveGate:
    def __init__(self, pool: SlotPool, pace: Pace, tool_loops: ToolLoops, max_wait: float) -> None:
        self.pool = pool
        self.pace = pace
        self.tool_loops = tool_loops
        self.max_wait = max_wait
        self.saving: Slot | None = None  # the slot whose save (or prefetch) is under way
        self._waiters: set[asyncio.Future[None]] = set()

    def now(self, mine: Slot, but: str | None = None) -> ServerNow:
        """The server as a save on `mine` sees it (`but`: a waiting tool loop left out, the one
        a prefetch works for)."""
        return ServerNow(
            working=sum(s.working for s in self.pool.slots if s is not mine),
            waiting=self.pool.waiting,
            saving=self.saving is not None and self.saving is not mine,
            tool_wait=self.tool_loops.due_in(time.monotonic(), but),
        )

    def save_seconds(self, slot: Slot) -> float | None:
        return self.pace.save_seconds(slot.holding.n_tokens) if slot.holding is not None else None

    def changed(self) -> None:
        """Something a waiting save looks at changed: a slot freed, a save ended."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    @contextlib.contextmanager
    def holding(self, slot: Slot) -> Iterator[None]:
        """A save (or a prefetch) decided elsewhere is under way on `slot`."""
        self.saving = slot
        try:
            yield
        finally:
            if self.saving is slot:
                self.saving = None
            self.changed()

    @contextlib.asynccontextmanager
    async def turn(self, slot: Slot) -> AsyncIterator[None]:
        """A save a request needs on `slot` (ours): once no other save is under way, and no
        other slot is at work unless the save is small or it waited `max_wait`."""
        began = time.monotonic()
        why = ""
        slot.gated = True
        try:
            while True:
                moment = may_start(
                    self.now(slot),
                    save_s=self.save_seconds(slot),
                    token_gap_s=self.pace.token_gap_s,
                    optional=False,
                    waited=time.monotonic() - began,
                    max_wait=self.max_wait,
                )
                if moment.go:
                    break
                why = moment.why
                await self.until_changed(moment.retry_in)
        finally:
            slot.gated = False
        waited = time.monotonic() - began
        if why:
            log.info("slot %d: its save waited %.2f s (%s)", slot.id, waited, why)
        with self.holding(slot), self.pace.timing():
            yield

    async def until_changed(self, timeout: float | None) -> None:
        """Until a slot frees or a save ends (or `timeout` seconds)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)
