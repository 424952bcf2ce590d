"""When a request served from what its slot held is `resident`, on plain data.

`resident` means the slot held this request's own earlier state: for a chat, an earlier turn
of this same conversation (one of its replies is in what the slot held: the client echoes
each reply back), or this very request again; for a text completion or infill, an earlier
prompt this one extends or edits near its end (its last tenth, wire/prompts.py `NEAR_END`). A new
conversation that shares only an opening with what the slot held (its system prompt, a fixed
first message) is a `miss`, though the server reuses that opening: `timings.cache_n` shows
it. The one definition users read is in docs/clients.md ("Response headers").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproxy.wire.prompts import NEAR_END


def own_state(messages: Sequence[Any], shared: int, held_depth: int) -> bool:
    """Is what the slot held (`held_depth` boundaries, `shared` of them the request's) the
    request's own earlier state? A chat's by its messages (`own_turns`); a prompt's (no
    messages) when it goes on from all but the last tenth of it."""
    if messages:
        return own_turns(messages, shared, held_depth)
    return shared > 0 and held_depth - shared <= NEAR_END.of(held_depth)


def own_turns(messages: Sequence[Any], shared: int, held_depth: int) -> bool:
    """Are the first `shared` of a request's `messages`, which its slot held (`held_depth`
    messages in all), this conversation's own earlier state rather than an opening other
    conversations share? Yes when they hold one of its replies (an earlier turn, a branch
    from one), when they are the whole request (the same request again), or when the request
    goes on from everything the slot held and that reached a message of its own past the
    system prompt (a turn cut short before its reply)."""
    if shared <= 0:
        return False
    if shared >= len(messages) or any(_role(m) == "assistant" for m in messages[:shared]):
        return True
    return shared >= held_depth and any(_role(m) not in OPENING for m in messages[:shared])


# Roles that open conversations alike (the system prompt), not a conversation's own turns.
OPENING = frozenset({"system", "developer"})


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None
