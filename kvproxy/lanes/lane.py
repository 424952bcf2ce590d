"""One lane: one llama-server kvproxy sends work to, with every part that works on its slots.

A lane is a backend (cache/backend.py: the server's client, slot pool and model identity) and
the parts built on it: slot work, background saves, openings, the keyed driver and the
unkeyed paths. Every lane shares the cache's store, habits, restore guard, events and
background work (the context's other fields), so a conversation saved through one lane is
found by any lane whose model identity (and so namespace) is the same.
"""

from __future__ import annotations

import contextlib

from kvproxy.cache.background_saves import Warmer
from kvproxy.cache.context import CacheContext
from kvproxy.cache.habits.learning import HabitLearning
from kvproxy.cache.openings import Openings
from kvproxy.cache.reuse import Reuse
from kvproxy.cache.slotpool import QueueFull, SlotPool
from kvproxy.cache.slotwork import SlotWork
from kvproxy.cache.stems import Stems
from kvproxy.handlers.keyed import Keyed
from kvproxy.handlers.prepare import Preparer
from kvproxy.handlers.report import Report
from kvproxy.handlers.unkeyed import Unkeyed
from kvproxy.http.session import UpstreamError


class Lane:
    def __init__(self, ctx: CacheContext, name: str) -> None:
        self.name = name  # how logs, metrics and stats name the server (its address)
        self.ctx = ctx
        self.backend = ctx.backend
        self.work = SlotWork(ctx)
        settings = ctx.settings
        self.warmer = Warmer(
            ctx.backend.pool,
            self.work,
            ctx.background,
            settings.live_window,
            settings.effective_idle_save_after,
            settings.background_save_wait,
        )
        stems = Stems(ctx, self.work)
        self.reuse = Reuse(ctx, self.work, stems)
        self.openings = Openings(ctx, self.work, self.reuse)
        self.unkeyed = Unkeyed(ctx, self.work)
        learner = HabitLearning(ctx.habits, ctx.backend, ctx.store, ctx.background)
        preparer = Preparer(ctx, self.work, self.reuse, self.openings, learner)
        report = Report(ctx, stems)
        self.keyed = Keyed(ctx, self.work, preparer, self.unkeyed, self.warmer, report)

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
