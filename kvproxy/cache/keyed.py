"""The path one request follows, top to bottom.

A keyed request (`handle_keyed`): the wire adapter turns its body into a Conversation; the
pool gives it a slot (the one holding its longest prefix, else an idle one); `prepare`
(prepare.py) gets its state into the slot (resident, restored from disk, or cold, saving what
the slot held first if it would be lost); the body goes out pinned with `id_slot` while the reply is
captured; afterwards the slot is recorded as holding the conversation plus the reply as the
client will echo it. Requests the cache cannot key go through unkeyed.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from aiohttp import web

from kvproxy import keys
from kvproxy.cache.backend import Backend
from kvproxy.cache.background_saves import Warmer
from kvproxy.cache.context import CacheContext
from kvproxy.cache.events import Count, RequestEvent
from kvproxy.cache.explain import explain_against, wasted_hint, why_weak
from kvproxy.cache.incoming import Incoming, read_incoming
from kvproxy.cache.leases import Lease
from kvproxy.cache.loras import sent
from kvproxy.cache.policy import Decision, RestoreVerdict, judge_restore, judge_reuse
from kvproxy.cache.prepare import Preparer
from kvproxy.cache.prepared import Prepared
from kvproxy.cache.refusals import busy_response
from kvproxy.cache.slotio import SlotWork
from kvproxy.cache.slots import Holding, QueueFull, Slot
from kvproxy.cache.unkeyed import Unkeyed
from kvproxy.http.errors import unreachable_response
from kvproxy.http.relay import relay
from kvproxy.http.session import UpstreamError
from kvproxy.wire import Conversation, NotKeyed, WireAdapter, with_reply_cap
from kvproxy.wire.capture import Reply

log = logging.getLogger("kvproxy.cache")


# The status a request's log line and metrics show when its client hung up mid-reply (nginx's).
CLIENT_CLOSED = 499
# The reply's length when its timings do not say (Responses JSON replies give usage only).
UNKNOWN_REPLY_TOKENS = 1 << 30


class Conversations:
    def __init__(
        self,
        ctx: CacheContext,
        work: SlotWork,
        preparer: Preparer,
        unkeyed: Unkeyed,
        warmer: Warmer,
    ) -> None:
        self.settings = ctx.settings
        self.reply_cap = ctx.settings.request_reply_cap
        self.backend = ctx.backend
        self.pool = ctx.backend.pool
        self.store = ctx.store
        self.tenant_of = ctx.tenant_of
        self.events = ctx.events
        self.guard = ctx.guard
        self.background = ctx.background
        self.work = work
        self.preparer = preparer
        self.unkeyed = unkeyed
        self.warmer = warmer

    # --- keyed requests

    async def handle_keyed(
        self, request: web.Request, path_qs: str, adapter: WireAdapter
    ) -> web.StreamResponse:
        incoming = await read_incoming(request)
        if isinstance(incoming, web.Response):
            return incoming
        return await self.serve(request, path_qs, adapter, incoming)

    def read(
        self, request: web.Request, adapter: WireAdapter, payload: dict[str, Any]
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
        """A keyed route's request, its body read and parsed, on this lane's server. `conv`:
        the body already read as a conversation of this server's model (router.py)."""
        started, parsed = incoming.started, incoming.parsed
        await self.backend.rediscover_if_off()
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

        try:
            slot, _ = await self.pool.acquire(
                conv.keys, conv.namespace, serves=self.preparer.serves(conv)
            )
        except QueueFull as exc:
            waited = time.perf_counter() - started
            self.events.request(
                RequestEvent(
                    request.path,
                    Decision.BUSY,
                    503,
                    key=conv.keys[-1],
                    backend=self.backend.label,
                    queue_wait_s=waited,
                    duration_s=waited,
                )
            )
            return busy_response(exc)
        times = (started, time.perf_counter() - started)  # (start, queue wait)
        # After the acquire: this request has its slot; a background save may take another.
        self.warmer.seen(conv.keys)
        lease = Lease(self.pool, [slot], self.background)
        try:
            try:
                prepared = self.preparer.at_once(slot, conv)  # the steady state: no I/O, no task
                if prepared is None:
                    prepared = await lease.guarded(self.preparer.prepare_or_miss(slot, conv))
            except asyncio.CancelledError:
                # Gone while kvproxy readied its slot (a restore, an opening's evaluation,
                # which go on): nothing was served, and the request is reported as such.
                waited = time.perf_counter() - started
                event = RequestEvent(request.path, Decision.MISS, CLIENT_CLOSED, key=conv.keys[-1])
                event.slot, event.queue_wait_s, event.duration_s = slot.id, times[1], waited
                self.events.request(event)
                raise
            except UpstreamError as exc:
                # The slot may hold another tenant's tokens and could not be erased.
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
                )
            except asyncio.CancelledError:
                # The client hung up. Clients that stop reading at the reply's last event
                # (Codex) leave only the stream's end unread: that reply is whole.
                reply = capture.finish()
                if reply is not None and reply.complete:
                    self._record(request, slot, conv, adapter, lease, prepared, reply, 200, times)
                else:
                    self._interrupted(request, slot, conv, prepared, times)
                raise
            except BaseException:
                slot.forget()
                raise
            # Even when the relay did not end cleanly, a reply the capture finds whole is whole:
            # the client may hang up once it has read the last event.
            reply = capture.finish() if result.status == 200 else None
            self._record(request, slot, conv, adapter, lease, prepared, reply, result.status, times)
            return result.response
        finally:
            lease.release()

    def _interrupted(
        self,
        request: web.Request,
        slot: Slot,
        conv: Conversation,
        prepared: Prepared,
        times: tuple[float, float],
    ) -> None:
        """The client hung up mid-reply (a user's Esc or Ctrl-C): the slot still holds the
        request's prompt, and what was generated of the reply. The client's next turn starts
        with that prompt, so the slot is recorded as holding it: resident for that turn, or
        saved when the slot is needed. How many tokens it holds is what the server shows
        once its task has ended (the next check of the slot asks); a server that never
        started the task shows the old one, and the slot is then forgotten."""
        held = Holding(conv.namespace, list(conv.keys), 0, len(conv.messages), list(conv.messages))
        held.template = dict(conv.template)
        slot.hold(held, saved=False)
        slot.ours_ended(0, UNKNOWN_REPLY_TOKENS)
        event = _event(request, slot, conv, prepared, CLIENT_CLOSED, times, self.backend)
        self.events.request(event)

    def _record(
        self,
        request: web.Request,
        slot: Slot,
        conv: Conversation,
        adapter: WireAdapter,
        lease: Lease,
        prepared: Prepared,
        reply: Reply | None,
        status: int,
        times: tuple[float, float],
    ) -> None:
        """After the reply: judge a restore, report the request, and record what the slot
        holds now (after the report, which looks at what it held; with --write-through the
        save goes on without the client)."""
        if self.settings.write_through:
            lease.hand_off(self._write_through(slot, conv, reply, adapter))
        try:
            self._report(request, slot, conv, prepared, reply, status, times)
        finally:
            if not self.settings.write_through:
                self._reply_held(slot, conv, reply, adapter)

    def _report(
        self,
        request: web.Request,
        slot: Slot,
        conv: Conversation,
        prepared: Prepared,
        reply: Reply | None,
        status: int,
        times: tuple[float, float],
    ) -> None:
        if prepared.decision is Decision.RESTORED:
            self._judge_restore(conv.namespace, prepared, reply)
        timings = (reply.timings if reply is not None else None) or {}
        event = _event(request, slot, conv, prepared, status, times, self.backend)
        # What came from a cache: not the tokens kvproxy had evaluated on the way.
        event.cache_n = _less(_int_or_none(timings.get("cache_n")), prepared.evaluated)
        event.prompt_n = _int_or_none(timings.get("prompt_n"))
        prompt_ms = timings.get("prompt_ms")
        event.prompt_ms = float(prompt_ms) if isinstance(prompt_ms, int | float) else None
        verdict = judge_reuse(prepared.expected_n, event.cache_n, event.prompt_n)
        if verdict is RestoreVerdict.WASTED:
            held = slot.holding
            event.weak = why_weak(
                prepared.decision is Decision.RESTORED,
                self.backend.model_info,
                conv.messages,
                (f"slot {slot.id}", held.messages) if held is not None else None,
            )
        if prepared.decision is Decision.MISS:
            # Explaining may read stored conversations (in a thread); the client may hang
            # up meanwhile, cancelling the handler, so it runs detached.
            self.background.spawn(self._emit_explained(event, conv, self._resident_texts(conv)))
        else:
            self.events.request(event)

    def _judge_restore(self, namespace: str, prepared: Prepared, reply: Reply | None) -> None:
        timings = (reply.timings if reply is not None else None) or {}
        cache_n = _int_or_none(timings.get("cache_n"))
        prompt_n = _int_or_none(timings.get("prompt_n"))
        verdict = judge_restore(prepared.expected_n, cache_n, prompt_n)
        if verdict is RestoreVerdict.WASTED:
            self.events.count(Count.WASTED_RESTORE)
        if prepared.restored_from is None:
            return
        key, older = prepared.restored_from
        swa_full = self.backend.fingerprint.swa_full if self.backend.fingerprint else None
        if self.guard.record(self.backend.life, namespace, key, older, verdict):
            log.warning(
                "llama-server reused none of %s restored tokens (cache_n=%s), %d times in a "
                "row: %s",
                prepared.expected_n,
                cache_n,
                self.guard.limit,
                wasted_hint(self.backend.model_info, swa_full, older),
            )

    def _reply_held(
        self, slot: Slot, conv: Conversation, reply: Reply | None, adapter: WireAdapter
    ) -> None:
        """What the slot holds after the reply (no I/O: the slot goes back at once)."""
        timings = (reply.timings if reply is not None else None) or {}
        prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        generated = timings.get("predicted_n")
        if reply is not None and reply.complete:
            echoed = adapter.echoed(reply)
            chain = [*conv.keys, keys.extend(conv.keys[-1], echoed)]
            messages = [*conv.messages, echoed]
            # What the server's slot holds now: the prompt and the reply but its last token,
            # which was sampled and never evaluated (GET /slots would show the same).
            held = prompt + max(generated - 1, 0) if isinstance(generated, int) else prompt
            slot.hold(
                Holding(conv.namespace, chain, held, len(messages), messages, conv.template),
                saved=False,
            )
        else:
            slot.forget()
        if not self.settings.write_through:
            # The reply tells what the slot holds: no GET /slots now. The next check of the
            # slot (`SlotWork.verify`, before anything trusts it past SNAPSHOT_TRUST or acts on
            # it) wants a task newer than the last one seen and a token count from the prompt
            # to the prompt and the reply: a slot wiped or used by others meanwhile fails it.
            slot.ours_ended(
                prompt if slot.holding is not None else 0,
                # Not told: any size from the prompt on (a new task id is still required).
                generated if isinstance(generated, int) else UNKNOWN_REPLY_TOKENS,
            )
            if slot.holding is not None and "prompt_n" not in timings:
                # A reply without timings: its size is the server's to tell.
                self.background.spawn(self.work.snapshot_later(slot, slot.taken))

    async def _write_through(
        self, slot: Slot, conv: Conversation, reply: Reply | None, adapter: WireAdapter
    ) -> None:
        """--write-through: every reply is saved, the slot held until it is."""
        self._reply_held(slot, conv, reply, adapter)
        await self.work.after_reply(slot, save=True)

    # --- misses explained

    def _resident_texts(self, conv: Conversation) -> list[tuple[str, list[Any]]]:
        """Taken before the reply's bookkeeping replaces what the request's slot held."""
        return [
            (f"slot {slot.id}", slot.holding.messages)
            for slot in self.pool.holding_namespace(conv.namespace)
            if slot.holding is not None and slot.holding.messages
        ]

    async def _emit_explained(
        self, event: RequestEvent, conv: Conversation, candidates: list[tuple[str, list[Any]]]
    ) -> None:
        event.miss = await explain_against(conv.namespace, conv.messages, candidates, self.store)
        if event.miss is not None:
            self.preparer.parted(conv, event.miss.message_index, event.miss.char_offset)
        self.events.request(event)


def _event(
    request: web.Request,
    slot: Slot,
    conv: Conversation,
    prepared: Prepared,
    status: int,
    times: tuple[float, float],
    backend: Backend,
) -> RequestEvent:
    """The request's report as far as what kvproxy did for it (the reply's numbers apart)."""
    started, queue_wait = times
    return RequestEvent(
        route=request.path,
        decision=prepared.decision,
        status=status,
        key=conv.keys[-1],
        slot=slot.id,
        backend=backend.label,
        queue_wait_s=queue_wait,
        duration_s=time.perf_counter() - started,
        restored_tokens=prepared.restored_tokens,
        restore_ms=prepared.restore_ms,
        evaluated=prepared.evaluated,
        expected_n=prepared.expected_n,
        served_by=backend.name,
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _less(value: int | None, minus: int) -> int | None:
    return None if value is None else max(0, value - minus)
