"""What follows a save the server wrote: its commit into the store (now, or in the background
while the slot already serves another conversation), and the byte budget.

The server's `action=save` writes the state under a temp name; the commit renames it under
its key, hashes it, fsyncs it and writes the index row (`Store.commit_async`, on threads). A
request that vacated a slot waits only for the write (`later`): the key stays under way
(saving.py) until the commit ends, so the conversation's next turn, waiting for it, finds the
committed state, never an uncommitted file. A crash in between leaves only the temp file,
which the next start sweeps: no half entry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import RestoreRule, reuse_rule
from kvproxy.cache.disk.disktrouble import DiskTrouble
from kvproxy.cache.disk.lineage import Older, superseded
from kvproxy.cache.disk.room import room_for as decide_room
from kvproxy.cache.disk.saving import SavesUnderWay
from kvproxy.cache.reports.events import Count, SlotActionEvent
from kvproxy.cache.reports.faults import SAVING
from kvproxy.cache.servers.pace import PacedEvents
from kvproxy.cache.servers.slots import Holding, Slot
from kvproxy.store import Entry
from kvproxy.store.entry import TURN
from kvproxy.store.files import SIDECAR_SUFFIXES

log = logging.getLogger("kvproxy.cache")

# A holding's token count beyond this is a placeholder (not known yet), not a size.
UNKNOWN_TOKENS = 1 << 40


def known_tokens(n_tokens: int) -> int | None:
    """A holding's token count when it is a size, None when it is a placeholder."""
    return n_tokens if 0 < n_tokens < UNKNOWN_TOKENS else None


@dataclass(frozen=True)
class Written:
    """A state the server wrote under a temp name, to commit."""

    slot: Slot
    holding: Holding
    entry: Entry
    temp: str
    started: float  # perf_counter when the save was asked for
    canonical_ms: float
    background: bool


class Commits:
    def __init__(self, ctx: CacheContext, trouble: DiskTrouble, under_way: SavesUnderWay) -> None:
        self.store = ctx.store
        self.backend = ctx.backend
        self.pace = ctx.events.pace if isinstance(ctx.events, PacedEvents) else None
        self.events = ctx.events
        self.guard = ctx.guard
        self.background = ctx.background
        self.trouble = trouble
        self.under_way = under_way
        self.in_flight = 0  # estimated bytes of states written, their commits under way

    async def later(self, w: Written) -> bool:
        """The slot is saved as far as its next user cares (the state is in the page cache);
        the commit runs in the background, the key under way until it ends. A save that left
        no file is committed now, while the slot is still ours: finding out whether the
        server saves into another dir takes a second save of the slot (disktrouble.py)."""
        if not await asyncio.to_thread(os.path.exists, self.store.root / w.temp):
            return await self.commit(w)
        w.slot.mark_saved()
        size = self.estimate(w.entry.n_tokens) or 0
        self.in_flight += size  # on disk, not yet in the index's totals: room_for counts it
        commit = asyncio.ensure_future(self.commit(w, later=True))
        commit.add_done_callback(lambda _: self._landed(size))
        self.under_way.committing(w.holding.key, commit, known_tokens(w.entry.n_tokens))
        self.background.track(commit, "committing saves")
        return True

    def _landed(self, size: int) -> None:
        self.in_flight -= size

    async def commit(self, w: Written, later: bool = False) -> bool:
        """Commit a state the server wrote under `w.temp`: True when it is in the index.
        `later`: the slot may be another request's by now: no slot action then."""
        slot = w.slot
        write_ms = (time.perf_counter() - w.started) * 1000
        written = await asyncio.to_thread(_written, self.store.root, w.temp)
        if 0 < self.store.max_bytes < written:  # the estimate was low, or none
            await self.failed(w.started, w.temp)
            if self.pace is not None:
                self.pace.sized(written, w.entry.n_tokens)  # the next one is not written
            self.too_big(slot, w.holding, written, "written:")
            return False
        try:
            entry = await self.store.commit_async(w.entry, w.temp)
        except FileNotFoundError as exc:  # saved into another dir, or deleted meanwhile
            await self.failed(w.started, w.temp)
            self._not_committed(w)
            if later:
                self.trouble.error(f"the file of a save of slot {slot.id} was removed: {exc}")
            else:
                await self.trouble.file_gone(slot.id, exc)
            return False
        except (OSError, ValueError, KeyError, TypeError) as exc:
            await self.failed(w.started, w.temp, exc)
            self._not_committed(w)
            return False
        seconds = time.perf_counter() - w.started
        self.background.faults.succeeded(SAVING)
        if slot.holding is w.holding:
            slot.mark_saved()
        self.events.slot_action(
            SlotActionEvent("save", True, entry.n_tokens, entry.state_bytes, seconds, w.background)
        )
        self.trouble.recovered()
        log.info(
            "saved slot %d%s: %s, %d tokens, %d bytes in %.1f ms (canonical prefix before: "
            "%.1f ms); written in %.1f ms, then committed",
            slot.id,
            " in the background" if w.background else "",
            w.holding.key[:12],
            entry.n_tokens,
            entry.state_bytes,
            seconds * 1000,
            w.canonical_ms,
            write_ms,
        )
        await self.supersede(entry)
        await self.evict()
        return True

    def rule(self) -> RestoreRule | None:
        """What the server reuses of a restored state on this model (None: not known)."""
        info = self.backend.model_info
        if info is None or info.model_class == "unknown":
            return None
        return reuse_rule(info.model_class, info.n_swa).rule

    async def supersede(self, entry: Entry) -> None:
        """One conversation, one state on disk: the older turns `entry` stands for go
        (lineage.py); the budget then counts what is kept."""
        if entry.kind != TURN or len(entry.chain) < 2:
            return
        rule, life = self.rule(), self.backend.life

        def choose(older: list[Entry]) -> list[str]:
            views = [
                Older(e.key, len(e.chain), e.kind == TURN, self.guard.set_aside_for(life, e.key))
                for e in older
            ]
            return superseded(rule, views)

        try:
            removed = await self.store.supersede_async(entry, choose)
        except OSError as exc:  # the index cannot be written (a full disk): all kept
            self.trouble.error(f"removing older states of {entry.key[:12]} failed: {exc}")
            return
        if removed:
            self.events.count(Count.SUPERSEDED, len(removed))
            log.info(
                "%s supersedes %d older state%s of its conversation (%d bytes freed)",
                entry.key[:12],
                len(removed),
                "" if len(removed) == 1 else "s",
                sum(e.on_disk for e in removed),
            )

    def _not_committed(self, w: Written) -> None:
        """A commit that failed: if the slot still holds that state it is unsaved again (a
        later save may keep it); else it is lost, as a failed save's state always was once
        its slot went to another conversation."""
        if w.slot.holding is w.holding:
            w.slot.mark_unsaved()
        else:
            log.warning(
                "slot %d: the state of %s was written but not committed: lost",
                w.slot.id,
                w.holding.key[:12],
            )

    async def failed(self, started: float, temp: str, fault: Exception | None = None) -> None:
        """A save that ends in nothing committed: counted, its temp file removed."""
        # The server or the disk refused it (a full disk): cache/reports/faults.py.
        if fault is not None:
            self.background.faults.failed(SAVING, fault)
        seconds = time.perf_counter() - started
        self.events.slot_action(SlotActionEvent("save", False, seconds=seconds))
        await asyncio.to_thread(self.store.files.discard_temp, temp)

    # --- the budget

    def estimate(self, n_tokens: int) -> int | None:
        """A state of `n_tokens` tokens in bytes (cache/servers/pace.py: this server's last save
        or restore, else the model's KV geometry); None when not known."""
        if self.pace is None or known_tokens(n_tokens) is None:
            return None
        return self.pace.state_bytes(n_tokens)

    async def room_for(self, slot: Slot, holding: Holding) -> bool:
        """Before the server writes `holding`'s state: room made under --max-disk (room.py).
        False when it is not to be attempted: it alone is bigger than the whole budget
        (logged, counted; the slot then holds nothing worth keeping: not tried again)."""
        size = self.estimate(holding.n_tokens)
        room = decide_room(self.store.max_bytes, size, self.in_flight)
        if not room.write:
            self.too_big(slot, holding, size or 0, "estimated")
            return False
        if not room.incoming:
            return True
        try:
            victims = await self.store.select_victims_async(incoming=room.incoming)
        except OSError as exc:  # the index cannot be written (a full disk): saved anyway
            self.trouble.error(f"evicting cache entries failed: {exc}")
            return True
        if victims:
            self.events.count(Count.EVICTION, len(victims))
            log.info("evicting %d cache entries for a save of ~%d bytes", len(victims), size or 0)
            await self.store.delete_files_async(victims)
        return True

    def too_big(self, slot: Slot, holding: Holding, size: int, how: str) -> None:
        log.warning(
            "not saving slot %d (%s, %d tokens): its state (%s %d bytes) is bigger than the "
            "whole --max-disk budget (%d bytes)",
            slot.id,
            holding.key[:12],
            holding.n_tokens,
            how,
            size,
            self.store.max_bytes,
        )
        self.events.count(Count.SAVE_TOO_BIG)
        if slot.holding is holding:
            slot.mark_saved()  # nothing to keep of it: not tried again

    async def evict(self) -> None:
        try:
            victims = await self.store.select_victims_async()
        except OSError as exc:  # the index cannot be written (a full disk): nothing evicted
            self.trouble.error(f"evicting cache entries failed: {exc}")
            return
        if victims:
            self.events.count(Count.EVICTION, len(victims))
            log.info("evicting %d cache entries", len(victims))
            await self.store.delete_files_async(victims)


def _written(root: Path, temp: str) -> int:
    """Bytes the server wrote under `temp` (with its sidecars); 0 when there is nothing."""
    total = 0
    for path in [root / temp, *(root / f"{temp}{s}" for s in SIDECAR_SUFFIXES)]:
        with contextlib.suppress(OSError):
            total += os.lstat(path).st_size
    return total
