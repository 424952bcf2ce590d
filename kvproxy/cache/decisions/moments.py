"""When a save may start on a server: in a moment when it pauses nobody — decisions on plain
data (no I/O, no clock; cache/scheduling/savegate.py, cache/scheduling/background_saves.py and
cache/scheduling/prefetch.py wait for them).

llama-server runs a slot save on the one loop every slot shares: while a state is written
(0.6 s at 2k tokens of an 8B model's KV, ~5 s at 16k on a slow disk) every other slot's token
stream stops, and a request that comes meanwhile waits for the write before its prefill
starts. The canonical prefix's evaluation before a save (cache/canonical/) is server work too,
and goes in the same moment. So:

- **One save at a time** on a server.
- A save is **small** when it is expected to take no longer than one token of the server's
  generation (its bytes over the write speed measured on this server, and the median gap
  between generated tokens of its recent replies: cache/servers/pace.py): it pauses a stream by
  at most about one token, and goes at any time.
- A **big** save goes in an **idle moment**: no other slot of the server generating,
  prefilling or restoring.
- A save a request **needs** (the slot's content would otherwise be lost) waits for such a
  moment at most `max_wait` seconds, then goes anyway: a long stream elsewhere does not hold
  the request up for good.
- An **optional** save (under slot pressure, the idle checkpoint, a prefetch's) never starts
  while a request could come for the server soon: one queued for a slot, one running, or the
  result of a tool call the server just answered (toolloops.py) — a request that comes during
  the write waits for it on the server's loop. Once such a save has been due for `max_wait`
  (the idle checkpoint a shutdown relies on) it no longer waits for expected tool results,
  but it still never pauses a stream.
- `max_wait` 0: saves go at once (still one at a time).
"""

from __future__ import annotations

from dataclasses import dataclass

# A save's length that counts as small when the server's token gap is not measured yet.
SMALL_SAVE_S = 0.02


@dataclass(frozen=True)
class ServerNow:
    """The server, as a save about to start on one of its slots sees it."""

    working: int = 0  # other slots busy with a request (its prefill, its stream, its restore)
    waiting: int = 0  # requests queued for a slot
    saving: bool = False  # a save (or a prefetch's restore) under way on the server
    tool_wait: float = 0.0  # seconds a tool call's result may still come in (0: none due)


@dataclass(frozen=True)
class Moment:
    """Whether a save may start now; when not, `retry_in` seconds is when the answer may turn
    (None: only when something changes on the server: a slot freed, a save ended)."""

    go: bool
    retry_in: float | None = None
    why: str = ""


GO = Moment(True)


def small(save_s: float | None, token_gap_s: float | None) -> bool:
    """A save expected to pause a stream by no more than one of its tokens."""
    return save_s is not None and save_s <= (token_gap_s or SMALL_SAVE_S)


def may_start(
    now: ServerNow,
    *,
    save_s: float | None,
    token_gap_s: float | None,
    optional: bool,
    waited: float,
    max_wait: float,
) -> Moment:
    """May a save (expected to take `save_s` seconds; None: not known, so big) start now?
    `waited`: seconds since it became due (a request needed it, or its background save came
    due)."""
    if now.saving:
        return Moment(False, None, "another save is under way on the server")
    if max_wait <= 0:
        return GO
    if small(save_s, token_gap_s):
        return GO if not (optional and now.waiting) else Moment(False, None, "a request waits")
    overdue = waited >= max_wait
    if not optional:
        if now.working and not overdue:
            return Moment(False, max_wait - waited, "another slot is generating")
        return GO
    if now.waiting:
        return Moment(False, None, "a request waits for a slot")
    if now.working:
        return Moment(False, None, "another slot is generating")
    if now.tool_wait > 0 and not overdue:
        return Moment(False, min(now.tool_wait, max_wait - waited), "a tool result is due")
    return GO
