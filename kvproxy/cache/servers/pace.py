"""How fast a server writes slot states and generates tokens, measured from its own saves,
restores and replies: what a save will cost (cache/decisions/moments.py: whether it is a big
one; the shutdown: what fits in its deadline) and a restore (cache/decisions/payoff.py: whether
it pays).

A save's time is its state's bytes over the write speed of this server's recent saves (the
state's bytes over the seconds its save took: from the save request to its commit, or, for
the saves kvproxy times whole, from the slot's check through its canonical prefix to the
commit); before any, an assumed 150 MB/s, as MLX servers assume on an unknown filesystem. A
state's bytes are its tokens times the bytes a token took in the server's last save or
restore, else the model's own KV geometry at f16 (server/modelinfo.py), else not known. The
read speed is the bytes of the server's recent restores of 16 MiB or more over the time
kvproxy waited for them (smaller ones measure mostly latency); before any, not known. The
token gap is the median time a generated token took in the server's recent replies of 16
tokens or more (`timings.predicted_ms / predicted_n`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvproxy.cache.reports.events import Events, SlotActionEvent

ASSUMED_WRITE_BYTES_PER_S = 150e6
# Saves averaged over (the newest): follows a disk that got busier or a page cache that filled.
WINDOW = 8
# Every save counts: a small one measures mostly latency, so the speed errs low, and so
# does a save's estimate then (a save is found big sooner, a shutdown plans fewer saves).
MIN_MEASURED_BYTES = 1
# Replies that generated fewer tokens tell little of the gap between them (the first token
# after a prefill can take several times as long as the next ones).
MIN_GAP_TOKENS = 16
# Restores that read less measure the round trip more than the disk (cache/decisions/payoff.py).
MIN_READ_BYTES = 16 << 20


@dataclass
class Pace:
    """One server's measured pace. `model_bytes_per_token`: the model's own estimate (0: none)."""

    model_bytes_per_token: Callable[[], int] = lambda: 0
    _writes: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    _per_token: float = 0.0
    _gaps: deque[float] = field(default_factory=lambda: deque(maxlen=2 * WINDOW))
    _saves: int = 0  # saves seen: a timed save measures its whole length when one came
    _reads: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """A save whose whole length counts toward the write speed: the canonical prefix's
        evaluation before the write, and the GET /slots before that, are what it costs too
        (the save's own event times the write and the commit only)."""
        began, saves = time.perf_counter(), self._saves
        try:
            yield
        finally:
            if self._saves == saves + 1 and self._writes:
                size, _ = self._writes[-1]
                self._writes[-1] = (size, time.perf_counter() - began)

    def acted(self, event: SlotActionEvent) -> None:
        """A save or restore on this server ended."""
        if not event.ok or event.bytes <= 0:
            return
        if event.tokens > 0:
            self._per_token = event.bytes / event.tokens
        if event.action == "save" and event.bytes >= MIN_MEASURED_BYTES and event.seconds > 0:
            self._writes.append((event.bytes, event.seconds))
            self._saves += 1
        if event.action == "restore" and event.bytes >= MIN_READ_BYTES and event.seconds > 0:
            self._reads.append((event.bytes, event.seconds))

    def sized(self, n_bytes: int, n_tokens: int) -> None:
        """A state's size seen without a save that counts (one written, then not kept)."""
        if n_bytes > 0 and n_tokens > 0:
            self._per_token = n_bytes / n_tokens

    def replied(self, timings: dict[str, object]) -> None:
        """A reply's timings: the time a generated token took."""
        n, ms = timings.get("predicted_n"), timings.get("predicted_ms")
        if isinstance(n, int) and n >= MIN_GAP_TOKENS and isinstance(ms, int | float) and ms > 0:
            self._gaps.append(float(ms) / 1000 / n)

    @property
    def write_measured(self) -> bool:
        return bool(self._writes)

    @property
    def write_bytes_per_s(self) -> float:
        if not self._writes:
            return ASSUMED_WRITE_BYTES_PER_S
        return sum(b for b, _ in self._writes) / sum(s for _, s in self._writes)

    @property
    def read_bytes_per_s(self) -> float | None:
        """What this server's restores read a second, as a request waits for them; None
        before a restore of 16 MiB or more."""
        if not self._reads:
            return None
        return sum(b for b, _ in self._reads) / sum(s for _, s in self._reads)

    @property
    def bytes_per_token(self) -> float:
        """0 when neither a save nor the model tells."""
        return self._per_token or float(self.model_bytes_per_token())

    def state_bytes(self, tokens: int) -> int | None:
        per = self.bytes_per_token
        return int(tokens * per) if per > 0 else None

    def save_seconds(self, tokens: int) -> float | None:
        """What a save of `tokens` tokens will take (None: the state's size is not known)."""
        size = self.state_bytes(tokens)
        return None if size is None else size / self.write_bytes_per_s

    @property
    def token_gap_s(self) -> float | None:
        return statistics.median(self._gaps) if self._gaps else None


@dataclass
class PacedEvents(Events):
    """A lane's view of the shared events: its saves and restores also feed its pace. Shares
    the listeners and the prefill rates of the events it is made from (`of`)."""

    pace: Pace = field(default_factory=Pace)

    @classmethod
    def of(cls, events: Events, pace: Pace) -> PacedEvents:
        return cls(listeners=events.listeners, rates=events.rates, pace=pace)

    def slot_action(self, event: SlotActionEvent) -> None:
        self.pace.acted(event)
        super().slot_action(event)
