"""Faults of work nobody waits for: background tasks, housekeeping, habits written out.

A full disk or a read-only cache dir makes the same operation fail on every request; each
failure logged would flood the log (one traceback per request). So every such failure is
reported here under a kind (the operation's name): the first failure of a kind logs one
warning line, the next success of that kind logs one line that it recovered, and nothing in
between. `kvproxy_background_failing{kind}` shows the kinds failing now and
`kvproxy_background_errors_total{kind}` counts every failure; `/kvproxy/stats` lists them, and
`/health` (the server's answer otherwise) names the kinds failing in `X-KVProxy-Faults`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("kvproxy.cache")

SAVING = "saving slots"  # the kind of saves the server or the disk refuses (slotio.py)


@dataclass
class FaultState:
    failing: bool = False
    errors: int = 0
    since: float = 0.0  # when the current fault started (time.time)
    last: str = ""  # the latest error, one line


class Faults:
    def __init__(self) -> None:
        self.kinds: dict[str, FaultState] = {}

    def failed(self, kind: str, exc: BaseException) -> None:
        state = self.kinds.setdefault(kind, FaultState())
        state.errors += 1
        state.last = f"{type(exc).__name__}: {exc}"
        if not state.failing:
            state.failing, state.since = True, time.time()
            log.warning(
                "%s failing: %s (logged again only when it recovers)",
                kind,
                state.last,
                exc_info=exc if log.isEnabledFor(logging.DEBUG) else None,
            )
        else:
            log.debug("%s failing again: %s", kind, state.last)

    def succeeded(self, kind: str) -> None:
        state = self.kinds.get(kind)
        if state is not None and state.failing:
            state.failing = False
            log.warning(
                "%s recovered after %.0f s (%d errors in all)",
                kind,
                time.time() - state.since,
                state.errors,
            )

    def failing(self) -> dict[str, str]:
        """The kinds failing now, each with its latest error."""
        return {kind: s.last for kind, s in self.kinds.items() if s.failing}

    def summary(self) -> dict[str, tuple[bool, int]]:
        """kind -> (failing now, errors so far)."""
        return {kind: (s.failing, s.errors) for kind, s in self.kinds.items()}
