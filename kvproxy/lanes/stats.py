"""What `/kvproxy/stats` and the status page show of each server (lane) and slot."""

from __future__ import annotations

from typing import Any

from kvproxy.cache.servers.slots import ANYONE, NOBODY, Slot
from kvproxy.lanes.lane import Lane


def backend_state(lane: Lane) -> dict[str, Any]:
    backend = lane.backend
    return {
        "name": lane.name,
        "model": backend.model_name,
        "enabled": backend.enabled,
        "down": str(backend.down) if backend.down is not None else None,
        # A file the server loaded changed on disk: saves and restores wait for its restart.
        "disk_paused": backend.doubt,
        "model_class": backend.model_class,
        "slots": len(backend.pool.slots),
        "queue_waiting": backend.pool.waiting,
    }


def slot_state(slot: Slot, lane: Lane, now: float) -> dict[str, Any]:
    return {
        "id": slot.id,
        "backend": lane.name,
        "busy": slot.busy,
        "key": slot.holding.key if slot.holding else None,
        "n_tokens": slot.holding.n_tokens if slot.holding else 0,
        "saved": slot.saved,
        "tenant": _tenant(slot.occupant),
        "idle_s": round(now - slot.last_used, 1) if slot.last_used and not slot.busy else None,
        "action": slot.action or ("saving" if slot.saving else None),
    }


def _tenant(occupant: str | None) -> str | None:
    """A slot's tenant as the status page shows it: a hash prefix, enough to tell tenants
    apart and never who they are; None when not known (or no tenant)."""
    if occupant is None or occupant in (ANYONE, NOBODY):
        return None
    return occupant[:8]


def unsaved(slot: Slot) -> str:
    """A slot not saved at shutdown, as the log names it."""
    held = slot.holding
    if slot.busy:
        doing = slot.action or "a prefill or reply"
        return f"slot {slot.id} (busy: {doing} under way{f', {held.key[:12]}' if held else ''})"
    return (
        f"slot {slot.id} ({held.key[:12]}, {held.n_tokens} tokens)" if held else f"slot {slot.id}"
    )
