"""The path one request follows, top to bottom.

A keyed request (`handle_keyed`): the wire adapter turns its body into a Conversation; the
pool gives it a slot (the one holding its longest prefix, else an idle one); `prepare` gets
its state into the slot (resident, restored from disk, or cold, saving what the slot held
first if it would be lost); the body goes out pinned with `id_slot` while the reply is
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
from kvproxy.cache.events import Count, Events, RequestEvent
from kvproxy.cache.explain import explain_against, why_weak
from kvproxy.cache.habits import Habits
from kvproxy.cache.habits.learning import HabitLearning
from kvproxy.cache.leases import Background, Lease
from kvproxy.cache.openings import Openings
from kvproxy.cache.policy import (
    Decision,
    Move,
    RestoreGuard,
    RestoreVerdict,
    choose,
    expected_resident,
    judge_restore,
    judge_reuse,
)
from kvproxy.cache.prepared import MISS, Prepared, next_turn_of
from kvproxy.cache.slotio import SlotWork
from kvproxy.cache.slots import Holding, QueueFull, Slot
from kvproxy.cache.unkeyed import Unkeyed, busy_response
from kvproxy.config import Settings
from kvproxy.http import bodies as jsonbody
from kvproxy.http.errors import error_response
from kvproxy.http.relay import relay
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry, Store
from kvproxy.wire import Conversation, NotKeyed, WireAdapter
from kvproxy.wire.capture import Reply

log = logging.getLogger("kvproxy.cache")

# How long what GET /slots showed after our own last use is trusted for a "resident" claim
# while no other slot got work (see SlotPool.still_as_seen). A wrong claim costs one slower
# request, never a wrong answer (the server compares tokens); checking costs a round trip on
# every request. Slot actions always check first.
SNAPSHOT_TRUST = 1.0
# The reply's length when its timings do not say (Responses JSON replies give usage only).
UNKNOWN_REPLY_TOKENS = 1 << 30


class Conversations:
    def __init__(
        self,
        settings: Settings,
        backend: Backend,
        store: Store,
        work: SlotWork,
        events: Events,
        habits: Habits,
        guard: RestoreGuard,
        background: Background,
        unkeyed: Unkeyed,
        warmer: Warmer,
    ) -> None:
        self.unkeyed = unkeyed
        self.warmer = warmer
        self.settings = settings
        self.backend = backend
        self.pool = backend.pool
        self.store = store
        self.work = work
        self.events = events
        self.habits = habits
        self.guard = guard
        self.background = background
        self.openings = Openings(backend, store, work, settings)
        self.learner = HabitLearning(habits, backend, store, background)

    # --- keyed requests

    async def handle_keyed(
        self, request: web.Request, path_qs: str, adapter: WireAdapter
    ) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.read()
        parsed = jsonbody.parse(body)
        if parsed.invalid is not None:
            message = f"Request body is not valid JSON: {parsed.invalid}"
            return error_response(400, message, "invalid_json")
        await self.backend.rediscover_if_off()
        if parsed.opaque:
            # JSON kvproxy cannot read or write back: to the server as it came.
            return await self.unkeyed.hold_all(request, path_qs, body)
        payload = parsed.value
        if not self.backend.enabled or not isinstance(payload, dict):
            # Not an object: the server rejects it before it touches a slot.
            return (await self.unkeyed.relay_bypass(request, path_qs, body)).response
        tenant = keys.tenant_of(request.headers, self.settings.tenant_header)
        conv = adapter.read(payload, self.backend.model_identity, tenant)
        if isinstance(conv, NotKeyed):
            log.debug("not caching %s: %s", path_qs, conv.reason)
            if adapter.route_pins and not conv.several_slots:
                return await self.unkeyed.forward_pinned(request, path_qs, payload)
            return await self.unkeyed.hold_all(request, path_qs, body)

        try:
            slot, _ = await self.pool.acquire(conv.keys, conv.namespace)
        except QueueFull as exc:
            waited = time.perf_counter() - started
            self.events.request(
                RequestEvent(
                    request.path,
                    Decision.BUSY,
                    503,
                    key=conv.keys[-1],
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
                prepared = await lease.guarded(self._prepare_or_miss(slot, conv))
            except UpstreamError as exc:
                # The slot may hold another tenant's tokens and could not be erased.
                return error_response(
                    502, f"llama-server is unreachable: {exc}", "upstream_unreachable"
                )
            capture = adapter.capture(conv)
            try:
                result = await relay(
                    request,
                    self.backend.upstream,
                    adapter.upstream_path(path_qs),
                    adapter.pinned(conv.payload, slot.id),
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
                    slot.forget()  # cut off mid-reply: the slot holds something we cannot name
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
        """After the reply: judge a restore, hand the slot's bookkeeping off (it goes on
        without the client), and report the request."""
        if prepared.decision is Decision.RESTORED:
            self._judge_restore(conv.namespace, prepared.expected_n, reply)
        lease.hand_off(self._after_reply(slot, conv, reply, adapter))
        timings = (reply.timings if reply is not None else None) or {}
        started, queue_wait = times
        event = RequestEvent(
            route=request.path,
            decision=prepared.decision,
            status=status,
            key=conv.keys[-1],
            slot=slot.id,
            queue_wait_s=queue_wait,
            duration_s=time.perf_counter() - started,
            restored_tokens=prepared.restored_tokens,
            restore_ms=prepared.restore_ms,
            # What came from a cache: not the tokens kvproxy had evaluated on the way.
            cache_n=_less(_int_or_none(timings.get("cache_n")), prepared.evaluated),
            prompt_n=_int_or_none(timings.get("prompt_n")),
            prompt_ms=_float_or_none(timings.get("prompt_ms")),
            expected_n=prepared.expected_n,
        )
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

    async def _prepare_or_miss(self, slot: Slot, conv: Conversation) -> Prepared:
        try:
            return await self.prepare(slot, conv)
        except UpstreamError as exc:
            # The cache could not do its part; the request still goes through, uncached, once
            # the slot holds nothing of another tenant's (else the UpstreamError is the answer).
            log.warning("cache preparation failed on slot %d: %s", slot.id, exc)
            slot.forget()
            await self.work.admit(slot, conv.tenant)
            return MISS

    async def prepare(self, slot: Slot, conv: Conversation) -> Prepared:
        """Get the conversation's state into the slot, as far as kvproxy can."""
        learnt = self.learner.from_slot(slot, conv)
        if slot.holding is not None and not self.pool.still_as_seen(slot, SNAPSHOT_TRUST):
            await self.work.verify(slot)
        # What the slot holds counts only if the server can serve the request from it.
        resident = self.openings.resident_depth(slot, conv)
        # The next turn of what the slot holds (the steady state of every agent loop): no
        # stored entry could serve more, nor show a new opening. No index query then.
        next_turn = next_turn_of(slot, conv, resident)
        found = None
        if self.backend.disk_enabled and not next_turn:
            found = await self._lookup(conv)
        if not learnt and not next_turn:
            # A rewrite is a habit of the client, not a branch whose opening is worth keeping.
            await self.openings.observe(conv, self.pool)
        move = choose(resident, found[1] if found else None, self.guard.allows(conv.namespace))
        if move is Move.RESTORE:
            assert found is not None
            entry = found[0]
            await self.work.verify(slot)  # a slot action follows: the slot must be idle
            if self.work.worth_saving(slot, conv.keys):
                await self.work.save(slot)
            await self.openings.before_reassign(slot, conv)
            await self.work.admit(slot, conv.tenant)
            outcome = await self.work.restore(slot, entry)
            if outcome is None:
                return MISS
            if not self.habits.echo.known(conv.namespace):
                self.background.spawn(self.learner.from_disk(entry, found[1], conv))
            n = outcome.n_restored
            # A new session restored from a shorter opening than the one it shares (seen
            # since): that one is saved on the way, for the sessions after it.
            evaluated = await self.openings.prefill(slot, conv, start=found[1])
            # A request that parts from the entry before its end (a near-end divergence, or any
            # prefix on a dense model) reuses an unknown part of it: not judged.
            expected = n if found[1] >= len(entry.chain) else None
            return Prepared(
                Decision.RESTORED, n, outcome.ms, expected_n=expected, evaluated=evaluated
            )
        if move is Move.USE_RESIDENT:
            held = slot.holding
            if held is not None and resident < len(held.chain) and await self.openings.wanted(held):
                # A new session or a branch parts from the slot's conversation: keep that
                # conversation, and leave the opening they share on disk and in the slot.
                await self.work.verify(slot)
                if self.work.worth_saving(slot, conv.keys):
                    await self.work.save(slot)
                await self.openings.before_reassign(slot, conv)
                resident, held = self.openings.resident_depth(slot, conv), slot.holding
                if resident == 0:
                    return MISS
            expected = (
                None
                if held is None
                else expected_resident(resident, len(held.chain), held.n_tokens)
            )
            return Prepared(Decision.RESIDENT, expected_n=expected)
        if self.work.worth_saving(slot, conv.keys):
            await self.work.verify(slot)
            if self.work.worth_saving(slot, conv.keys):
                await self.work.save(slot)
        if slot.holding is not None and await self.openings.wanted(slot.holding):
            await self.work.verify(slot)
            await self.openings.before_reassign(slot, conv)
        await self.work.admit(slot, conv.tenant)
        evaluated = await self.openings.prefill(slot, conv)
        return Prepared(Decision.MISS, evaluated=evaluated) if evaluated else MISS

    async def _lookup(self, conv: Conversation) -> tuple[Entry, int] | None:
        # The entry the server will reuse most, by the model class's rule (openings.py).
        found = await self.openings.pick(conv)
        # Housekeeping applies the TTL every second; an entry that expired since then is
        # not restored either (a full eviction pass costs O(entries) per request).
        if found is not None and self.store.expired(found[0]):
            await self.work.evict()
            found = await self.openings.pick(conv)
        return found

    def _judge_restore(self, namespace: str, expected: int | None, reply: Reply | None) -> None:
        timings = (reply.timings if reply is not None else None) or {}
        cache_n = _int_or_none(timings.get("cache_n"))
        prompt_n = _int_or_none(timings.get("prompt_n"))
        verdict = judge_restore(expected, cache_n, prompt_n)
        if verdict is RestoreVerdict.WASTED:
            self.events.count(Count.WASTED_RESTORE)
        if self.guard.record(namespace, verdict):
            log.warning(
                "llama-server reused none of %s restored tokens (cache_n=%s), %d times in a "
                "row: kvproxy stops restoring for this model. Sliding-window models (Gemma, "
                "gpt-oss) need llama-server --swa-full; recurrent and hybrid models reuse a "
                "restore only when the next prompt extends it exactly.",
                expected,
                cache_n,
                self.guard.limit,
            )

    async def _after_reply(
        self, slot: Slot, conv: Conversation, reply: Reply | None, adapter: WireAdapter
    ) -> None:
        if reply is not None and reply.complete:
            echoed = adapter.echoed(reply)
            chain = [*conv.keys, keys.extend(conv.keys[-1], echoed)]
            timings = reply.timings or {}
            n_tokens = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
            messages = [*conv.messages, echoed]
            slot.hold(
                Holding(conv.namespace, chain, n_tokens, len(messages), messages, conv.template),
                saved=False,
            )
        else:
            slot.forget()
        if not self.settings.write_through:
            # The slot goes back now; what the server shows of it is asked without it.
            timings = (reply.timings if reply is not None else None) or {}
            generated = timings.get("predicted_n")
            slot.ours_ended(
                slot.holding.n_tokens if slot.holding is not None else 0,
                # Not told: any size from the prompt on (a new task id is still required).
                generated if isinstance(generated, int) else UNKNOWN_REPLY_TOKENS,
            )
            self.background.spawn(self.work.snapshot_later(slot, slot.taken))
            return
        try:
            await self.work.snapshot(slot)
            if self.work.worth_saving(slot):
                await self.work.save(slot)
        except Exception as exc:  # runs detached: nobody else would see it
            log.warning("after the reply on slot %d: %s", slot.id, exc)
            slot.forget()

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
        self.events.request(event)


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _less(value: int | None, minus: int) -> int | None:
    return None if value is None else max(0, value - minus)


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None
