"""One conversation, one state on disk: which older states of a conversation a newly committed
state makes redundant. Plain data, no I/O (the store removes them: Store.supersede_async).

Every turn's save is a whole state: kept all, a conversation of five turns is five files, at
128 KiB a token gigabytes a turn. Which of the older ones a newer one (its chain extends
theirs) can stand for depends on what the server reuses of a restored state
(cache/decisions/policy.py's rules, from DESIGN.md's measurements):

- "prefix" (dense, full attention): a restored state serves any prefix of itself, so the
  newest serves every branch an older one would: only the newest is kept.
- "window" (sliding window) and "extension" (recurrent, hybrid): a restored state serves
  only a request that parts near its end, or extends it exactly. A branch from the previous
  turn (a regenerated reply, an edited last message) is served only by that turn's own
  state: the newest and one back are kept, the older ones go. A model of unknown class is
  treated so too.

Only conversations' turns are superseded: openings and stems (shared starts other sessions
restore) and entries of no recorded kind (saved before kvproxy kinded them) stay, left to
the TTL and the byte budget. So does a state this server refused or did not reuse: it was
saved under other settings (another KV layout, flash attention), kept for when the server
runs that way again (refused.py), and a newer state of this server's layout stands for
nothing of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvproxy.cache.decisions.policy import RestoreRule


@dataclass(frozen=True)
class Older:
    """A stored state of the same namespace whose chain the new state's chain extends."""

    key: str
    depth: int  # boundaries it holds (len(chain))
    turn: bool  # a conversation's turn (else a shared start, or of no known kind: kept)
    set_aside: bool = False  # this server refused it or did not reuse it: another layout's


def kept_back(rule: RestoreRule | None) -> int:
    """How many older turns a new state leaves on disk (None: the model's class is not known)."""
    return 0 if rule == "prefix" else 1


def superseded(rule: RestoreRule | None, older: Sequence[Older]) -> list[str]:
    """The keys of `older` that the new state makes redundant, by the model class's rule."""
    mine = (o for o in older if o.turn and not o.set_aside)
    turns = sorted(mine, key=lambda o: o.depth, reverse=True)
    return [o.key for o in turns[kept_back(rule) :]]
