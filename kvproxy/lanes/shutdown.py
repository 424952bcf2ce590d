"""Saving one server's slots at shutdown, in the time left: what fits, the most valuable first
(the plan: cache/decisions/shutdownplan.py), and every slot not saved named with why.

First the slots idle at SIGTERM; then, once the work under way ended (a background save, a
request's slot work, a long prefill the server is finishing), the others. A slot still busy
at the deadline, one whose save would not fit in the time left, and one whose save the
deadline cut off are each named.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvproxy import readable
from kvproxy.cache.decisions.shutdownplan import Candidate, plan_shutdown
from kvproxy.cache.servers.slots import Slot
from kvproxy.lanes.lane import Lane
from kvproxy.lanes.stats import unsaved

log = logging.getLogger("kvproxy.cache")

POLL_S = 0.25  # a look at the busy slots at least this often (a freed slot wakes it sooner)


def rate(lane: Lane) -> str:
    pace = lane.pace
    measured = "measured" if pace.write_measured else "assumed"
    return f"{readable.rate(pace.write_bytes_per_s)} {measured}"


class ShutdownSaves:
    """One server's saves at shutdown: `first` the slots idle now, `rest` the slots that were
    busy then, each once its work ended; each slot planned once."""

    def __init__(self, lane: Lane, deadline: float, where: str) -> None:
        self.lane, self.deadline, self.where = lane, deadline, where
        self.busy: list[Slot] = []

    async def first(self) -> list[str]:
        """The slots idle now whose state would be lost: those that fit, saved; the rest,
        named."""
        self.busy = [s for s in self.lane.pool.slots if s.busy]
        return await self._planned([s for s in self.lane.pool.slots if not s.busy])

    async def rest(self) -> list[str]:
        """The slots that were busy: once their work ends (by the deadline), as above."""
        lane, deadline = self.lane, self.deadline
        while any(s.busy for s in self.busy) and time.monotonic() < deadline:
            await lane.gate.until_changed(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
        still = [f"{unsaved(s)}{self.where}" for s in self.busy if s.busy]
        return still + await self._planned([s for s in self.busy if not s.busy])

    async def _planned(self, slots: list[Slot]) -> list[str]:
        lane, where = self.lane, self.where
        slots = [s for s in slots if lane.work.worth_saving(s) and s.holding is not None]
        if not slots:
            return []
        candidates = [
            Candidate(s.id, s.holding.n_tokens, lane.gate.save_seconds(s), s.last_used)
            for s in slots
            if s.holding is not None
        ]
        left = self.deadline - time.monotonic()
        plan = plan_shutdown(candidates, left)
        sizes = {c.slot: lane.pace.state_bytes(c.tokens) for c in candidates}
        log.info(
            "shutdown%s: %d slots to save (%s at %s), %s left: saving %s",
            where,
            len(candidates),
            readable.size(sum(v or 0 for v in sizes.values())),
            rate(lane),
            readable.duration(left),
            ", ".join(f"slot {i}" for i in plan.save) or "none",
        )
        lost = [
            f"{_named(lane.pool.slots[i], sizes.get(i))}: would take "
            + (f"~{readable.duration(seconds)}" if seconds is not None else "an unknown time")
            + f" at {rate(lane)}, {readable.duration(left)} left{where}"
            for i, seconds in plan.skip
        ]
        for i in plan.save:
            lost += await self._save(lane.pool.slots[i], sizes.get(i))
        return lost

    async def _save(self, slot: Slot, size: int | None) -> list[str]:
        lane, where = self.lane, self.where
        name = _named(slot, size)
        remaining = self.deadline - time.monotonic()
        expected = lane.gate.save_seconds(slot)
        if remaining <= 0 or (expected is not None and expected > remaining):
            return [f"{name}: no time left ({readable.duration(remaining)}){where}"]
        try:
            with lane.pace.timing():
                await asyncio.wait_for(lane.save_slot(slot.id), remaining)
        except TimeoutError:
            return [f"{name}: its save was cut off by the deadline{where}"]
        return [f"{name}: its save failed{where}"] if lane.work.worth_saving(slot) else []


def _named(slot: Slot, size: int | None) -> str:
    held = slot.holding
    if held is None:
        return f"slot {slot.id}"
    shown = f", {readable.size(size)}" if size else ""
    return f"slot {slot.id} ({held.key[:12]}, {held.n_tokens:,} tokens{shown})"
