"""Text-completion and code-infill requests, cached like chats (keys: wire/prompts.py).

Each request goes to the slot holding the longest common prefix of its prompt, as the
server's own choice would (and so never to a slot the server would not pick), pinned there;
what that slot held is saved first unless the request goes on from it; a prompt whose
start is on disk and in no slot comes back from disk. Tenants apart, labels as for chats.

An infill prompt is cut by the server (`format_prompt_infill` keeps the end of the extra
context and of the prefix that fit the batch), so blocks equal from the start may still
be tokens that differ: there every state a request does not go on from exactly is saved
first (`near_end` 0), and its return restores that very state.

One thing differs from a conversation: an editor's completions (FIM) move back and forth
within one file, each request parting from the last a few blocks before its end. What is
lost there is the last few blocks of a state the next request rebuilds anyway, not another
session's work: it is not saved first (`worth_saving`), as a chat regenerating its last
reply is not. With --write-through every reply's state is saved after it instead.
"""

from __future__ import annotations

import logging
import time

import orjson
from aiohttp import web

from kvproxy.cache.context import CacheContext
from kvproxy.cache.events import RequestEvent
from kvproxy.cache.leases import Lease
from kvproxy.cache.loras import before_restore, sent
from kvproxy.cache.openings import Openings
from kvproxy.cache.policy import (
    Decision,
    StoredView,
    near_end_candidate,
    pick_stored,
    window_serves,
)
from kvproxy.cache.refusals import busy_response, unreachable_response
from kvproxy.cache.slotio import SlotWork
from kvproxy.cache.slots import Holding, QueueFull, Slot
from kvproxy.http.relay import relay
from kvproxy.http.session import UpstreamError
from kvproxy.store.entry import Entry
from kvproxy.wire import Conversation, with_reply_cap
from kvproxy.wire.prompts import leading_text

log = logging.getLogger("kvproxy.cache")

# A request keeping all but this share of the blocks a slot holds goes on from it.
NEAR_END = 0.1


def goes_on_from(held_depth: int, shared: int, near_end: float = NEAR_END) -> bool:
    """Does a prompt sharing `shared` of the `held_depth` blocks a slot holds go on from
    that state (the same text, edited near its end), rather than replace it?"""
    lost = max(1, int(held_depth * near_end)) if near_end > 0 else 0
    return shared > 0 and held_depth - shared <= lost


class Prompts:
    def __init__(self, ctx: CacheContext, work: SlotWork, openings: Openings) -> None:
        self.backend = ctx.backend
        self.pool = ctx.backend.pool
        self.store = ctx.store
        self.guard = ctx.guard
        self.settings = ctx.settings
        self.events = ctx.events
        self.background = ctx.background
        self.work = work
        self.openings = openings  # what the server reuses of a slot or a stored state
        self.reply_cap = ctx.settings.request_reply_cap

    async def serve(
        self, request: web.Request, path_qs: str, conv: Conversation
    ) -> web.StreamResponse:
        started = time.perf_counter()
        try:
            slot, _ = await self.pool.acquire(
                conv.keys, conv.namespace, serves=lambda s: self.openings.resident_depth(s, conv)
            )
        except QueueFull as exc:
            return busy_response(exc)
        lease = Lease(self.pool, [slot], self.background)
        try:
            near_end = 0.0 if request.path == "/infill" else NEAR_END
            try:
                decision, restored = await lease.guarded(self._prepare(slot, conv, near_end))
            except UpstreamError as exc:
                log.warning("could not prepare slot %d for a prompt: %s", slot.id, exc)
                slot.forget()
                return unreachable_response()
            payload = with_reply_cap(sent(conv, decision), self.reply_cap)
            body = orjson.dumps({**payload, "id_slot": slot.id})
            try:
                result = await relay(
                    request,
                    self.backend.upstream,
                    path_qs,
                    body,
                    body_replaced=True,
                    extra_headers={"X-KVProxy-Cache": decision.value},
                )
            except BaseException:
                slot.forget()
                raise
            if result.status == 200 and result.complete:
                slot.hold(Holding(conv.namespace, list(conv.keys), 0, len(conv.keys)), saved=False)
                lease.hand_off(self.work.after_reply(slot, self.settings.write_through))
            else:
                slot.forget()
            self.events.request(
                RequestEvent(
                    request.path,
                    decision,
                    result.status,
                    key=conv.keys[-1],
                    slot=slot.id,
                    backend=self.backend.label,
                    duration_s=time.perf_counter() - started,
                    restored_tokens=restored,
                )
            )
            return result.response
        finally:
            lease.release()

    async def _prepare(
        self, slot: Slot, conv: Conversation, near_end: float
    ) -> tuple[Decision, int]:
        """Save what would be lost, admit the tenant, restore what disk serves better: the
        decision label, and the tokens restored."""
        await self.work.verify(slot)
        resident = self.openings.resident_depth(slot, conv)
        held = slot.holding
        if held is not None and not goes_on_from(len(held.chain), resident, near_end):
            if self.work.worth_saving(slot):
                await self.work.save(slot)
        stored = await self._stored(conv, resident, near_end)
        await self.work.admit(slot, conv.tenant)
        if slot.holding is None:
            resident = 0  # erased for another tenant
        if stored is not None:
            await before_restore(self.work.client, slot, conv)
            outcome = await self.work.restore(slot, stored)
            if outcome is not None:
                return Decision.RESTORED, outcome.n_restored
        return (Decision.RESIDENT if resident > 0 else Decision.MISS), 0

    async def _stored(self, conv: Conversation, resident: int, near_end: float) -> Entry | None:
        """The stored state the server will reuse more of than the slot serves, if any."""
        if not self.backend.disk_enabled or not self.backend.loras.current(conv.namespace):
            return None
        await self.work.saves_done(conv.keys)
        found = self.openings.restorables(
            await self.store.candidates_async(conv.keys, conv.namespace)
        )
        views = [StoredView(len(e.chain) or 1, shared, e.n_tokens) for e, shared in found]
        rule = self.openings.rule()
        i = pick_stored(rule, len(conv.keys), views)
        j = near_end_candidate(rule, views, i) if near_end else None
        if j is not None:
            # An editor back at a line it completed before: the state saved after a later
            # completion of that line parts from this prompt a few blocks before its end, and
            # a restored sliding-window state serves that if the rest fits in the window.
            before = await self._tokens_before(conv, views[j].shared)
            if before is not None and window_serves(rule, views[j], before):
                if i is None or before > views[i].n_tokens:
                    i = j
        if i is None or found[i][1] <= resident:
            return None
        return found[i][0]

    async def _tokens_before(self, conv: Conversation, depth: int) -> int | None:
        """How many tokens of the prompt its first `depth` blocks are, as the server counts."""
        text = leading_text(conv.payload, depth)
        if not text:
            return None
        try:
            return len(await self.work.client.tokenize(text))
        except UpstreamError as exc:
            log.debug("cannot count the tokens of a prompt's first blocks: %s", exc)
            return None
