"""`kvproxy bench fleet` at a tiny size against the real llama-server: 4 agent-paced
conversations through 2 slots, the server's RAM cache given a quarter of their KV bytes.
Asserted: no errors; kvproxy serves ≥ 99% of the ideal alone and with that starved RAM cache
on behind it (the two work together); the starved cache alone serves far less. Times are
printed by the benchmark, never asserted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kvproxy_bench import fleet
from kvproxy_bench.arms import KVPROXY, BenchEnv

pytestmark = pytest.mark.real


async def test_fleet_kvproxy_serves_the_ideal_beyond_the_ram_cache(tmp_path: Path) -> None:
    env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work")
    env.server_args.append("--no-warmup")
    env.threads = 1
    opts = fleet.FleetOptions(
        conversations=4,
        turns=2,
        prompt_tokens=400,
        arms=(fleet.RAM_STARVED, KVPROXY, fleet.KVPROXY_RAM),
        proxy_args=("--min-tokens", "64"),
    )
    result = await fleet.run_fleet(env, opts)
    report = fleet.markdown(result)
    size = fleet.Sizing(**result.sizing)
    assert size.bytes_per_token > 1000, report  # Gemma 3 270M: 18 KiB a token
    assert len(result.rows) == 3 * 2 * 4, report
    assert all(r.error is None for r in result.rows), report
    for arm in (KVPROXY, fleet.KVPROXY_RAM):
        got = fleet.later_pct(result, arm)
        assert got is not None and got >= 0.99, (arm, report)
        later = [r for r in result.rows if r.arm == arm and r.turn == 2]
        assert {r.cache_state for r in later} <= {"resident", "restored"}, report
    starved = fleet.later_pct(result, fleet.RAM_STARVED)
    assert starved is not None and starved < 0.6, report
    assert "| kvproxy + RAM cache ¼ " in report
