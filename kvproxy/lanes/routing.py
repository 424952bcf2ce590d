"""Which server a request goes to, when kvproxy has several: decided on plain data.

The rule, in order:
1. A server that holds the conversation in an idle slot (the longest prefix of it, of the
   request's namespace) gets it: nothing to restore, nothing to prefill.
2. Else a server whose busy slot holds it unsaved (an agent's next turn sent while its last
   reply's bookkeeping still runs): nowhere else could serve it without prefilling it all
   again, so it waits for that slot (as one server's pool does).
3. Else a server with an idle slot, the one with the fewest requests waiting, then the most
   empty slots (nothing resident is pushed out while a slot holds nothing), then the most
   idle ones: the state comes back from disk there (every server restores from the shared
   cache dir), so no request waits on a busy server while another could serve it now.
4. Else a server with a slot busy only with a background save that no waiting request is
   already owed: the save ends within a fraction of a second, where a request queued behind a
   busy server waits for a whole reply while that slot frees (fewest waiting first).
5. Else (every slot busy with requests everywhere) the server with the fewest waiting per slot.
A server out of rotation (down, or not pinning slots) gets nothing while another is in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LaneView:
    in_rotation: bool  # answered its last look and pins slots
    resident_idle: int  # boundaries of the request an idle slot there holds (0: none)
    resident_busy: int  # the same for a busy slot whose conversation is not on disk
    idle_slots: int
    waiting: int  # requests waiting there for a slot
    slots: int
    empty_slots: int  # idle slots holding no conversation
    saving_slots: int = 0  # slots busy only with a background save


def choose_lane(views: Sequence[LaneView]) -> int:
    """The index of the server for a keyed request (views in the lanes' order)."""
    candidates = [i for i, v in enumerate(views) if v.in_rotation] or list(range(len(views)))
    resident = max(candidates, key=lambda i: views[i].resident_idle)
    if views[resident].resident_idle > 0:
        return resident
    held = max(candidates, key=lambda i: views[i].resident_busy)
    if views[held].resident_busy > 0:
        return held
    idle = [i for i in candidates if views[i].idle_slots > 0]
    if idle:
        return min(
            idle,
            key=lambda i: (views[i].waiting, -views[i].empty_slots, -views[i].idle_slots, i),
        )
    saving = [i for i in candidates if views[i].saving_slots > views[i].waiting]
    if saving:
        return min(saving, key=lambda i: (views[i].waiting, -views[i].saving_slots, i))
    return min(candidates, key=lambda i: (views[i].waiting / max(1, views[i].slots), i))


def least_loaded(views: Sequence[LaneView]) -> int:
    """The server for a request the cache does not key (no conversation to follow)."""
    candidates = [i for i, v in enumerate(views) if v.in_rotation] or list(range(len(views)))
    return min(
        candidates,
        key=lambda i: (
            views[i].waiting / max(1, views[i].slots),
            -views[i].empty_slots,
            -views[i].idle_slots,
            i,
        ),
    )


def model_candidates(running: Sequence[bool], room: Sequence[bool]) -> list[int]:
    """Of one model's lanes on several routers (`--servers N --models-dir`), the indexes the
    rules above choose among: the routers running the model (nothing is loaded or unloaded
    for the request), else those that can load it without unloading another model (no
    conversation of that one is pushed to disk), else every router."""
    for chosen in (running, room):
        picked = [i for i, yes in enumerate(chosen) if yes]
        if picked:
            return picked
    return list(range(len(running)))
