"""The targets of issues #5 and #17, checked against a run's results, and the README summary
table."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from kvproxy_bench.arms import DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY
from kvproxy_bench.load import LoadResult
from kvproxy_bench.overhead import AGENT_TURNS, CACHE_ON, PASS_THROUGH, OverheadResult
from kvproxy_bench.report import table
from kvproxy_bench.restore import RestoreResult
from kvproxy_bench.workload import (
    PACED,
    RESIDENT,
    RESTART,
    SHUFFLED,
    WorkloadResult,
    summarize,
    turn2,
    turn2_pct,
)

# Issue #17: added latency with the cache on (fake upstream), in ms.
OVERHEAD_P50_MS, OVERHEAD_P99_MS = 0.5, 2.0
# Pass-through keeps issue #5's.
PASS_P50_MS, PASS_P99_MS = 1.0, 3.0
# Where aiohttp's own hop is the floor: how far above a minimal aiohttp pass-through.
FLOOR_MARGIN_MS = 0.2


@dataclass
class Check:
    target: str
    measured: str
    met: bool | None  # None: not measured in this run


def _fmt_pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def workload_checks(result: WorkloadResult) -> list[Check]:
    out = []
    for case, label in (
        (SHUFFLED, "evictions"),
        (PACED, "agent-paced"),
        (RESTART, "after a restart"),
    ):
        value = turn2_pct(result, case)
        if value is None and case == PACED:
            continue  # a run without that case (older results, --only-cases)
        out.append(
            Check(
                f"workload: kvproxy serves ≥ 99% of the ideal on turn 2 ({label})",
                _fmt_pct(value),
                None if value is None else value >= 0.99,
            )
        )
    for case, label in ((SHUFFLED, "evictions"), (PACED, "agent-paced")):
        ours, ram = turn2(result, case), turn2(result, case, DIRECT_RAM_CACHE)
        if ours is None or ram is None or not ram.seconds:
            continue
        ratio = ours.seconds / ram.seconds
        out.append(
            Check(
                f"workload: kvproxy's turn-2 time ≤ 1.0× the RAM cache's ({label})",
                f"{ratio:.2f}× ({ours.seconds:.2f} s vs {ram.seconds:.2f} s)",
                ratio <= 1.0,
            )
        )
    ours, ram = turn2(result, RESTART), turn2(result, RESTART, DIRECT_RAM_CACHE)
    if ours is not None and ram is not None and ours.seconds:
        speedup = ram.seconds / ours.seconds
        out.append(
            Check(
                "workload: kvproxy's turn 2 after a restart ≥ 10× faster than the RAM cache's",
                f"{speedup:.1f}× ({ours.seconds:.2f} s vs {ram.seconds:.2f} s)",
                speedup >= 10,
            )
        )
    return out


def restore_checks(result: RestoreResult) -> list[Check]:
    measured = [p for p in result.points if p.restored_s and p.tokens]
    if not measured:
        return [Check("restore: 8k-token conversation", "not measured", None)]
    p = min(measured, key=lambda q: abs(q.tokens - 8192))
    return [
        Check(
            f"restore: TTFT restored ≤ 1.5× (resident + cold read) at {p.tokens:,} tokens",
            f"{p.vs_limit:.2f}× ({p.restored_s * 1000:.0f} ms vs {p.limit_s * 1000:.0f} ms)",
            p.vs_limit <= 1.5,
        ),
        Check(
            f"restore: restored ≥ 50× faster than re-prefill at {p.tokens:,} tokens",
            f"{p.speedup:.0f}× ({p.restored_s * 1000:.0f} ms vs {p.reprefill_s:.1f} s)",
            p.speedup >= 50,
        ),
    ]


def overhead_checks(result: OverheadResult) -> list[Check]:
    out = []
    for m in result.modes:
        s = m.summary()
        cached = m.mode in (CACHE_ON, AGENT_TURNS)
        p50, p99 = (OVERHEAD_P50_MS, OVERHEAD_P99_MS) if cached else (PASS_P50_MS, PASS_P99_MS)
        if cached and m.floor_ms:
            out.append(
                Check(
                    f"overhead ({m.mode}): p50 within {FLOOR_MARGIN_MS:g} ms of a minimal "
                    "aiohttp pass-through",
                    f"{s['above_floor_p50_ms']:+.2f} ms",
                    s["above_floor_p50_ms"] <= FLOOR_MARGIN_MS,
                )
            )
        out += [
            Check(
                f"overhead ({m.mode}): added latency p50 < {p50:g} ms",
                f"{s['added_p50_ms']:.2f} ms",
                s["added_p50_ms"] < p50,
            ),
            Check(
                f"overhead ({m.mode}): added latency p99 < {p99:g} ms",
                f"{s['added_p99_ms']:.2f} ms",
                s["added_p99_ms"] < p99,
            ),
            Check(
                f"overhead ({m.mode}): SSE relay ≥ 20,000 events/s",
                f"{s['sse_proxied_eps']:,.0f}/s",
                s["sse_proxied_eps"] >= 20_000,
            ),
        ]
    if result.key_ms:
        med = statistics.median(result.key_ms)
        out.append(
            Check(
                "overhead: keys for 1 MB < 5 ms, JSON parsing included",
                f"{med:.2f} ms median",
                med < 5.0,
            )
        )
    return out


def load_checks(result: LoadResult) -> list[Check]:
    out = []
    for a in result.arms:
        s = a.summary()
        out.append(
            Check(
                f"load ({a.arm}): zero errors, no stall",
                f"{s['errors']} errors, {'a stall' if s['stalled'] else 'no stall'}, "
                f"{s['requests']} requests",
                s["errors"] == 0 and not s["stalled"],
            )
        )
    return out


def checks_markdown(checks: list[Check]) -> str:
    verdict = {True: "met", False: "**not met**", None: "—"}
    return table(
        ["target", "measured", "verdict"], [[c.target, c.measured, verdict[c.met]] for c in checks]
    )


def summary_table(results: dict[str, Any]) -> str:
    """A few lines for the README: the headline ratios of a full run."""
    rows: list[list[Any]] = []
    wl: WorkloadResult | None = results.get("workload")
    if wl is not None:
        by = {(s.case, s.arm, s.turn): s for s in summarize(wl)}
        for case, label in (
            (SHUFFLED, "turn 2 after evictions (4 conv., 2 slots)"),
            (PACED, "turn 2 after evictions, agent-paced (0.5–3 s gaps)"),
            (RESTART, "turn 2 after restarting everything"),
            (RESIDENT, "turn 2, all resident (order 1,2,1,2)"),
        ):
            cells = []
            for arm in (DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY):
                s = by.get((case, arm, 2))
                cells.append(
                    None if s is None else f"{_fmt_pct(s.pct_of_ideal)} of ideal, {s.seconds:.1f} s"
                )
            if any(cells):
                rows.append([label, *cells])
    rs: RestoreResult | None = results.get("restore")
    if rs is not None:
        for p in rs.points:
            if p.restored_s and p.tokens >= 4000:
                rows.append(
                    [
                        f"TTFT, returning {p.tokens:,}-token conversation",
                        f"{p.reprefill_s:.1f} s (re-prefill)",
                        "—",
                        f"{p.restored_s * 1000:.0f} ms ({p.speedup:.0f}× faster; "
                        f"{p.vs_limit:.2f}× the disk limit)",
                    ]
                )
    ov: OverheadResult | None = results.get("overhead")
    if ov is not None:
        for m in ov.modes:
            if m.mode in (CACHE_ON, AGENT_TURNS, PASS_THROUGH):
                om = m.summary()
                rows.append(
                    [
                        f"proxy overhead ({m.mode}), fake upstream",
                        "—",
                        "—",
                        f"+{om['added_p50_ms']:.2f} ms p50, +{om['added_p99_ms']:.2f} ms p99; "
                        f"SSE {om['sse_proxied_eps']:,.0f} events/s",
                    ]
                )
    ld: LoadResult | None = results.get("load")
    if ld is not None:
        for a in ld.arms:
            la = a.summary()
            o = ld.options
            rows.append(
                [
                    f"{o['clients']} clients × {o['conversations']} conv. "
                    f"through {o['slots']} slots",
                    "—",
                    "—",
                    f"{la['errors']} errors, {'stall' if la['stalled'] else 'no stall'}, "
                    f"wait p99 {la['wait_p99_ms'] / 1000:.1f} s",
                ]
            )
    return table(["measure", DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY], rows)
