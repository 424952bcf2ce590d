"""Saving one server's slots at shutdown, in the time left: what fits, the most valuable first
(the plan: cache/shutdownplan.py), and every slot not saved named with why.

First the slots idle at SIGTERM; then, once the work under way ended (a background save, a
request's slot work, a long prefill the server is finishing), the others. A slot still busy
at the deadline, one whose save would not fit in the time left, and one whose save the
deadline cut off are each named.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvproxy.cache.shutdownplan import Candidate, plan_shutdown
from kvproxy.cache.slots import Slot
from kvproxy.lanes.lane import Lane
from kvproxy.lanes.stats import unsaved

log = logging.getLogger("kvproxy.cache")

POLL_S = 0.25  # a look at the busy slots at least this often (a freed slot wakes it sooner)


def readable(n_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n_bytes < 1024 or unit == "GiB":
            return f"{n_bytes:.0f} {unit}" if unit == "B" else f"{n_bytes:.1f} {unit}"
        n_bytes /= 1024
    raise AssertionError("unreachable")


def rate(lane: Lane) -> str:
    pace = lane.pace
    measured = "measured" if pace.write_measured else "assumed"
    return f"{pace.write_bytes_per_s / 1e6:.0f} MB/s {measured}"


async def save_idle(lane: Lane, deadline: float, where: str) -> list[str]:
    """The slots idle now whose state would be lost: those that fit, saved; the rest, named."""
    idle = [s for s in lane.pool.slots if not s.busy and lane.work.worth_saving(s)]
    return await _save_planned(lane, idle, deadline, where)


async def save_rest(lane: Lane, deadline: float, where: str) -> list[str]:
    """The slots that were busy: each once its work ends (by the deadline), then as above."""
    while any(s.busy for s in lane.pool.slots) and time.monotonic() < deadline:
        await lane.gate.until_changed(min(POLL_S, max(deadline - time.monotonic(), 0.0)))
    busy = [f"{unsaved(s)}{where}" for s in lane.pool.slots if s.busy]
    idle = [s for s in lane.pool.slots if not s.busy and lane.work.worth_saving(s)]
    return busy + await _save_planned(lane, idle, deadline, where)


async def _save_planned(lane: Lane, slots: list[Slot], deadline: float, where: str) -> list[str]:
    if not slots:
        return []
    candidates = [
        Candidate(s.id, s.holding.n_tokens, lane.gate.save_seconds(s), s.last_used)
        for s in slots
        if s.holding is not None
    ]
    left = deadline - time.monotonic()
    plan = plan_shutdown(candidates, left)
    sizes = {c.slot: lane.pace.state_bytes(c.tokens) for c in candidates}
    log.info(
        "shutdown%s: %d slots to save (%s at %s), %.1f s left: saving %s",
        where,
        len(candidates),
        readable(sum(v or 0 for v in sizes.values())),
        rate(lane),
        left,
        ", ".join(f"slot {i}" for i in plan.save) or "none",
    )
    lost = [
        f"{_named(lane, lane.pool.slots[i], sizes.get(i))}: would take "
        + (f"~{seconds:.1f} s" if seconds is not None else "an unknown time")
        + f" at {rate(lane)}, {left:.1f} s left{where}"
        for i, seconds in plan.skip
    ]
    for i in plan.save:
        slot = lane.pool.slots[i]
        name = _named(lane, slot, sizes.get(i))
        remaining = deadline - time.monotonic()
        expected = lane.gate.save_seconds(slot)
        if remaining <= 0 or (expected is not None and expected > remaining):
            lost.append(f"{name}: no time left ({max(remaining, 0):.1f} s){where}")
            continue
        try:
            await asyncio.wait_for(lane.save_slot(i), remaining)
        except TimeoutError:
            lost.append(f"{name}: its save was cut off by the deadline{where}")
            continue
        if lane.work.worth_saving(slot):
            lost.append(f"{name}: its save failed{where}")
    return lost


def _named(lane: Lane, slot: Slot, size: int | None) -> str:
    held = slot.holding
    if held is None:
        return f"slot {slot.id}"
    shown = f", {readable(size)}" if size else ""
    return f"slot {slot.id} ({held.key[:12]}, {held.n_tokens:,} tokens{shown})"
