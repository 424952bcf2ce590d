"""A keyed request's report: what kvproxy did for it and what the server reused, as one event
for metrics, the log line and the status page; a restore judged by the reply's timings; a
miss explained (where it parted from the closest conversation kvproxy knew).

The driver (keyed.py) calls one of three at its end: `busy` (refused, every slot taken),
`interrupted` (the client hung up), `replied`. Chats, Messages, Responses, text completions
and infill are reported alike: decision, slot, server, queue wait, and the reply's
`cache_n`/`prompt_n` (what came from a cache, what was prefilled).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import Decision, RestoreVerdict, judge_restore, judge_reuse
from kvproxy.cache.prefixes.stems import Stems
from kvproxy.cache.reports.events import Count, RequestEvent
from kvproxy.cache.reports.explain import explain_against, wasted_hint, why_weak
from kvproxy.cache.servers.slots import Slot
from kvproxy.handlers.prepared import Prepared
from kvproxy.wire import Conversation
from kvproxy.wire.capture import Reply

log = logging.getLogger("kvproxy.cache")

# The status a request's log line and metrics show when its client hung up mid-reply (nginx's).
CLIENT_CLOSED = 499


@dataclass(frozen=True)
class Timed:
    """When a request came (time.perf_counter()) and how long it waited for its slot."""

    started: float
    queue_wait: float = 0.0


class Report:
    def __init__(self, ctx: CacheContext, stems: Stems) -> None:
        self.backend = ctx.backend
        self.pool = ctx.backend.pool
        self.store = ctx.store
        self.events = ctx.events
        self.guard = ctx.guard
        self.background = ctx.background
        self.stems = stems  # a miss explained teaches stems where sessions part

    def busy(self, route: str, conv: Conversation, started: float) -> None:
        """Refused: every slot busy and the queue full (or the wait timed out)."""
        waited = time.perf_counter() - started
        event = RequestEvent(route, Decision.BUSY, 503, key=conv.keys[-1])
        event.backend, event.queue_wait_s, event.duration_s = self.backend.label, waited, waited
        event.served_by = self.backend.name
        self.events.request(event)

    def gone_before(self, route: str, slot: Slot, conv: Conversation, timed: Timed) -> None:
        """The client hung up while kvproxy readied its slot: nothing was served."""
        event = self._event(route, slot, conv, Prepared(Decision.MISS), CLIENT_CLOSED, timed)
        self.events.request(event)

    def interrupted(
        self, route: str, slot: Slot, conv: Conversation, prepared: Prepared, timed: Timed
    ) -> None:
        """The client hung up mid-reply."""
        self.events.request(self._event(route, slot, conv, prepared, CLIENT_CLOSED, timed))

    def resident_texts(self, conv: Conversation) -> list[tuple[str, list[Any]]]:
        """What the namespace's slots hold, to explain a miss against: taken before the
        reply's bookkeeping replaces what the request's slot held."""
        if not conv.messages:
            return []
        return [
            (f"slot {slot.id}", slot.holding.messages)
            for slot in self.pool.holding_namespace(conv.namespace)
            if slot.holding is not None and slot.holding.messages
        ]

    def replied(
        self,
        route: str,
        slot: Slot,
        conv: Conversation,
        prepared: Prepared,
        reply: Reply | None,
        status: int,
        timed: Timed,
        resident: list[tuple[str, list[Any]]],
    ) -> None:
        """The reply relayed: judge a restore, report the request (`resident`: what the slots
        held before it, for a miss's explanation)."""
        timings = (reply.timings if reply is not None else None) or {}
        cache_n = _int_or_none(timings.get("cache_n"))
        prompt_n = _int_or_none(timings.get("prompt_n"))
        if prepared.decision is Decision.RESTORED:
            self._judge_restore(conv.namespace, prepared, cache_n, prompt_n)
        event = self._event(route, slot, conv, prepared, status, timed)
        # What came from a cache: not the tokens kvproxy had evaluated on the way.
        event.cache_n = None if cache_n is None else max(0, cache_n - prepared.evaluated)
        event.prompt_n = prompt_n
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
        if prepared.decision is Decision.MISS and conv.messages:
            # Explaining may read stored conversations (in a thread); the client may hang
            # up meanwhile, cancelling the handler, so it runs detached.
            self.background.spawn(self._explained(event, conv, resident))
        else:
            self.events.request(event)

    def _judge_restore(
        self, namespace: str, prepared: Prepared, cache_n: int | None, prompt_n: int | None
    ) -> None:
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

    async def _explained(
        self, event: RequestEvent, conv: Conversation, candidates: list[tuple[str, list[Any]]]
    ) -> None:
        event.miss = await explain_against(conv.namespace, conv.messages, candidates, self.store)
        if event.miss is not None:
            # Inside a long system message, what follows changes between sessions: a stem
            # ends before it (cache/prefixes/stems.py).
            self.stems.cuts.learn(
                conv.namespace, conv.messages, event.miss.message_index, event.miss.char_offset
            )
        self.events.request(event)

    def _event(
        self,
        route: str,
        slot: Slot,
        conv: Conversation,
        prepared: Prepared,
        status: int,
        timed: Timed,
    ) -> RequestEvent:
        """The request's report as far as what kvproxy did for it (the reply's numbers apart)."""
        return RequestEvent(
            route=route,
            decision=prepared.decision,
            status=status,
            key=conv.keys[-1],
            slot=slot.id,
            backend=self.backend.label,
            queue_wait_s=timed.queue_wait,
            duration_s=time.perf_counter() - timed.started,
            restored_tokens=prepared.restored_tokens,
            restore_ms=prepared.restore_ms,
            evaluated=prepared.evaluated,
            expected_n=prepared.expected_n,
            served_by=self.backend.name,
        )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None
