"""One lane: one llama-server kvproxy sends work to, with every part that works on its slots.

A lane is a backend (cache/servers/backend.py: the server's client, slot pool and model identity)
and the parts built on it: slot work, background saves, openings, the keyed driver and the unkeyed
paths. Every lane shares the cache's store, habits, restore guard, events and background work (the
context's other fields), so a conversation saved through one lane is found by any lane whose model
identity (and so namespace) is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.toolloops import ToolLoops
from kvproxy.cache.habits.learning import HabitLearning
from kvproxy.cache.prefixes.openings import Openings
from kvproxy.cache.prefixes.reuse import Reuse
from kvproxy.cache.prefixes.stems import Stems
from kvproxy.cache.scheduling.background_saves import Warmer
from kvproxy.cache.scheduling.prefetch import Prefetcher
from kvproxy.cache.scheduling.savegate import SaveGate
from kvproxy.cache.servers.pace import Pace, PacedEvents
from kvproxy.cache.servers.slotpool import QueueFull, SlotPool
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.handlers.keyed import Keyed
from kvproxy.handlers.prepare import Preparer
from kvproxy.handlers.report import Report
from kvproxy.handlers.unkeyed import Unkeyed
from kvproxy.http.session import UpstreamError


class Lane:
    def __init__(self, ctx: CacheContext, name: str) -> None:
        self.name = name  # how logs, metrics and stats name the server (its address)
        backend = ctx.backend
        # What this server's saves, restores and replies show of its speed (cache/servers/pace.py).
        self.pace = Pace(lambda: backend.model_info.kv_bytes_per_token if backend.model_info else 0)
        ctx = dataclasses.replace(ctx, events=PacedEvents.of(ctx.events, self.pace))
        self.ctx = ctx
        self.backend = backend
        self.work = SlotWork(ctx)
        settings = ctx.settings
        self.tool_loops = ToolLoops(settings.effective_tool_result_within)
        self.pool.awaited = self._awaited
        self.gate = SaveGate(self.pool, self.pace, self.tool_loops, settings.save_wait)
        self.warmer = Warmer(
            backend.pool,
            self.work,
            ctx.background,
            settings.live_window,
            settings.effective_idle_save_after,
            settings.save_wait,
            self.gate,
        )
        self.prefetcher = Prefetcher(backend.pool, self.work, self.gate, ctx.background)
        self.pool.on_release = self.released
        stems = Stems(ctx, self.work)
        self.reuse = Reuse(ctx, self.work, stems)
        self.openings = Openings(ctx, self.work, self.reuse)
        self.unkeyed = Unkeyed(ctx, self.work, self.gate)
        learner = HabitLearning(ctx.habits, backend, ctx.store, ctx.background)
        preparer = Preparer(ctx, self.work, self.reuse, self.openings, learner, self.gate)
        report = Report(ctx, stems)
        self.keyed = Keyed(
            ctx, self.work, preparer, self.unkeyed, self.warmer, report, self.tool_loops, self.pace
        )

    def _awaited(self, slot: Slot) -> bool:
        held = slot.holding
        if held is None:
            return False
        return self.tool_loops.holds_awaited(held.chain, held.namespace, time.monotonic())

    def released(self) -> None:
        """A slot became idle (the pool calls it): whatever waited for one looks again."""
        self.gate.changed()
        self.warmer.kick()
        self.prefetcher.kick()

    def serving(self, enabled: bool) -> None:
        """Background work (saves, prefetches) may start from now on, or no longer."""
        self.warmer.enabled = enabled
        self.prefetcher.enabled = enabled

    def kick(self) -> None:
        """Housekeeping's look for background work."""
        self.warmer.kick()
        self.prefetcher.kick()

    @property
    def pool(self) -> SlotPool:
        return self.backend.pool

    async def save_slot(self, slot_id: int) -> None:
        """Save what the slot holds if that would be lost (its turn in the pool, verified
        first); nothing when the slot is taken for good or the server fails."""
        with contextlib.suppress(QueueFull, UpstreamError, OSError):
            got, _ = await self.pool.acquire(wanted=slot_id)
            try:
                await self.work.verify(got)
                # A slot that was busy is judged now that its work has ended.
                await self.work.save_if_worth(got)
            finally:
                self.pool.release(got)

    async def save_unsaved(self) -> None:
        """Save every slot whose conversation is not on disk (before the server drops it)."""
        for slot in self.pool.slots:
            if self.work.worth_saving(slot):
                await self.save_slot(slot.id)

    @property
    def in_rotation(self) -> bool:
        """The server answered its last look and pins slots: requests may go to it."""
        return self.backend.enabled and self.backend.down is None

    def __repr__(self) -> str:
        return f"Lane({self.name})"


def make_lane(ctx: CacheContext) -> Lane:
    return Lane(ctx, ctx.backend.name)
