"""When to save an idle slot in the background, so that a request needing the slot later finds
its eviction free: decisions on plain data (no I/O, no clock;
cache/scheduling/background_saves.py runs the saves).

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
- **In a moment when it pauses nobody** (moments.py): one save at a time on the server, and
  a big one only while no other slot generates, prefills or restores, no request waits for a
  slot, and no tool call's result is due (the result's request would wait for the write on
  the server's loop). A save held back goes when that moment comes: a slot freed looks
  again, and a timer when a tool result stops being due. A slot whose conversation waits for
  a tool's result is not saved in the background: it comes back to it within seconds
  (toolloops.py). Before each of its steps on the server (the canonical prefix's evaluation,
  the state write) a save under way looks again and gives way (`gives_way`), unless it has
  been due for `max_wait`: an idle checkpoint, which a shutdown relies on, then still waits
  for streams but no longer for expected tool results. (Measured before these rules with
  `kvproxy bench stalls`, two slots, one streaming: a save sent during the stream paused it
  for the whole write.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvproxy.cache.decisions.moments import Moment, ServerNow, may_start

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
    awaited: bool = False  # its conversation waits for a tool's result (toolloops.py)
    save_s: float | None = None  # what its save will take (cache/servers/pace.py; None: not known)


@dataclass(frozen=True)
class ServerView:
    """The server beside its slots: what moments.py reads besides them."""

    waiting: int = 0  # requests queued for a slot
    saving: bool = False  # a save under way on it (a request's, or a prefetch)
    tool_wait: float = 0.0  # seconds a tool call's result may still come in
    token_gap_s: float | None = None  # a generated token's time (cache/servers/pace.py)


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
    server: ServerView | None = None,
) -> SaveDecision:
    """The slot to save now in the background: least recently used first among the idle
    slots worth a save whose conversation waits for no tool result, every one of them under
    pressure (more live conversations than slots), otherwise only those idle for
    `idle_save_after`; none while a request waits. It starts in a moment when it pauses
    nobody (moments.py); until then the decision says when to look again (or nothing: a slot
    freed or a save ended looks again)."""
    if waiting > 0:
        return SaveDecision()
    pressure = live > len(slots)
    due = [
        s
        for s in slots
        if not s.busy
        and s.worth
        and not s.awaited
        and due_for(s, pressure=pressure, idle_save_after=idle_save_after) >= 0
    ]
    if not due:
        return SaveDecision()
    first = max(due, key=lambda s: s.idle_for)
    moment = _moment(slots, first, idle_save_after, max_wait, server, waiting)
    if moment.go:
        return SaveDecision(slot=first.id)
    return SaveDecision(retry_in=moment.retry_in)


def _moment(
    slots: Sequence[IdleView],
    mine: IdleView,
    idle_save_after: float,
    max_wait: float,
    server: ServerView | None,
    waiting: int,
) -> Moment:
    server = server or ServerView(waiting=waiting)
    now = ServerNow(
        working=sum(s.serving for s in slots if s.id != mine.id),
        waiting=max(waiting, server.waiting),
        saving=server.saving,
        tool_wait=server.tool_wait,
    )
    return may_start(
        now,
        save_s=mine.save_s,
        token_gap_s=server.token_gap_s,
        optional=True,
        # Overdue is the idle checkpoint's: a save under pressure only spares a later
        # request its save, and waits as long as a tool result is due.
        waited=due_for(mine, pressure=False, idle_save_after=idle_save_after),
        max_wait=max_wait,
    )


def gives_way(
    slots: Sequence[IdleView],
    saving: int,
    *,
    idle_save_after: float,
    max_wait: float,
    server: ServerView | None = None,
) -> bool:
    """Before the next step of the background save of slot `saving`: stop it (it is done
    later) when it may not start now (moments.py): another slot's request started, a request
    waits for a slot, a tool result came due."""
    mine = next((s for s in slots if s.id == saving), None)
    if mine is None:
        return False
    return not _moment(slots, mine, idle_save_after, max_wait, server, 0).go


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
