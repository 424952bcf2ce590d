"""Conversations waiting for a tool's result: their last reply ended in a tool call, so the
client runs the tool and comes back within seconds with its result — on plain data (the clock
is the caller's).

An agent's loop is mostly such turns. What its slot holds is worth more than any other
slot's for those seconds: a newcomer takes another slot (slotchoice.py), even one whose state
must be saved first; no optional save starts on the server meanwhile (moments.py: the result's
request would wait for the write); and when the conversation had to leave its slot after all,
its state is restored into the next slot that frees before the result comes
(cache/scheduling/prefetch.py). A conversation stops waiting when a request carrying its reply
comes, or after `window` seconds (a long-running tool, a person approving the call): it is then
like any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvproxy.keys import shared_chain

# How long a tool call's result is expected: agents come back within 0.5-3 s (file reads,
# searches, edits); a test run or a build can take minutes, and is then treated as any idle
# conversation. At most the idle save's delay (`window_for`), so the idle checkpoint of a
# conversation waiting that long is never held back by the wait.
TOOL_RESULT_WINDOW = 30.0
# Conversations remembered at most (a client making a tool call per new conversation must not
# grow memory without bound: the oldest are dropped).
MAX_WAITING = 256


def window_for(idle_save_after: float) -> float:
    return min(TOOL_RESULT_WINDOW, idle_save_after) if idle_save_after > 0 else TOOL_RESULT_WINDOW


@dataclass(frozen=True)
class Awaited:
    """A conversation whose reply ended in a tool call: its keys up to that reply."""

    namespace: str
    chain: tuple[str, ...]
    since: float

    @property
    def key(self) -> str:
        return self.chain[-1]

    def held_by(self, chain: Sequence[str] | None, namespace: str | None) -> bool:
        """Is this conversation's state, whole, what `chain` (a slot's) holds?"""
        return (
            chain is not None
            and namespace == self.namespace
            and len(chain) == len(self.chain)
            and shared_chain(list(chain), list(self.chain)) == len(self.chain)
        )


@dataclass
class ToolLoops:
    window: float = TOOL_RESULT_WINDOW
    limit: int = MAX_WAITING
    # Last key of each waiting conversation → it; insertion order is time order.
    _waiting: dict[str, Awaited] = field(default_factory=dict)

    def replied(self, namespace: str, chain: Sequence[str], now: float) -> None:
        """A reply ending in a tool call was recorded: `chain`, the conversation's keys and
        the reply's as the client will echo it."""
        if self.window <= 0 or not chain:
            return
        awaited = Awaited(namespace, tuple(chain), now)
        self._waiting.pop(awaited.key, None)
        self._waiting[awaited.key] = awaited
        while len(self._waiting) > self.limit:
            del self._waiting[next(iter(self._waiting))]

    def returned(self, keys: Sequence[str]) -> None:
        """A request came: the conversations whose reply it carries wait no more."""
        if self._waiting:
            for key in keys:
                self._waiting.pop(key, None)

    def waiting(self, now: float) -> list[Awaited]:
        """Those still expected, the newest first."""
        self._expire(now)
        return list(reversed(self._waiting.values()))

    def holds_awaited(self, chain: Sequence[str] | None, namespace: str | None, now: float) -> bool:
        """Does a slot holding `chain` hold a conversation waiting for a tool's result?"""
        if not chain or not self._waiting:
            return False
        self._expire(now)
        awaited = self._waiting.get(chain[-1])
        return awaited is not None and awaited.held_by(chain, namespace)

    def due_in(self, now: float, but: str | None = None) -> float:
        """Seconds a tool result may still come in (0: none expected); `but`: leaving out the
        conversation of that key."""
        self._expire(now)
        ends = [a.since + self.window - now for k, a in self._waiting.items() if k != but]
        return max(ends, default=0.0)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._waiting:
            oldest = next(iter(self._waiting.values()))
            if oldest.since >= cutoff:
                return
            del self._waiting[oldest.key]
