"""What `Preparer.prepare` did for a request before it was forwarded (its X-KVProxy-*
headers), and the check that lets a resident next turn skip the index."""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.servers.slots import Slot
from kvproxy.wire import Conversation

# A turn adds a user message, or a user message and a context message (OpenClaw), or tool
# results: a request adding more than this to what its slot holds is looked up on disk too.
NEW_MESSAGES_A_TURN = 4


@dataclass(frozen=True)
class Prepared:
    """What `prepare` did for a request, before it was forwarded."""

    decision: Decision
    restored_tokens: int = 0
    restore_ms: float = 0.0
    expected_n: int | None = None  # tokens the decision expects the server to reuse
    # Tokens kvproxy had the server evaluate for the request before forwarding it (an
    # opening to save on the way): the reply's cache_n counts them, prefilled meanwhile.
    evaluated: int = 0
    # The entry restored: (its key, saved before the server's current start) for the guard.
    restored_from: tuple[str, bool] | None = None

    def headers(self) -> dict[str, str]:
        out = {"X-KVProxy-Cache": self.decision.value}
        if self.decision is Decision.RESTORED:
            out["X-KVProxy-Restored-Tokens"] = str(self.restored_tokens)
            out["X-KVProxy-Restore-Ms"] = f"{self.restore_ms:.1f}"
        if self.evaluated:
            out["X-KVProxy-Evaluated-Tokens"] = str(self.evaluated)
        return out


MISS = Prepared(Decision.MISS)


def next_turn_of(slot: Slot, conv: Conversation, resident: int) -> bool:
    """Does the request extend everything the slot holds, a conversation up to a reply, by
    a turn's few new messages? (An opening the slot holds is no turn: a new session may
    share more with a stored conversation than with it.)"""
    held = slot.holding
    if held is None or resident != len(held.chain) or not held.messages:
        return False
    last = held.messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return False
    return 0 < len(conv.keys) - resident <= NEW_MESSAGES_A_TURN
