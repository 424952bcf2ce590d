"""Cross-tenant timing probes for `chaos`: can a tenant tell, from what kvproxy answers, that
another tenant sent the same prompt?

Each probe is a pair of requests from keys never seen before, sent one after the other in a
quiet moment: *same*, another tenant's conversation byte for byte (its system prompt and every
turn so far), and *control*, the same conversation with its project number changed in every
message (the same length, a prompt nobody sent). If kvproxy (or the server behind it) reused
the other tenant's state for *same*, it would answer faster and its `X-KVProxy-*` headers or
`timings.cache_n` would differ from the control's. The order alternates per pair.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

HEADERS = ("X-KVProxy-Cache", "X-KVProxy-Restored-Tokens", "X-KVProxy-Evaluated-Tokens")


def renumbered(messages: list[dict[str, Any]], old: int, new: int) -> list[dict[str, Any]]:
    """`messages` with project `old` named `new` in every message (same digit count)."""
    assert len(str(old)) == len(str(new))
    return [{**m, "content": str(m["content"]).replace(str(old), str(new))} for m in messages]


def visible(headers: dict[str, str]) -> dict[str, str]:
    """What kvproxy tells a client about the cache, as a tenant would compare it."""
    return {h: headers.get(h, "") for h in HEADERS}


@dataclass
class TimingPair:
    conversation: int
    same_s: float
    control_s: float
    same_seen: dict[str, str]  # visible headers, and cache_n
    control_seen: dict[str, str]

    @property
    def differ(self) -> bool:
        return self.same_seen != self.control_seen

    def told(self) -> str:
        """What the two sides saw where they differ: the failure's first clue."""
        keys = sorted(
            k
            for k in {*self.same_seen, *self.control_seen}
            if self.same_seen.get(k) != self.control_seen.get(k)
        )
        return ", ".join(
            f"{k}: same {self.same_seen.get(k)!r}, control {self.control_seen.get(k)!r}"
            for k in keys
        )


@dataclass
class TimingProbes:
    pairs: list[TimingPair] = field(default_factory=list)

    def p50(self, which: str) -> float | None:
        times = [p.same_s if which == "same" else p.control_s for p in self.pairs]
        return statistics.median(times) if times else None

    def differing(self) -> int:
        return sum(p.differ for p in self.pairs)

    def row(self) -> list[Any]:
        same, control = self.p50("same"), self.p50("control")
        if same is None or control is None:
            return ["byte-identical vs a fresh prompt", 0, "-", "-", "-", "-"]
        return [
            "byte-identical vs a fresh prompt",
            len(self.pairs),
            f"{same * 1000:.0f}",
            f"{control * 1000:.0f}",
            f"{(same - control) * 1000:+.0f} ({same / control:.2f}×)",
            self.differing(),
        ]


COLUMNS = [
    "cross-tenant timing",
    "pairs",
    "p50 same (ms)",
    "p50 control (ms)",
    "same − control",
    "pairs whose headers or cache_n differ",
]
