"""What each namespace's client does to a conversation between turns: how it echoes the
reply (canonical.EchoStyles) and what it rewrites before it (rewrites.Rewrites). Learnt from
the request that continues a conversation kvproxy recorded, applied when a slot is saved, so
the saved state is the prefix the client's next request really starts with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproxy.cache.canonical.prefix import EchoStyles
from kvproxy.cache.habits.rewrites import Rewrites, rewrite

# Agents rewrite the messages of their last turn (a reminder, a per-turn context message):
# a request that parts from a recorded conversation further back is a branch, not a rewrite.
NEAR_END = 3


@dataclass
class Habits:
    echo: EchoStyles = field(default_factory=EchoStyles)
    rewrites: Rewrites = field(default_factory=Rewrites)

    def learn(
        self, namespace: str, ours: Sequence[Any], theirs: Sequence[Any], shared: int
    ) -> bool:
        """Learn from `theirs`, the request after `ours` (the recorded conversation, its reply
        last), whose key chains share `shared` messages. True when it showed a rewrite."""
        n = len(ours)
        if shared >= n:
            self.echo.learn(namespace, ours, theirs)
            return False
        if not worth_comparing(n, len(theirs), shared):
            return False
        return self.rewrites.learn(namespace, ours, theirs, shared) is not None

    @property
    def changes(self) -> int:
        """Grows whenever something was learnt: the cue to write them out (store/dirfiles.py)."""
        return self.echo.changes + self.rewrites.changes

    def to_json(self) -> dict[str, Any]:
        return {"version": 1, "echo": self.echo.to_json(), "rewrites": self.rewrites.to_json()}

    def load(self, data: Any) -> None:
        """What `to_json` wrote, from an earlier run (anything else is skipped)."""
        if isinstance(data, dict) and data.get("version") == 1:
            self.echo.load(data.get("echo"))
            self.rewrites.load(data.get("rewrites"))

    def next_messages(self, namespace: str, messages: Sequence[Any]) -> list[Any]:
        """The conversation as its client will send it in its next request."""
        rules = self.rewrites.get(namespace)
        return rewrite(rules, messages) if rules else list(messages)


def worth_comparing(n_ours: int, n_theirs: int, shared: int) -> bool:
    """Could the request show a rewrite of the recorded conversation? (Cheap: no text read.)"""
    return 0 < shared < n_ours - 1 and shared >= n_ours - 1 - NEAR_END and n_theirs >= n_ours
