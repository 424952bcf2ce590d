"""What kvproxy's own log says it did between two moments of a `big` run (its log file, read
from a byte offset): the saves it made (on a request's path or in the background, with the
canonical-prefix pass before each), the request lines (restore, queue wait), and what a
shutdown named as lost. Best effort: a line it does not recognise is skipped, so a changed
log format shows as missing detail, never as a failed run."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_SAVE = re.compile(
    r"saved slot (?P<slot>\d+)(?P<bg> in the background)?: (?P<key>\w+), (?P<tokens>\d+) "
    r"tokens, (?P<bytes>\d+) bytes in (?P<ms>[\d.]+) ms \(canonical prefix before: "
    r"(?P<canonical>[\d.]+) ms\)"
)
_REQUEST = re.compile(r"kvproxy\.request: (?P<route>\S+) (?P<key>[0-9a-f]{6,}) (?P<decision>\w+)")
# A duration as the request line writes it (kvproxy/readable.py, no space): 6.1ms, 2.4s.
_T = r"(?P<v>[\d.]+)(?P<u>ms|min|s|h)\b"
_UNIT_S = {"ms": 0.001, "s": 1.0, "min": 60.0, "h": 3600.0}
_RESTORED = re.compile(r"restored=(?P<tokens>\d+)tok/" + _T)
_WAIT = re.compile(r" wait=" + _T)
_EVALUATED = re.compile(r" evaluated=(?P<n>\d+)")
_DURATION = re.compile(r"status=(?P<status>\d+) " + _T)
_LOST = re.compile(r"lost: (?P<what>.+)$")


@dataclass(frozen=True)
class LoggedSave:
    slot: int
    background: bool
    key: str
    tokens: int
    bytes: int
    ms: float
    canonical_ms: float


@dataclass(frozen=True)
class LoggedRequest:
    key: str
    decision: str
    restored_ms: float | None
    wait_s: float
    evaluated: int
    seconds: float | None


@dataclass
class LogSpan:
    saves: list[LoggedSave] = field(default_factory=list)
    requests: list[LoggedRequest] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)


def offset(path: Path) -> int:
    """Blocking: where the log ends now."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_span(path: Path, start: int, end: int | None = None) -> LogSpan:
    """Blocking: what the log says between byte offsets `start` and `end` (its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read() if end is None else f.read(max(0, end - start))
    except OSError:
        return LogSpan()
    return parse(raw.decode("utf-8", "replace"))


def parse(text: str) -> LogSpan:
    span = LogSpan()
    for line in text.splitlines():
        if m := _SAVE.search(line):
            span.saves.append(
                LoggedSave(
                    int(m["slot"]),
                    bool(m["bg"]),
                    m["key"],
                    int(m["tokens"]),
                    int(m["bytes"]),
                    float(m["ms"]),
                    float(m["canonical"]),
                )
            )
        elif m := _REQUEST.search(line):
            restored = _RESTORED.search(line)
            wait = _WAIT.search(line)
            evaluated = _EVALUATED.search(line)
            duration = _DURATION.search(line)
            span.requests.append(
                LoggedRequest(
                    m["key"],
                    m["decision"],
                    _seconds(restored) * 1000 if restored else None,
                    _seconds(wait) if wait else 0.0,
                    int(evaluated["n"]) if evaluated else 0,
                    _seconds(duration) if duration else None,
                )
            )
        elif "not saved" in line and (m := _LOST.search(line)):
            span.lost.append(m["what"].strip())
    return span


def _seconds(m: re.Match[str]) -> float:
    return float(m["v"]) * _UNIT_S[m["u"]]


def gib(n: float) -> str:
    """A byte count as people read it at these sizes."""
    if n >= 1024**3:
        return f"{n / 1024**3:.2f} GiB"
    if n >= 1024**2:
        return f"{n / 1024**2:.0f} MiB"
    return f"{n / 1024:.0f} KiB"


def describe(span: LogSpan) -> list[str]:
    """What kvproxy did in the span, a phrase each: the saves (and their canonical-prefix
    passes), and the requests' waits for a slot and kvproxy's own evaluations."""
    out = []
    for s in span.saves:
        where = "in the background" if s.background else "on a request's path"
        canonical = f" after a {s.canonical_ms / 1000:.1f} s canonical-prefix pass" * (
            s.canonical_ms >= 50
        )
        out.append(
            f"save of slot {s.slot} ({gib(s.bytes)}) {where}: {s.ms / 1000:.1f} s{canonical}"
        )
    for r in span.requests:
        if r.wait_s >= 0.05:
            out.append(f"queued {r.wait_s:.1f} s for its slot")
        if r.evaluated:
            out.append(f"{r.evaluated} tokens evaluated by kvproxy before forwarding")
    return out
