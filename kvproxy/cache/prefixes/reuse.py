"""What the server will reuse for a request: of what a slot holds, and of each stored state
(by the model class's rule, cache/decisions/policy.py), so a request goes to the slot and
restores the entry that serve it most, not merely the longest key match. One lookup of the store
per request (`find`), which also finds the stem of its system message (stems.py) when nothing
else serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import (
    ReuseRule,
    StoredView,
    near_end_candidate,
    pick_stored,
    resident_serves,
    reuse_rule,
    window_serves,
)
from kvproxy.cache.prefixes.stems import Stems
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry
from kvproxy.wire import Conversation
from kvproxy.wire.prompts import leading_text

log = logging.getLogger("kvproxy.cache")


@dataclass(frozen=True)
class Found:
    """What the store holds for a request: the entry the server will reuse most (by the
    model class's rule) and the entry sharing the most boundaries with it, each with the
    boundaries it shares."""

    best: tuple[Entry, int] | None
    longest: tuple[Entry, int] | None
    stem: bool = False  # `best` is the stem of the request's system message (stems.py)


NOTHING_FOUND = Found(None, None)


class Reuse:
    def __init__(self, ctx: CacheContext, work: SlotWork, stems: Stems) -> None:
        self.backend = ctx.backend
        self.store = ctx.store
        self.guard = ctx.guard
        self.work = work
        self.stems = stems

    # --- the model class's rule

    def rule(self) -> ReuseRule:
        info = self.backend.model_info
        if info is None:
            return reuse_rule("unknown")
        return reuse_rule(info.model_class, info.n_swa)

    def resident_depth(self, slot: Slot, conv: Conversation) -> int:
        """How deep the slot holds the request, 0 when what it holds came from disk and
        cannot serve where the request parts from it."""
        shared = slot.shared_depth(conv.keys, conv.namespace)
        held = slot.holding
        if shared == 0 or held is None:
            return 0
        return (
            shared
            if resident_serves(self.rule(), shared, held.restored_depth, held.n_tokens)
            else 0
        )

    async def find(self, conv: Conversation) -> Found:
        """The stored entries for the request, in one index query (and a second only when
        the entry found expired since housekeeping last applied the TTL)."""
        if not self.backend.loras.current(conv.namespace):
            return NOTHING_FOUND  # read before the server was seen to start again
        await self.work.saves_done(conv.keys)  # a save of its own state under way
        found = self.restorables(await self.store.candidates_async(conv.keys, conv.namespace))
        best = await self._pick(conv, found)
        if best is not None and self.store.expired(best[0]):
            # A full eviction pass costs O(entries): housekeeping runs it every second, and
            # an entry that expired since is not restored either.
            await self.work.evict()
            found = await self.store.candidates_async(conv.keys, conv.namespace)
            found = self.restorables(found)
            best = await self._pick(conv, found)
        # candidates() puts the longest match first.
        longest = found[0] if found else None
        if best is None:
            stem = await self.stems.find(conv)
            if stem is not None and self.restorable(stem):
                return Found((stem, 0), longest, stem=True)
        return Found(best, longest)

    def older(self, entry: Entry) -> bool:
        """Saved before the server's current start (by another server life)."""
        return entry.created < self.backend.life_started

    def restorable(self, entry: Entry) -> bool:
        """Not set aside by the restore guard for the server's current start."""
        life = self.backend.life
        return self.guard.allows(life, entry.namespace, entry.key, self.older(entry))

    def restorables(self, found: list[tuple[Entry, int]]) -> list[tuple[Entry, int]]:
        return [(entry, shared) for entry, shared in found if self.restorable(entry)]

    async def _pick(
        self, conv: Conversation, found: list[tuple[Entry, int]]
    ) -> tuple[Entry, int] | None:
        """The stored entry the server will reuse most for the request, by the model class's
        rule (not merely the longest key match), and the boundaries it shares."""
        rule = self.rule()
        views = [StoredView(len(e.chain) or 1, shared, e.n_tokens) for e, shared in found]
        i = pick_stored(rule, len(conv.keys), views)
        j = near_end_candidate(rule, views, i)
        if j is not None:
            # A sliding-window state parted from near its end (the first turn after a client
            # rewrote its last one, before its habit was known): it may still serve more.
            before = await self._tokens_before(conv, views[j].shared)
            if before is not None and window_serves(rule, views[j], before):
                if i is None or before > views[i].n_tokens:
                    return found[j]
        return None if i is None else found[i]

    async def _tokens_before(self, conv: Conversation, depth: int) -> int | None:
        """How many tokens of the request come before its boundary `depth` (a message, or a
        prompt's block), as the server tokenises them (None when it cannot say)."""
        try:
            if conv.messages:
                tokens = await canonical.prefix_tokens(
                    self.work.client, conv.template, conv.messages[:depth], canonical.VERBATIM
                )
            else:
                text = leading_text(conv.payload, depth)  # not an infill's: it is reassembled
                tokens = await self.work.client.tokenize(text) if text else None
        except (UpstreamError, ValueError) as exc:
            log.debug("cannot count the tokens before boundary %d: %s", depth, exc)
            return None
        return len(tokens) if tokens else None
