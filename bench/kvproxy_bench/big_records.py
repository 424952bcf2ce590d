"""`kvproxy bench big`'s options and what a run records (big.py runs it, big_report.py
reads it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.arms import DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY
from kvproxy_bench.big_disk import DiskWrite, RssSample
from kvproxy_bench.big_log import LoggedSave
from kvproxy_bench.big_stream import Window

BIG_ARMS = (DIRECT_RAM_CACHE, KVPROXY, DIRECT_NO_CACHE)
BIG_ARM_FLAGS = {"ram-cache": DIRECT_RAM_CACHE, "kvproxy": KVPROXY, "no-cache": DIRECT_NO_CACHE}
A = 1  # the returning conversation; the others are 2, 3, …


@dataclass
class BigOptions:
    sizes: tuple[int, ...] = (2048,)
    slots: int = 2
    others_tokens: int = 8192  # the conversations that evict A: min(size, this) tokens
    max_tokens: int = 8  # every reply
    stream_tokens: int = 512  # the streams (ignore_eos), alone and with a save
    # kvproxy --min-tokens; None: above the streams' length, so that the streams (the victims
    # of the saves measured) are not saved themselves, while every conversation of the size is.
    min_tokens: int | None = None
    arms: tuple[str, ...] = BIG_ARMS

    @property
    def kvproxy_min_tokens(self) -> int:
        return self.min_tokens if self.min_tokens is not None else self.stream_tokens + 256

    def others(self, size: int) -> int:
        return min(size, self.others_tokens)

    def ctx_per_slot(self, size: int) -> int:
        # A is sized from two probes (it may come out a few % long), then takes up to nine turns
        # of ~70 tokens (a reply, a question); the streams' prompts are short.
        need = max(size + size // 16, self.stream_tokens) + 1024
        return -(-need // 256) * 256


@dataclass
class Returning:
    arm: str
    what: str
    tokens: int = 0  # the request's prompt, as the server counted it
    cached: int = 0
    ttfb_s: float = 0.0
    ttft_s: float = 0.0
    cache_state: str = "-"
    restore_ms: float = 0.0  # kvproxy: X-KVProxy-Restore-Ms; the server alone: its own call
    state_bytes: int = 0  # the state file restored, and the disk's reads of it
    cold_read_s: float = 0.0
    warm_read_s: float = 0.0
    prompt_ms: float = 0.0
    waited: list[str] = field(default_factory=list)  # what kvproxy did meanwhile (its log)
    error: str | None = None


@dataclass
class Action:
    """One of the server's own slot actions, called directly (the no-cache arm)."""

    what: str  # "save", "restore cold", "restore warm", "save during a stream"
    tokens: int
    bytes: int
    server_ms: float  # timings.save_ms / restore_ms
    wall_s: float


@dataclass
class StreamRun:
    arm: str
    what: str  # "alone" | "with a save"
    times: list[float] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # kvproxy's saves and restores
    error: str | None = None


@dataclass
class ShutdownRun:
    # Seconds the slots idled before SIGTERM, until kvproxy had saved every one (0: SIGTERM
    # right after their new turns).
    idled: float = 0.0
    held_slots: int = 0
    held_bytes: int = 0
    unsaved_slots: int = 0
    unsaved_bytes: int = 0
    seconds: float = 0.0  # SIGTERM to exit
    exit_code: int | None = None
    saves: list[LoggedSave] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)  # what kvproxy's log named as lost
    back: list[Returning] = field(default_factory=list)  # after the restart


@dataclass
class Kept:
    turns: int
    files: int
    bytes: int  # A's state files on disk
    newest_bytes: int
    dir_files: int
    dir_bytes: int


@dataclass
class SizePoint:
    size: int
    others: int
    slots: int
    bytes_per_token: float = 0.0
    # Tokens a second of A's cold prefills: its first turn in each arm, and the re-prefill.
    prefill_rates: dict[str, float] = field(default_factory=dict)
    returning: list[Returning] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)
    streams: list[StreamRun] = field(default_factory=list)
    saves: list[LoggedSave] = field(default_factory=list)  # kvproxy's, all of them
    disk: DiskWrite | None = None
    shutdown: ShutdownRun | None = None  # right after every slot's new turn
    idle_shutdown: ShutdownRun | None = None  # once the slots idled and kvproxy saved them
    kept: Kept | None = None
    rss: list[RssSample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def find(self, arm: str, what: str) -> Returning | None:
        return next((r for r in self.returning if (r.arm, r.what) == (arm, what)), None)


@dataclass
class BigResult:
    options: dict[str, Any]
    points: list[SizePoint] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "points": [asdict(p) for p in self.points]}


def result_from_json(data: dict[str, Any]) -> BigResult:
    """A run's `benchmarks.json` "big" section back as records (to print its tables again
    with `big_report`)."""
    points = []
    for raw in data["points"]:
        p = dict(raw)
        streams = [
            StreamRun(**{**s, "windows": [Window(**w) for w in s["windows"]]}) for s in p["streams"]
        ]
        points.append(
            SizePoint(
                **{
                    **p,
                    "returning": [Returning(**r) for r in p["returning"]],
                    "actions": [Action(**a) for a in p["actions"]],
                    "streams": streams,
                    "saves": [LoggedSave(**s) for s in p["saves"]],
                    "disk": DiskWrite(**p["disk"]) if p.get("disk") else None,
                    "shutdown": _shutdown_from_json(p.get("shutdown")),
                    "idle_shutdown": _shutdown_from_json(p.get("idle_shutdown")),
                    "kept": Kept(**p["kept"]) if p.get("kept") else None,
                    "rss": [RssSample(**s) for s in p["rss"]],
                }
            )
        )
    return BigResult(options=data["options"], points=points)


def _shutdown_from_json(raw: dict[str, Any] | None) -> ShutdownRun | None:
    if raw is None:
        return None
    saves = [LoggedSave(**s) for s in raw["saves"]]
    return ShutdownRun(**{**raw, "saves": saves, "back": [Returning(**r) for r in raw["back"]]})
