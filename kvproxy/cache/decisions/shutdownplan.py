"""What a shutdown saves in the time it has, on plain data (no I/O, no clock; lanes/shutdown.py
runs it).

At SIGTERM kvproxy has the rest of `--shutdown-timeout` (systemd's patience) to save what
would be lost; at an 8B model's 128 KiB a token, four 8k-token slots are 4 GiB, seconds to
tens of seconds of disk. Most of it is saved before: an idle slot's state is checkpointed
`--idle-save-after` after its last use (cache/scheduling/background_saves.py). What is left is
planned rather than tried until the deadline cuts a save off (the server keeps writing a save
kvproxy stopped waiting for, and the index never learns of it):

- each slot's save takes its state's bytes over the write speed measured on its server
  (cache/servers/pace.py; before any save there an assumed 150 MB/s);
- the most valuable first: most tokens per second of save (the prefill a save spares, for the
  disk time it takes), then the most recently used;
- a save that does not fit in the time left is not started, and one after it that fits still
  is; a save whose time is not known (no save or restore measured a token's bytes, and the
  model's metadata did not tell) goes last, while time is left;
- every slot not saved is named in the log, with why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """A slot whose state would be lost."""

    slot: int
    tokens: int
    seconds: float | None  # what its save will take (None: not known)
    last_used: float  # when a request last used it (any clock, the same for all)


@dataclass(frozen=True)
class ShutdownPlan:
    save: tuple[int, ...]  # slots, in the order to save them
    # Slots that do not fit, and what each would take (None: not known, and no time left).
    skip: tuple[tuple[int, float | None], ...]


def plan_shutdown(candidates: list[Candidate], budget_s: float) -> ShutdownPlan:
    def worth(c: Candidate) -> tuple[float, float]:
        seconds = c.seconds if c.seconds is not None else 0.0
        density = c.tokens / seconds if seconds > 0 else float("inf")
        return density, c.last_used

    known = sorted((c for c in candidates if c.seconds is not None), key=worth, reverse=True)
    unknown = sorted((c for c in candidates if c.seconds is None), key=lambda c: -c.last_used)
    save: list[int] = []
    skip: list[tuple[int, float | None]] = []
    left = budget_s
    for c in known:
        assert c.seconds is not None
        if c.seconds <= left:
            save.append(c.slot)
            left -= c.seconds
        else:
            skip.append((c.slot, c.seconds))
    if left > 0:
        save.extend(c.slot for c in unknown)
    else:
        skip.extend((c.slot, None) for c in unknown)
    return ShutdownPlan(tuple(save), tuple(skip))
