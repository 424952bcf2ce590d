"""When to save an idle slot in the background, so that a request needing the slot later finds
its eviction free: decisions on plain data (no I/O, no clock; cache.py runs the saves).

Without this, a slot is saved when a request needs it for another conversation: the
canonical prefix (templates, tokenisation, an evaluation on the slot), the server's save,
fsync, rename and index write all run before that request is forwarded. Measured on the
bundled model, 1,400-token conversations (2 cores, load 8-11, `kvproxy bench workload`,
2026-12-01): the canonical prefix took 250-950 ms, and as long as the other slot's whole
prefill when one ran meanwhile (the server evaluates it in its next batch); the server's save
of the 12 MB state 50-300 ms (10-20 ms for 21 MB on a quiet machine). Agents come
back within 0.5-3 s (tool loops), so the 30-second idle save never ran first, while such a
save fits well inside an agent's gap, and back to back the next request takes the other,
least recently used slot, so the save overlaps it instead of preceding it.

The policy:

- **Pressure** is more live conversations than slots. A conversation is live when a request
  of it came within `live_window` (default 10 minutes: agents and people at a keyboard come
  back well within it; beyond it, the 30-second idle save has long run anyway). One
  conversation is one chain of requests: a request whose keys contain an earlier request's
  last key continues it (`LiveConversations`). Under pressure some slot will be handed to
  another conversation soon, and every idle slot's content would then be saved on a request's
  path. After a restart, the entries on disk used within the window count as live too, so the
  first evictions after it are free as well.
- **Under pressure**, an idle slot whose content is not on disk (or whose disk copy is behind:
  a turn since the last save) and is worth a file (`policy.worth_saving`) is saved at once,
  least recently used first (it is the one `SlotPool.choose` hands out next), one save at a
  time: saves share the disk and the server's one compute loop with the requests on other
  slots, and one at a time bounds what they take from them. (The server runs slot actions on
  that loop: a restore asked for during another slot's save waits for it. Measured back to
  back, such restores took 440-580 ms against 10-27 ms with an agent's gaps between.)
- **Without pressure** nothing is saved early: every live conversation keeps its slot, so an
  early save would be I/O for nothing. The idle save after `idle_save_after` still applies.
- **Never while a request waits for a slot**: a save would hold the slot that request is about
  to get. A waiting request takes the slot and saves what it must itself, which costs it the
  same as waiting for the save.
- A request for the slot being saved waits only for that save (`SlotPool.acquire` waits for
  the slot holding its conversation); the slot keeps its conversation, so the request is then
  resident. Background saves do not make a slot look recently used, so LRU stays LRU.
- **Not while another slot serves a request, unless urgent**, for at most `max_wait` seconds
  after the save became due: the server runs a save on its one loop, so every step of it (the
  canonical prefix's evaluation, the state write) pauses the other slots' token streams and
  delays their prefills and restores. A save is urgent when no other idle slot could take a
  new conversation without a save (empty, on disk, or not worth a file): the next request
  would then save this slot on its own path, which pauses the streams just as long and makes
  that request wait too (measured with `kvproxy bench stalls`: two slots, one streaming,
  turn 2 of the others 2.7 s against 1.4 s). A held-back save goes once those requests end,
  or when `max_wait` is up, so it is never put off for good. A save under way gives way the
  same way before each of its steps (`gives_way`). What a request itself must restore or save
  cannot wait and is not held back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# Distinct conversations remembered at most: a client minting a new conversation per request
# must not grow memory without bound (beyond it the oldest are dropped).
MAX_TRACKED = 4096


@dataclass(frozen=True)
class IdleView:
    """One slot, as the background-save decision sees it."""

    id: int
    busy: bool
    worth: bool  # its content would be lost and is worth a file (policy.worth_saving)
    idle_for: float  # seconds since a request last used it
    serving: bool = False  # busy with a request (its prefill, stream, restore), not a save


@dataclass(frozen=True)
class SaveDecision:
    """What background saves do now: save `slot`, or (`retry_in`) look again that much later,
    when a due save was held back, or nothing (both None)."""

    slot: int | None = None
    retry_in: float | None = None


def due_for(view: IdleView, *, pressure: bool, idle_save_after: float) -> float:
    """Seconds since the slot's save became due (negative: not due yet): under pressure from
    the moment it went idle, otherwise once it has been idle for `idle_save_after`."""
    return view.idle_for if pressure else view.idle_for - idle_save_after


def next_background_save(
    slots: Sequence[IdleView],
    *,
    live: int,
    waiting: int,
    idle_save_after: float,
    max_wait: float = 0.0,
) -> SaveDecision:
    """The slot to save now in the background: least recently used first among the idle
    slots worth a save, every one of them under pressure (more live conversations than
    slots), otherwise only those idle for `idle_save_after`; none while a request waits. While
    another slot serves a request, and another idle slot is free for a new conversation, the
    save is held back until it has been due `max_wait`."""
    if waiting > 0:
        return SaveDecision()
    pressure = live > len(slots)
    due = [
        s
        for s in slots
        if not s.busy
        and s.worth
        and due_for(s, pressure=pressure, idle_save_after=idle_save_after) >= 0
    ]
    if not due:
        return SaveDecision()
    first = max(due, key=lambda s: s.idle_for)
    left = max_wait - due_for(first, pressure=pressure, idle_save_after=idle_save_after)
    if left > 0 and _may_wait(slots, first.id):
        return SaveDecision(retry_in=left)
    return SaveDecision(slot=first.id)


def _may_wait(slots: Sequence[IdleView], saving: int) -> bool:
    """Another slot serves a request, and another idle slot could take a new conversation
    without a save (so this one is not needed next)."""
    others = [s for s in slots if s.id != saving]
    return any(s.serving for s in others) and any(not s.busy and not s.worth for s in others)


def gives_way(
    slots: Sequence[IdleView],
    saving: int,
    *,
    live: int,
    idle_save_after: float,
    max_wait: float,
) -> bool:
    """Before the next step of the background save of slot `saving`: stop it (it is done
    later) when another slot started serving a request meanwhile, unless it is urgent or
    overdue."""
    mine = next((s for s in slots if s.id == saving), None)
    if mine is None:
        return False
    waited = due_for(mine, pressure=live > len(slots), idle_save_after=idle_save_after)
    return waited < max_wait and _may_wait(slots, saving)


@dataclass
class LiveConversations:
    """Conversations seen within `window` seconds, each counted once however many turns it
    had: a request continues an earlier one when its keys contain that request's last key."""

    window: float
    limit: int = MAX_TRACKED
    # Last key of each conversation's latest request → when it came. Insertion order is time
    # order: a conversation seen again is moved to the end.
    _heads: dict[str, float] = field(default_factory=dict)

    def seen(self, keys: Sequence[str], now: float) -> bool:
        """Record a request; True when it is a conversation not live before."""
        continued = False
        for key in keys:
            if self._heads.pop(key, None) is not None:
                continued = True
        self._heads[keys[-1]] = now
        self._expire(now)
        while len(self._heads) > self.limit:
            del self._heads[next(iter(self._heads))]
        return not continued

    def recall(self, heads: Sequence[tuple[str, float]], now: float) -> None:
        """Conversations known from before a restart (`(last key, when last used)`, on this
        clock): a restart does not end the pressure of the conversations that come back."""
        merged = [*self._heads.items(), *((k, t) for k, t in heads if t >= now - self.window)]
        merged.sort(key=lambda item: item[1])
        self._heads = dict(merged[-self.limit :])

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._heads)

    def _expire(self, now: float) -> None:
        cutoff = now - self.window
        while self._heads:
            oldest = next(iter(self._heads))
            if self._heads[oldest] >= cutoff:
                return
            del self._heads[oldest]
