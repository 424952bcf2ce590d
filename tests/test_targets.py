"""The benchmark's targets (bench/kvproxy_bench/targets.py) judged on hand-made results."""

from __future__ import annotations

from dataclasses import asdict

from kvproxy_bench import targets, workload
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY


def row(case: str, arm: str, turn: int, seconds: float, cached: int) -> workload.Row:
    return workload.Row(case, arm, turn, 1, 1000, cached, 1000 - cached, 980, 20, seconds, "")


def result(rows: list[workload.Row]) -> workload.WorkloadResult:
    opts = workload.WorkloadOptions(only_cases=(workload.SHUFFLED, workload.PACED))
    return workload.WorkloadResult(options=asdict(opts), rows=rows)


def verdicts(res: workload.WorkloadResult) -> dict[str, bool | None]:
    return {c.target: c.met for c in targets.workload_checks(res)}


def test_turn_two_is_judged_against_the_ram_cache_per_case() -> None:
    rows = [
        row(workload.SHUFFLED, DIRECT_RAM_CACHE, 2, 2.0, 970),
        row(workload.SHUFFLED, KVPROXY, 2, 1.9, 980),
        row(workload.PACED, DIRECT_RAM_CACHE, 2, 2.0, 970),
        row(workload.PACED, KVPROXY, 2, 2.2, 980),
    ]
    got = verdicts(result(rows))
    assert got["workload: kvproxy's turn-2 time ≤ 1.0× the RAM cache's (evictions)"] is True
    assert got["workload: kvproxy's turn-2 time ≤ 1.0× the RAM cache's (agent-paced)"] is False
    assert got["workload: kvproxy serves ≥ 99% of the ideal on turn 2 (agent-paced)"] is True


def test_after_a_restart_kvproxy_must_be_ten_times_faster() -> None:
    rows = [
        row(workload.RESTART, DIRECT_RAM_CACHE, 2, 19.0, 10),
        row(workload.RESTART, KVPROXY, 2, 2.0, 980),
    ]
    target = "workload: kvproxy's turn 2 after a restart ≥ 10× faster than the RAM cache's"
    assert verdicts(result(rows))[target] is False
    rows[1] = row(workload.RESTART, KVPROXY, 2, 1.8, 980)
    assert verdicts(result(rows))[target] is True
