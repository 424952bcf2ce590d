"""Two real llama-servers behind one kvproxy (managed `--servers 2`), through the `servers`
benchmark at a small size: 8 conversations × 3 turns from 4 clients at once; before turn 3
every slot is saved and one server is SIGKILLed. Asserted: no errors, every later turn ≥ 99%
of the ideal, and every turn-3 request answered, those of the killed server restored on the
other. Times are printed by `kvproxy bench servers`, never asserted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kvproxy_bench import servers
from kvproxy_bench.arms import BenchEnv

pytestmark = pytest.mark.real


async def test_two_servers_serve_every_turn_and_a_killed_one_costs_nothing(
    tmp_path: Path,
) -> None:
    env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work")
    env.threads = 1  # a core each, as the benchmark gives them
    opts = servers.ServersOptions(
        conversations=8, turns=3, clients=4, prompt_tokens=400, servers=(2,), direct=False
    )
    result = await servers.run_servers(env, opts)
    (arm,) = result.arms
    report = servers.markdown(result)
    assert arm.killed is not None, report
    assert len(arm.requests) == 24
    assert all(r.status == 200 for r in arm.requests), report
    later = [r for r in arm.requests if r.turn > 1]
    for r in later:
        assert r.reusable > 300 and r.cached >= 0.99 * r.reusable, (r, report)
    last = [r for r in arm.requests if r.turn == 3]
    assert {r.cache_state for r in last} <= {"resident", "restored"}
    # The killed server held conversations: they came back from disk on the other one.
    assert sum(r.cache_state == "restored" for r in last) >= 1, report
