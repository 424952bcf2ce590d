"""`kvproxy bench agents` end to end for the OpenAI SDK loop and Codex (the real CLI from npm,
installed here by the test set-up), through kvproxy in front of the real llama-server: turn 1,
turn 2 after other conversations took every slot, turn 3 after a restart of both processes.
Asserts on the rows the benchmark reports (kvproxy's decisions and the server's cache_n
against the ideal), never on times."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kvproxy_bench import agents
from kvproxy_bench.agentdrivers import CODEX, SDK
from kvproxy_bench.arms import KVPROXY, BenchEnv

pytestmark = pytest.mark.real


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[BenchEnv]:
    bench_env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work")
    bench_env.server_args.append("--no-warmup")  # nothing here is timed
    yield bench_env


@pytest.mark.timeout(1200)  # Codex's first turn prefills ~4,600 tokens on a shared 2-core box
async def test_sdk_and_codex_later_turns_come_back_whole(env: BenchEnv) -> None:
    opts = agents.AgentsOptions(
        clients=(SDK, CODEX),
        arms=(KVPROXY,),
        install=True,  # Codex from npm, as `kvproxy bench agents --install` does
        ctx_per_slot=8192,
        sdk_prompt_tokens=600,
        evict_facts=12,
        new_sessions=False,
        cases=(),  # the plan alone (the cases: test_real_agents.py, test_bench_agents_cases.py)
    )
    result = await agents.run_agents(env, opts)
    assert result.failures == [] and result.skipped == {}, result
    assert all(r.error is None for r in result.rows), result.rows
    assert all(r.arm == KVPROXY for r in result.rows)
    for client in (SDK, CODEX):
        mine = [r for r in result.rows if r.client == client]
        # One request per turn for both clients.
        assert [r.turn for r in mine] == ["1", agents.AFTER_EVICTION, agents.AFTER_RESTART], mine
        first, *later = mine
        assert first.decision == "miss" and first.ideal is None, first
        for r in later:
            assert r.decision == "restored", r
            assert r.ideal is not None and r.ideal > 0.9 * r.presented, r
            assert r.cache_n >= 0.99 * r.ideal, r

    checks = agents.checks(result)
    later_checks = [c for c in checks if any(t in c.target for t in agents.LATER)]
    assert len(later_checks) == 4 and all(c.met for c in later_checks), checks
    text = agents.markdown(result)
    assert "| Codex " in text and "| OpenAI SDK " in text and "restored" in text
