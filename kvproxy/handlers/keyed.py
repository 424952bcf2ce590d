"""The path one keyed request follows on its lane's server, top to bottom: chats, Anthropic
Messages, OpenAI Responses, text completions and code infill alike.

The wire adapter has read the body as a Conversation (wire/); the pool gives it a slot (the
one holding its longest prefix the server will reuse, else an idle one); `prepare`
(prepare.py) gets its state into the slot (resident, restored from disk, or cold, saving what
the slot held first if it would be lost); the body goes out pinned with `id_slot` while the
reply is captured; afterwards the slot is recorded as holding the conversation plus the reply
as the client will echo it (`Slot.replied`), and the request is reported (report.py).
Requests the cache cannot key go through unkeyed.py.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.toolloops import ToolLoops
from kvproxy.cache.scheduling.background_saves import Warmer
from kvproxy.cache.servers.leases import Lease
from kvproxy.cache.servers.liveness import Hung
from kvproxy.cache.servers.loras import sent
from kvproxy.cache.servers.pace import Pace
from kvproxy.cache.servers.slotpool import QueueFull
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.handlers.answers import busy_response
from kvproxy.handlers.incoming import Incoming
from kvproxy.handlers.prepare import Preparer
from kvproxy.handlers.prepared import Prepared
from kvproxy.handlers.report import Report, Timed
from kvproxy.handlers.unkeyed import Unkeyed
from kvproxy.http.errors import unreachable_response
from kvproxy.http.relay import relay
from kvproxy.http.session import UpstreamError
from kvproxy.wire import Conversation, NotKeyed, WireAdapter, with_reply_cap
from kvproxy.wire.capture import Reply

log = logging.getLogger("kvproxy.cache")


class Keyed:
    def __init__(
        self,
        ctx: CacheContext,
        work: SlotWork,
        preparer: Preparer,
        unkeyed: Unkeyed,
        warmer: Warmer,
        report: Report,
        tool_loops: ToolLoops,
        pace: Pace,
    ) -> None:
        self.settings = ctx.settings
        self.reply_cap = ctx.settings.request_reply_cap
        self.backend = ctx.backend
        self.pool = ctx.backend.pool
        self.tenant_of = ctx.tenant_of
        self.background = ctx.background
        self.work = work
        self.preparer = preparer
        self.unkeyed = unkeyed
        self.warmer = warmer
        self.report = report
        self.tool_loops = tool_loops  # conversations waiting for a tool's result
        self.pace = pace  # the server's token gap, from the replies' timings

    def read(
        self, request: web.Request, adapter: WireAdapter, payload: dict[str, object]
    ) -> Conversation | NotKeyed:
        """The request as a conversation of this server's model (its namespace)."""
        return adapter.read(payload, self.backend.identity, self.tenant_of(request.headers))

    async def serve(
        self,
        request: web.Request,
        path_qs: str,
        adapter: WireAdapter,
        incoming: Incoming,
        conv: Conversation | NotKeyed | None = None,
    ) -> web.StreamResponse:
        """A keyed route's request, its body read and parsed, on this lane's server (the
        dispatch checked it is ready). `conv`: the body already read as a conversation of
        this server's model (dispatch.py read it to choose the server)."""
        parsed = incoming.parsed
        if parsed.opaque:
            # JSON kvproxy cannot read or write back: to the server as it came.
            return await self.unkeyed.hold_all(request, path_qs, incoming.raw())
        payload = parsed.value
        if not self.backend.enabled or not isinstance(payload, dict):
            # Not an object: the server rejects it before it touches a slot.
            return (await self.unkeyed.relay_bypass(request, path_qs, incoming.raw())).response
        if conv is None:
            conv = self.read(request, adapter, payload)
        if isinstance(conv, NotKeyed):
            log.debug("not caching %s: %s", path_qs, conv.reason)
            if adapter.route_pins and not conv.several_slots:
                return await self.unkeyed.forward_pinned(request, path_qs, payload)
            return await self.unkeyed.hold_all(request, path_qs, incoming.raw())
        incoming.let_go(request)  # it goes out written from the parse: held once while queued
        # Read under this server's fingerprint (servers of one fingerprint share a reading).
        self.backend.loras.note(conv)
        # Until a byte of the reply goes out, a server found hung sends the request elsewhere.
        unless_hung = self.backend.liveness.unless_hung
        try:
            slot, _ = await unless_hung(
                self.pool.acquire(conv.keys, conv.namespace, serves=self.preparer.serves(conv))
            )
        except Hung as exc:
            return unreachable_response(exc)
        except QueueFull as exc:
            self.report.busy(request.path, conv, incoming.started)
            return busy_response(exc)
        timed = Timed(incoming.started, time.perf_counter() - incoming.started)
        if conv.messages:
            # After the acquire: this request has its slot; a background save may take another.
            self.tool_loops.returned(conv.keys)
            self.warmer.seen(conv.keys)
        lease = Lease(self.pool, [slot], self.background)
        try:
            return await self._on_slot(request, path_qs, adapter, conv, slot, lease, timed)
        finally:
            lease.release()

    async def _on_slot(
        self,
        request: web.Request,
        path_qs: str,
        adapter: WireAdapter,
        conv: Conversation,
        slot: Slot,
        lease: Lease,
        timed: Timed,
    ) -> web.StreamResponse:
        try:
            prepared = self.preparer.at_once(slot, conv)  # the steady state: no I/O, no task
            if prepared is None:
                prepared = await self.backend.liveness.unless_hung(
                    lease.guarded(self.preparer.prepare_or_miss(slot, conv))
                )
        except asyncio.CancelledError:
            # Gone while kvproxy readied its slot (a restore, an opening's evaluation, which
            # go on): nothing was served, and the request is reported as such.
            self.report.gone_before(request.path, slot, conv, timed)
            raise
        except UpstreamError as exc:
            # The slot may hold another tenant's tokens and could not be erased; or the
            # server was found hung (Hung) while kvproxy readied the slot.
            return unreachable_response(exc)
        capture = adapter.capture(conv)
        try:
            result = await relay(
                request,
                self.backend.upstream,
                adapter.upstream_path(path_qs),
                adapter.pinned(
                    with_reply_cap(sent(conv, prepared.decision), self.reply_cap), slot.id
                ),
                body_replaced=True,
                extra_headers=prepared.headers(),
                tap=capture.feed,
                translator=adapter.translator(conv),
                until_headers=self.backend.liveness.unless_hung,
            )
        except asyncio.CancelledError:
            # The client hung up. Clients that stop reading at the reply's last event
            # (Codex) leave only the stream's end unread: that reply is whole.
            reply = capture.finish()
            if reply is not None and reply.complete:
                self._done(request, slot, conv, adapter, lease, prepared, reply, 200, timed)
            else:
                slot.interrupted(conv)
                self.report.interrupted(request.path, slot, conv, prepared, timed)
            raise
        except BaseException:
            slot.forget()
            raise
        # Even when the relay did not end cleanly, a reply the capture finds whole is whole:
        # the client may hang up once it has read the last event.
        reply = capture.finish() if result.status == 200 else None
        self._done(request, slot, conv, adapter, lease, prepared, reply, result.status, timed)
        return result.response

    def _done(
        self,
        request: web.Request,
        slot: Slot,
        conv: Conversation,
        adapter: WireAdapter,
        lease: Lease,
        prepared: Prepared,
        reply: Reply | None,
        status: int,
        timed: Timed,
    ) -> None:
        """After the reply: report the request (from what the slots held before it), record
        what the slot holds now, and with --write-through save it without the client (the
        slot held until it is saved)."""
        resident = self.report.resident_texts(conv)
        try:
            self.report.replied(request.path, slot, conv, prepared, reply, status, timed, resident)
        finally:
            timings = (reply.timings if reply is not None else None) or {}
            if reply is not None and reply.complete:
                slot.replied(conv, adapter.echoed(reply), timings)
                self.pace.replied(timings)
                if reply.finish_reason == "tool_calls" and slot.holding is not None:
                    # Its client runs the tool and comes back within seconds
                    # (cache/decisions/toolloops.py).
                    held = slot.holding
                    self.tool_loops.replied(held.namespace, held.chain, time.monotonic())
            else:
                slot.forget()
            if self.settings.write_through:
                lease.hand_off(self.work.write_through(slot))
            elif slot.holding is not None and "prompt_n" not in timings:
                # A reply without timings: its size is the server's to tell.
                self.background.spawn(self.work.snapshot_later(slot, slot.taken))
