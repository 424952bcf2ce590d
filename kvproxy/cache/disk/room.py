"""Room under --max-disk for a save, decided on plain data before the server writes it.

A save is whole-state: at 128 KiB a token a turn is gigabytes, written while every older
state is still on disk (the ones it will supersede go only once it is committed). So room is
made first, for its estimated size plus the states written but still committing (not yet in
the index's totals): the budget holds while the write runs. A state bigger than the whole
budget is not written at all. With no budget, or no estimate yet (no save or restore seen
and no KV geometry in the model's metadata), the save goes as before and the eviction after
its commit keeps the budget.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Room:
    write: bool  # ask the server for the save
    incoming: int  # bytes to make room for first (0: no eviction before it)


def room_for(budget: int, estimate: int | None, in_flight: int) -> Room:
    """`budget`: --max-disk (0: none); `estimate`: the state's bytes (None: not known);
    `in_flight`: estimated bytes of states written whose commits are under way."""
    if budget <= 0 or estimate is None:
        return Room(True, 0)
    if estimate > budget:
        return Room(False, 0)
    return Room(True, estimate + max(in_flight, 0))
