"""The report of a `chaos` run (chaos.py): the checks against its promises and the
markdown tables `kvproxy bench chaos` prints."""

from __future__ import annotations

from kvproxy_bench.chaos_plan import Kind
from kvproxy_bench.chaos_records import ChaosResult
from kvproxy_bench.chaos_tenants import COLUMNS
from kvproxy_bench.report import table
from kvproxy_bench.targets import Check


def checks(result: ChaosResult) -> list[Check]:
    """The run's promises, one line each, for the targets table and the exit code."""
    v = result.verdict()
    compared = [f for f in result.final if f.proxied is not None and f.direct is not None]
    return [
        Check(
            f"chaos: ≥ {v.faults_wanted} faults injected",
            str(v.faults_injected),
            v.faults_injected >= v.faults_wanted,
        ),
        Check("chaos: 0 kvproxy 500s", str(v.kvproxy_500s), v.kvproxy_500s == 0),
        Check("chaos: 0 stuck requests", str(v.stuck), v.stuck == 0),
        Check(
            "chaos: 0 invalid committed entries",
            f"{v.invalid_entries} of {result.audit.committed}",
            v.invalid_entries == 0,
        ),
        Check(
            "chaos: restored conversations answer as the server alone",
            f"{v.answers_differing} of {len(compared)} differ ({v.restored_checked} restored, "
            f"{sum(f.tie is not None for f in compared)} parted at the server's own tie)",
            v.answers_differing == 0 and v.restored_checked > 0,
        ),
        Check(
            "chaos: 0 cross-tenant reads",
            f"{v.cross_tenant_reads} in {v.probes} probes",
            v.cross_tenant_reads == 0 and v.probes > 0,
        ),
        *extra_checks(result),
    ]


def extra_checks(result: ChaosResult) -> list[Check]:
    """The checks of the faults a run may add: slow clients, a full disk, timing probes."""
    v, out = result.verdict(), []
    worst = result.slow_effect.worst()
    if worst is not None:
        out.append(
            Check(
                "chaos: other clients' p50 latency under slow clients within 2× of without",
                f"{worst:.2f}× (the worse of chat and /tokenize)",
                worst <= 2.0,
            )
        )
    if v.disk_wanted:
        d = result.disk
        out.append(
            Check(
                "chaos: a full disk mid-run, then freed: caching resumes",
                result.disk_skipped
                or f"{0 if d is None else d.saves_after} state files saved after it was freed",
                v.disk_ran and v.disk_resumed,
            )
        )
    if v.timing_wanted:
        out.append(
            Check(
                "chaos: byte-identical prompts of another tenant look like a fresh one",
                f"{v.timing_differing} of {v.timing_pairs} pairs told apart by headers/cache_n",
                v.timing_pairs > 0 and v.timing_differing == 0,
            )
        )
    return out


def markdown(result: ChaosResult) -> str:
    by_outcome = result.tally.by_outcome()
    outcomes = list(by_outcome)
    rows = []
    for kind in Kind:
        counts = [result.tally.counts[(kind, o)] for o in outcomes]
        if any(counts):
            rows.append([kind.value, sum(counts), *counts])
    rows.append(["all", result.tally.total(), *by_outcome.values()])
    parts = [table(["requests", "total", *[o.value for o in outcomes]], rows)]

    parts.append(
        table(
            ["#", "fault", "at (s)", "back after (s)", "requests in flight"],
            [
                [i + 1, f.fault, round(f.at_s, 1), round(f.down_s, 1), f.in_flight]
                for i, f in enumerate(result.faults)
            ],
        )
    )
    a = result.audit
    parts.append(
        table(
            ["cache dir", "committed", "valid", "invalid", "orphaned files", "state MiB"],
            [
                [
                    "after the run",
                    a.committed,
                    a.valid,
                    len(a.invalid),
                    len(a.orphaned),
                    round(a.state_bytes / 1024**2, 1),
                ]
            ],
        )
    )
    compared = [f for f in result.final if f.proxied is not None and f.direct is not None]
    restored = [f for f in compared if f.cache_state == "restored"]
    parts.append(
        table(
            [
                "after a restart of both",
                "conversations",
                "restored",
                "same answer as the server alone",
                "parted at the server's own tie",
            ],
            [
                [
                    "next turn",
                    len(result.final),
                    len(restored),
                    f"{sum(f.same for f in compared)} of {len(compared)}",
                    sum(not f.same and f.tie is not None for f in compared),
                ]
            ],
        )
    )
    parts.append(
        table(
            ["cross-tenant probes", "probes", "called a hit", "max cache_n − allowed", "reads"],
            [
                [
                    "byte-identical, another key",
                    len(result.probes),
                    sum(p.cache_state in ("resident", "restored") for p in result.probes),
                    max((p.cache_n - p.allowed for p in result.probes), default=None),
                    sum(p.crossed for p in result.probes),
                ]
            ],
        )
    )
    parts += extra_tables(result)
    v = result.verdict()
    st = result.proxy_stats
    parts.append(
        f"kvproxy's counters before the final restart: {st.get('saves', 0)} saves, "
        f"{st.get('restores', 0)} restores, {st.get('restore_failures', 0)} restore failures. "
        f"Wall time {result.wall_s:.0f} s."
    )
    violations = v.violations()
    parts.append(
        "**Every promise held.**" if not violations else "**Broken:** " + "; ".join(violations)
    )
    if result.details:
        parts.append("\n".join(f"- {d}" for d in result.details[:20]))
    return "\n\n".join(parts)


def extra_tables(result: ChaosResult) -> list[str]:
    parts = []
    effect = result.slow_effect
    if effect.without:
        parts.append(
            table(
                [
                    f"other clients, with {effect.held} slow connections",
                    "requests (without / with)",
                    "p50 without (ms)",
                    "p50 with (ms)",
                    "with / without",
                ],
                effect.rows(),
            )
        )
    if result.slow is not None:
        parts.append(f"Slow clients through the workload: {result.slow.summary()}.")
    d = result.disk
    if d is not None:
        parts.append(
            table(
                [
                    "full disk",
                    "filled at (s)",
                    "freed at (s)",
                    "requests while full",
                    "saves while full",
                    "faults kvproxy showed",
                    "state files saved after",
                ],
                [
                    [
                        f"tmpfs {d.size_mib} MiB, {d.filler_mib:.0f} MiB filler",
                        round(d.filled_at_s, 1),
                        round(d.freed_at_s, 1),
                        d.requests_while_full,
                        "— (kvproxy restarted)"
                        if d.saves_while_full is None
                        else d.saves_while_full,
                        d.faults_seen or "none",
                        d.saves_after,
                    ]
                ],
            )
        )
    elif result.disk_skipped:
        parts.append(f"Full disk not run: {result.disk_skipped}.")
    if result.timing.pairs:
        parts.append(table(COLUMNS, [result.timing.row()]))
    return parts
