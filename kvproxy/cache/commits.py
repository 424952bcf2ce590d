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
import logging
import time
from dataclasses import dataclass

from kvproxy.cache.context import CacheContext
from kvproxy.cache.disktrouble import DiskTrouble
from kvproxy.cache.events import Count, SlotActionEvent
from kvproxy.cache.faults import SAVING
from kvproxy.cache.lineage import Older, superseded
from kvproxy.cache.policy import RestoreRule, reuse_rule
from kvproxy.cache.saving import SavesUnderWay
from kvproxy.cache.slots import Holding, Slot
from kvproxy.store import Entry
from kvproxy.store.entry import TURN

log = logging.getLogger("kvproxy.cache")


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
        self.events = ctx.events
        self.background = ctx.background
        self.trouble = trouble
        self.under_way = under_way

    def later(self, w: Written) -> None:
        """The slot is saved as far as its next user cares (the state is in the page cache);
        the commit runs in the background, the key under way until it ends."""
        w.slot.mark_saved()
        commit = asyncio.ensure_future(self.commit(w))
        self.under_way.committing(w.holding.key, commit)
        self.background.track(commit, "committing saves")

    async def commit(self, w: Written) -> bool:
        """Commit a state the server wrote under `w.temp`: True when it is in the index."""
        slot = w.slot
        write_ms = (time.perf_counter() - w.started) * 1000
        try:
            entry = await self.store.commit_async(w.entry, w.temp)
        except FileNotFoundError as exc:  # saved into another dir, or deleted meanwhile
            await self.failed(w.started, w.temp)
            self._not_committed(w)
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
            "saved slot %d%s: %s, %d tokens, %d bytes in %.1f ms (written in %.1f ms; canonical "
            "prefix before: %.1f ms)",
            slot.id,
            " in the background" if w.background else "",
            w.holding.key[:12],
            entry.n_tokens,
            entry.state_bytes,
            seconds * 1000,
            write_ms,
            w.canonical_ms,
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
        rule = self.rule()

        def choose(older: list[Entry]) -> list[str]:
            views = [Older(e.key, len(e.chain), e.kind == TURN) for e in older]
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
            w.slot.saved = False
        else:
            log.warning(
                "slot %d: the state of %s was written but not committed: lost",
                w.slot.id,
                w.holding.key[:12],
            )

    async def failed(self, started: float, temp: str, fault: Exception | None = None) -> None:
        """A save that ends in nothing committed: counted, its temp file removed."""
        if fault is not None:  # the server or the disk refused it (a full disk): faults.py
            self.background.faults.failed(SAVING, fault)
        seconds = time.perf_counter() - started
        self.events.slot_action(SlotActionEvent("save", False, seconds=seconds))
        await asyncio.to_thread(self.store.files.discard_temp, temp)

    # --- the budget

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
