"""What the cache reports about its work, for metrics and the per-request log line.

The cache calls every listener synchronously on the event loop; listeners must be quick and
must not raise (an exception is logged and dropped so a listener bug never fails a request).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.decisions.prefillrate import PrefillRates

log = logging.getLogger("kvproxy.events")


class Count(StrEnum):
    """Things the cache counts that are not a request or a slot action."""

    EVICTION = "eviction"  # an entry evicted (TTL or byte budget)
    SUPERSEDED = "superseded"  # an older state of a conversation a newer one stands for
    SAVE_TOO_BIG = "save_too_big"  # a save not attempted: bigger than the whole byte budget
    SLOT_RESET = "slot_reset"  # a slot found changed behind kvproxy's back
    WASTED_RESTORE = "wasted_restore"  # a restore the server did not reuse
    PREFETCH = "prefetch"  # a conversation waiting for a tool's result restored ahead of it
    # A stored state not restored: prefilling what it gives back was measured cheaper
    # (cache/decisions/payoff.py)
    PREFILL_OVER_RESTORE = "prefill_over_restore"


@dataclass
class MissExplanation:
    """Where a request parted from the closest conversation the cache knew."""

    message_index: int  # first message that differs
    char_offset: int  # first differing character in that message's text
    ours: str  # short excerpt of the request's text around the divergence
    theirs: str  # the same excerpt of the known conversation
    where: str  # "slot N" or "disk"


@dataclass
class RequestEvent:
    """One request through the proxy, after its reply was relayed."""

    route: str
    decision: Decision
    status: int
    key: str = ""  # conversation key (hex), "" when the request was not keyed
    slot: int | None = None
    # The server (host:port) of the request's slot, when kvproxy fronts several.
    backend: str | None = None
    queue_wait_s: float = 0.0
    duration_s: float = 0.0
    restored_tokens: int = 0
    restore_ms: float = 0.0
    cache_n: int | None = None  # from the reply's `timings`, when it had them
    prompt_n: int | None = None
    prompt_ms: float | None = None
    # Tokens kvproxy had the server compute for the request before forwarding it (an opening
    # to save on the way): computed for it, though the reply's cache_n counts them.
    evaluated: int = 0
    miss: MissExplanation | None = None
    # Tokens a resident/restored decision expected the server to reuse (None: not judged),
    # and, when the server reused less than half of them, why (where the request parted from
    # what the slot held, when known).
    expected_n: int | None = None
    weak: str | MissExplanation | None = None
    # The server (and a router's model) that served it, whose cold prefills price its cached
    # tokens; set even with one server (`backend` names it only among several).
    served_by: str = ""
    # Prefill time its cached tokens saved (set by `Events`; None: no cold prefill seen yet).
    prefill_saved_s: float | None = None


@dataclass
class SlotActionEvent:
    """A save or restore kvproxy asked the server for."""

    action: str  # save | restore
    ok: bool
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    background: bool = False  # a save no request waited for (cache/scheduling/background_saves.py)


class Listener(Protocol):
    def on_request(self, event: RequestEvent) -> None: ...

    def on_slot_action(self, event: SlotActionEvent) -> None: ...

    def on_count(self, what: Count, n: int) -> None: ...


@dataclass
class Events:
    """Where the cache's parts report; metrics and the request log listen. Prices each
    request's cached tokens once, for all of them."""

    listeners: list[Listener] = field(default_factory=list)
    rates: PrefillRates = field(default_factory=PrefillRates)

    def request(self, event: RequestEvent) -> None:
        if event.prompt_n is not None and event.prompt_ms is not None:
            self.rates.observe(event.served_by, event.cache_n, event.prompt_n, event.prompt_ms)
        event.prefill_saved_s = self.rates.saved_s(event.served_by, event.cache_n, event.restore_ms)
        for listener in self.listeners:
            try:
                listener.on_request(event)
            except Exception:
                log.exception("request listener %r failed", listener)

    def prefilled(self, served_by: str, timings: Mapping[str, Any]) -> None:
        """The timings of kvproxy's own evaluation (an opening, a canonical prefix): a cold
        prefill there, such as a new conversation's system prompt, prices cached tokens."""
        prompt_n, prompt_ms = timings.get("prompt_n"), timings.get("prompt_ms")
        if isinstance(prompt_n, int) and isinstance(prompt_ms, int | float):
            cache_n = timings.get("cache_n")
            cached = cache_n if isinstance(cache_n, int) else None
            self.rates.observe(served_by, cached, prompt_n, float(prompt_ms))

    def slot_action(self, event: SlotActionEvent) -> None:
        for listener in self.listeners:
            try:
                listener.on_slot_action(event)
            except Exception:
                log.exception("slot-action listener %r failed", listener)

    def count(self, what: Count, n: int = 1) -> None:
        for listener in self.listeners:
            try:
                listener.on_count(what, n)
            except Exception:
                log.exception("count listener %r failed", listener)
