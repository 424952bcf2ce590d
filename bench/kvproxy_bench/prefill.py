"""Prefill accounting shared by `shared` and `fim`: one row per request, and per arm and phase
the sums a table shows: prompt tokens, prefilled (`timings.prompt_n`), cached
(`timings.cache_n`), ideal (what a perfect cache would prefill: only the request's new
content), % of ideal (cached over what a perfect cache would have served) and the ratio of
prefilled tokens to the server alone's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvproxy_bench.arms import DIRECT_RAM_CACHE
from kvproxy_bench.report import pct, table


@dataclass
class Request:
    arm: str
    phase: str
    what: str  # session and turn, or the FIM request's note
    status: int
    cached: int
    prefilled: int
    ideal: int  # tokens a perfect cache would prefill
    cache_state: str = "-"
    error: str | None = None

    @property
    def prompt(self) -> int:
        return self.cached + self.prefilled

    @property
    def reusable(self) -> int:
        return max(0, self.prompt - self.ideal)


def summary(requests: list[Request], arms: list[str], phases: list[str]) -> list[list[Any]]:
    """Rows: arm, phase, requests, answered, prompt, prefilled, cached, ideal, % of ideal,
    prefilled vs the server alone (× its prefill); a last "all" row per arm."""
    rows: list[list[Any]] = []
    base: dict[str, int] = {}
    for arm in arms:
        for phase in [*phases, "all"]:
            done = [r for r in requests if r.arm == arm and phase in (r.phase, "all")]
            if not done:
                continue
            ok = [r for r in done if r.status == 200]
            prefilled = sum(r.prefilled for r in ok)
            if arm == DIRECT_RAM_CACHE:
                base[phase] = prefilled
            ratio = f"{prefilled / base[phase]:.2f}×" if base.get(phase) else None
            rows.append(
                [
                    arm,
                    phase,
                    len(done),
                    len(ok),
                    sum(r.prompt for r in ok),
                    prefilled,
                    sum(r.cached for r in ok),
                    sum(r.ideal for r in ok),
                    pct(sum(r.cached for r in ok), sum(r.reusable for r in ok)),
                    ratio if arm != DIRECT_RAM_CACHE else None,
                ]
            )
    return rows


SUMMARY_COLUMNS = [
    "arm",
    "phase",
    "requests",
    "answered",
    "prompt tokens",
    "prefilled",
    "cached",
    "ideal prefill",
    "% of ideal",
    "prefilled vs server alone",
]


def summary_table(requests: list[Request], arms: list[str], phases: list[str]) -> str:
    return table(SUMMARY_COLUMNS, summary(requests, arms, phases))


def detail_table(requests: list[Request]) -> str:
    cols = ["arm", "phase", "request", "status", "cached", "prefilled", "ideal", "kvproxy", "error"]
    rows: list[list[Any]] = [
        [r.arm, r.phase, r.what, r.status, r.cached, r.prefilled, r.ideal, r.cache_state, r.error]
        for r in requests
    ]
    return table(cols, rows)
