"""Which slot a request goes to: the pool's choice, on plain data (no waiting, no I/O).

As the server's own choice by longest common prefix would, a conversation goes to the slot
that holds most of what the server will reuse for it; and a slot that holds only what the
conversation shares with another (a common opening) is no conversation's "home" to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from kvproxy.keys import shared_chain


class Held(Protocol):
    @property
    def chain(self) -> list[str]: ...


class Slot(Protocol):
    """What the choice reads of a slot (cache/servers/slots.py's Slot), and nothing it could
    change."""

    @property
    def holding(self) -> Held | None: ...
    @property
    def saved(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    @property
    def finishing(self) -> bool: ...
    @property
    def serving(self) -> list[str] | None: ...
    @property
    def prefetching(self) -> bool: ...
    @property
    def last_used(self) -> float: ...
    def shared_depth(self, keys: Sequence[str], namespace: str) -> int: ...


S = TypeVar("S", bound=Slot)

# How deep a slot serves a conversation: the boundaries the server will reuse of what it holds.
Serves = Callable[[S], int]


def _whole(slot: Slot, depth: int) -> bool:
    """The request goes on from everything the slot holds (nothing of it is replaced)."""
    return slot.holding is not None and depth >= len(slot.holding.chain)


def _pushes_out(slot: Slot, depth: int, n_keys: int) -> bool:
    """Taking the slot would replace another conversation's unsaved state (saved first) for
    a request whose own history past the part they share (an opening) is not there: it
    comes from disk or is prefilled wherever the request goes."""
    held = slot.holding
    return (
        held is not None and not slot.saved and depth < len(held.chain) - 1 and n_keys - depth >= 2
    )


def choose(
    idle: Sequence[S],
    keys: list[str],
    namespace: str,
    serves: Serves[S] | None = None,
    awaited: Callable[[S], bool] | None = None,
) -> tuple[S, int]:
    """An idle slot for a conversation, and how deep it already holds it.

    A slot holding a conversation that waits for a tool's result (`awaited`: its client comes
    back within seconds, toolloops.py) goes to another conversation only when no other slot
    is idle, even one whose state must be saved first: that save is on this request's path,
    where the tool loop's would be a restore on its own, seconds later. A returning
    conversation whose slot now holds another session (of the same opening) does not push
    that session out while a slot costs no save: it restores its own state there. Otherwise
    the slot holding the longest prefix the server will reuse wins (`serves`: how deep a slot
    serves the request, by the model class; the shared keys when not given); among equals,
    one the request goes on from whole, then one on disk. With no prefix served anywhere, the
    least recently used slot, empty ones first, then ones on disk.
    """
    depth_of = serves or (lambda s: s.shared_depth(keys, namespace))
    kept = awaited or (lambda _s: False)
    depths = [depth_of(s) for s in idle]
    best = max(
        range(len(idle)),
        key=lambda i: (
            not (kept(idle[i]) and not _whole(idle[i], depths[i])),
            not _pushes_out(idle[i], depths[i], len(keys)),
            depths[i],
            _whole(idle[i], depths[i]),
            idle[i].saved,
        ),
    )
    if depths[best] > 0:
        return idle[best], depths[best]
    return min(idle, key=lambda s: (kept(s), s.holding is not None, not s.saved, s.last_used)), 0


def finishing_best(
    slots: Sequence[S], keys: list[str], namespace: str, serves: Serves[S] | None = None
) -> S | None:
    """A slot busy only with kvproxy's own work after its reply (`Slot.finishing`) that
    serves the request deeper than every idle slot: the server alone would find it idle and
    choose it, so the request waits for it (moments) rather than prefill elsewhere."""
    depth_of = serves or (lambda s: s.shared_depth(keys, namespace))
    finishing = [s for s in slots if s.busy and s.finishing]
    if not finishing:
        return None
    best = max(finishing, key=depth_of)
    depth = depth_of(best)
    if depth > 0 and all(depth_of(s) < depth for s in slots if not s.busy):
        return best
    return None


def home_of(slots: Sequence[S], keys: list[str], namespace: str) -> S | None:
    """The slot holding this very conversation, idle or busy: the request goes on from
    everything it holds (or all but a last message it rewrites), or it is busy with the
    conversation's previous request. A slot holding only what the request shares with
    another conversation (a common opening) is not its home: its content is another's."""
    best: S | None = None
    best_depth = 0
    for slot in slots:
        depth = slot.shared_depth(keys, namespace)
        if (
            slot.prefetching
            and slot.serving is not None
            and shared_chain(slot.serving, keys) == len(slot.serving) > best_depth
        ):
            # Taken to restore this conversation before it comes back
            # (cache/scheduling/prefetch.py).
            best, best_depth = slot, len(slot.serving)
            continue
        if depth <= best_depth or slot.holding is None:
            continue
        if slot.serving is not None:
            ours = shared_chain(slot.serving, keys) == len(slot.serving)
        else:
            ours = depth >= len(slot.holding.chain) - 1
        if ours:
            best, best_depth = slot, depth
    return best
