"""Requests the cache does not key, forwarded so that kvproxy's picture of the slots stays
true: a slot-using request goes to a slot kvproxy chose (pinned with `id_slot`) and that slot
is forgotten afterwards; on routes that ignore `id_slot` the request holds every slot. Either
way, what a slot held is saved first if it would be lost.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from aiohttp import web

from kvproxy import keys
from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.reports.events import RequestEvent
from kvproxy.cache.scheduling.savegate import SaveGate
from kvproxy.cache.servers.backend import REFUSED_STATUSES
from kvproxy.cache.servers.leases import Lease
from kvproxy.cache.servers.slotpool import QueueFull
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.handlers.answers import busy_response, unreachable_response
from kvproxy.http.relay import RelayResult, relay
from kvproxy.http.session import UpstreamError

log = logging.getLogger("kvproxy.cache")


class Unkeyed:
    def __init__(self, ctx: CacheContext, work: SlotWork, gate: SaveGate) -> None:
        self.gate = gate  # one save at a time on the server, when it pauses nobody
        self.backend = ctx.backend
        self.settings = ctx.settings
        self.tenant_of = ctx.tenant_of
        self.pool = ctx.backend.pool
        self.work = work
        self.events = ctx.events
        self.background = ctx.background

    async def forward_pinned(
        self, request: web.Request, path_qs: str, payload: dict[str, Any]
    ) -> web.StreamResponse:
        """A slot-using request the cache does not key: pinned, so no slot changes behind us."""
        try:
            slot, _ = await self.pool.acquire()
        except QueueFull as exc:
            return busy_response(exc)
        lease = Lease(self.pool, [slot], self.background)
        try:
            await lease.guarded(self._clear_for_foreign_use(slot, gated=True, commit_later=True))
            slot.forget()
            if not await lease.guarded(self._admit([slot], request)):
                return unreachable_response()
            scales = self.backend.identity.lora_scales(payload)
            if scales:  # named in full: the server clears a slot last used with others
                payload = {**payload, "lora": keys.lora_body(scales)}
            body = orjson.dumps({**payload, "id_slot": slot.id})
            return (await self.relay_bypass(request, path_qs, body)).response
        finally:
            lease.release()

    async def handle_unpinnable(
        self, request: web.Request, path_qs: str, path: str
    ) -> web.StreamResponse:
        """Routes that ignore `id_slot` (embeddings, rerank, ...): the server picks a slot
        itself, so the proxy holds all of them, saves what would be lost, and re-reads them
        afterwards; unless the server refuses the route outright, without a slot."""
        body = await request.read()
        if self.backend.enabled and await self.backend.refuses(path):
            result = await self.relay_bypass(request, path_qs, body)
            if result.status not in REFUSED_STATUSES:
                self.backend.served(path)
            return result.response
        return await self.hold_all(request, path_qs, body)

    async def hold_all(self, request: web.Request, path_qs: str, body: bytes) -> web.StreamResponse:
        if not self.backend.enabled:
            return (await self.relay_bypass(request, path_qs, body)).response
        try:
            taken = await self.pool.acquire_all()
        except QueueFull as exc:
            return busy_response(exc)
        lease = Lease(self.pool, taken, self.background)
        try:
            for slot in taken:
                await lease.guarded(self._clear_for_foreign_use(slot))
            # The server picks among these slots by what they hold: none may hold another
            # tenant's tokens.
            if not await lease.guarded(self._admit(taken, request)):
                for slot in taken:
                    slot.forget()
                return unreachable_response()
            try:
                result = await self.relay_bypass(request, path_qs, body)
            except BaseException:
                for slot in taken:
                    slot.forget()
                raise
            lease.hand_off(self._reverify(taken))
            return result.response
        finally:
            lease.release()

    async def _reverify(self, slots: list[Slot]) -> None:
        for slot in slots:
            try:
                await self.work.verify(slot)
            except UpstreamError:
                slot.forget()

    async def _admit(self, slots: list[Slot], request: web.Request) -> bool:
        """Erase those of `slots` that may hold another tenant's tokens; False if one could
        not be erased (the request must not go)."""
        tenant = self.tenant_of(request.headers)
        try:
            for slot in slots:
                await self.work.admit(slot, tenant)
        except UpstreamError as exc:
            log.warning("could not erase a slot before another tenant's request: %s", exc)
            return False
        return True

    async def _clear_for_foreign_use(
        self, slot: Slot, gated: bool = False, commit_later: bool = False
    ) -> None:
        """Before a request the cache does not key uses the slot: keep what would be lost
        (`gated`: in a moment when it pauses no other slot's stream; a request holding every
        slot pauses none). `commit_later`: the request waits for the server's write only
        (cache/slotio/slotwork.py); one holding every slot (a model unloaded, embeddings) waits
        for the commits too, so what it unloads is in the index when it answers."""
        try:
            await self.work.verify(slot)
            if gated and self.work.worth_saving(slot):
                async with self.gate.turn(slot):
                    await self.work.save_if_worth(slot, commit_later=commit_later)
            else:
                await self.work.save_if_worth(slot, commit_later=commit_later)
        except UpstreamError as exc:
            log.warning("could not save slot %d before a bypass request: %s", slot.id, exc)
            slot.forget()

    async def relay_bypass(self, request: web.Request, path_qs: str, data: bytes) -> RelayResult:
        started = time.perf_counter()
        result = await relay(
            request,
            self.backend.upstream,
            path_qs,
            data,
            body_replaced=True,
            extra_headers={"X-KVProxy-Cache": Decision.BYPASS.value},
        )
        duration = time.perf_counter() - started
        self.events.request(
            RequestEvent(
                request.path,
                Decision.BYPASS,
                result.status,
                backend=self.backend.label,
                duration_s=duration,
            )
        )
        return result
