"""`kvproxy bench` end to end with tiny parameters against the real llama-server: every
scenario produces its table rows, kvproxy's arm reuses the cache, load has no errors, the plot
and the markdown are written. No timing assertions: times on a shared machine mean nothing
here; the benchmark itself reports them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest
from kvproxy_bench import load, overhead, restore, workload
from kvproxy_bench.arms import ALL_ARMS, DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY, BenchEnv
from kvproxy_bench.command import write_outputs
from kvproxy_bench.report import header

from kvproxy import cli

pytestmark = pytest.mark.real


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[BenchEnv]:
    bench_env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work")
    # These tests time nothing: skip llama-server's warm-up decode to start it sooner, and run
    # it on one thread, which shares a busy machine far better than threads that spin-wait.
    bench_env.server_args.append("--no-warmup")
    bench_env.threads = 1
    yield bench_env


def turn2(result: workload.WorkloadResult, case: str, arm: str) -> workload.TurnSummary:
    found = [s for s in workload.summarize(result) if (s.case, s.arm, s.turn) == (case, arm, 2)]
    assert len(found) == 1
    return found[0]


def pct_of_ideal(summary: workload.TurnSummary) -> float:
    """The summary's share of the ideal; a turn without one fails (as comparing None would)."""
    assert summary.pct_of_ideal is not None, summary
    return summary.pct_of_ideal


def tiny_workload(case: str, arms: tuple[str, ...]) -> workload.WorkloadOptions:
    return workload.WorkloadOptions(
        conversations=2,
        turns=2,
        slots=1,
        prompt_tokens=120,
        max_tokens=4,
        ctx_per_slot=512,
        arms=arms,
        only_cases=(case,),
        proxy_args=("--min-tokens", "64"),  # so that these short conversations are saved
    )


async def test_workload_three_arms_with_restart(env: BenchEnv, tmp_path: Path) -> None:
    result = await workload.run_workload(env, tiny_workload(workload.SHUFFLED, ALL_ARMS))
    # The no-cache arm after a restart is the same as without one: not run again here.
    restarted = await workload.run_workload(
        env, tiny_workload(workload.RESTART, (DIRECT_RAM_CACHE, KVPROXY))
    )
    result.rows += restarted.rows

    assert all(r.error is None for r in result.rows)
    # 3 + 2 arms × 2 turns × 2 conversations, each with the server's own counts.
    assert len(result.rows) == 20
    assert all(r.presented == r.cached + r.prefilled > 100 for r in result.rows)
    for case in (workload.SHUFFLED, workload.RESTART):
        mine = turn2(result, case, KVPROXY)
        assert mine.cached > 0.8 * mine.reusable
        assert {r.cache_state for r in result.rows if r.case == case and r.arm == KVPROXY} >= {
            "miss",
            "restored",
        }
    # After a restart the RAM cache is gone: only the shared template prefix can match.
    assert pct_of_ideal(turn2(result, workload.RESTART, DIRECT_RAM_CACHE)) < 0.2
    assert pct_of_ideal(turn2(result, workload.SHUFFLED, DIRECT_RAM_CACHE)) > 0.8
    assert pct_of_ideal(turn2(result, workload.SHUFFLED, DIRECT_NO_CACHE)) < 0.8

    text = workload.markdown(result)
    for arm in ALL_ARMS:
        assert f"| {arm} " in text
    assert "% of ideal" in text
    assert "restarted between turns" in workload.markdown(restarted)
    png = tmp_path / "workload.png"
    await asyncio.to_thread(workload.plot, result, png)
    assert png.read_bytes()[:4] == b"\x89PNG"


async def test_workload_agent_paced(env: BenchEnv) -> None:
    """The agent-paced case: tool-result turns after seeded gaps, served from kvproxy's cache."""
    result = await workload.run_workload(env, tiny_workload(workload.PACED, (KVPROXY,)))
    assert all(r.error is None for r in result.rows) and len(result.rows) == 4
    mine = turn2(result, workload.PACED, KVPROXY)
    assert mine.cached > 0.8 * mine.reusable
    assert "at an agent's pace" in workload.markdown(result)


async def test_restore_table_plot_and_document(env: BenchEnv, tmp_path: Path) -> None:
    opts = restore.RestoreOptions(sizes=(256, 512), min_tokens=64, repeats=2)
    result = await restore.run_restore(env, opts)

    for point in result.points:
        assert point.errors == []
        assert point.restored_state == "restored"
        assert point.restored_cached > point.target * 0.8
        assert point.reprefill_cached == 0 and point.resident_cached > 0
        assert point.state_bytes > 0
    assert result.points[1].tokens > result.points[0].tokens

    out = tmp_path / "out"
    head = await asyncio.to_thread(header, env, ["bench", "restore"])
    await asyncio.to_thread(write_outputs, out, head, {"restore": result})
    png = out / "img" / "restore.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    doc = (out / "benchmarks.md").read_text()
    assert "TTFT restored (kvproxy)" in doc and "img/restore.png" in doc
    assert "llama-server: version" in doc and "Targets (issue #5)" in doc
    raw = json.loads((out / "benchmarks.json").read_text())
    assert len(raw["restore"]["points"]) == 2


async def test_load_has_no_errors(env: BenchEnv) -> None:
    opts = load.LoadOptions(
        clients=4,
        conversations=4,
        slots=2,
        turns=2,
        prompt_tokens=120,
        max_tokens=4,
        ctx_per_slot=512,
        proxy_args=("--min-tokens", "64"),
    )
    result = await load.run_load(env, opts)
    summary = result.arms[0].summary()
    assert summary["requests"] == 8
    assert summary["errors"] == 0 and not summary["stalled"]
    assert result.arms[0].proxy_stats["restore_failures"] == 0
    assert "| kvproxy " in load.markdown(result)


async def test_overhead_on_the_fake_upstream(env: BenchEnv) -> None:
    opts = overhead.OverheadOptions(
        requests=20,
        sse_events=300,
        sse_runs=1,
        ttfb_requests=5,
        key_bytes=50_000,
        key_messages=50,
        key_runs=3,
    )
    result = await overhead.run_overhead(env, opts)
    assert [m.mode for m in result.modes] == [
        overhead.CACHE_ON,
        overhead.AGENT_TURNS,
        overhead.PASS_THROUGH,
    ]
    for mode in result.modes:
        assert mode.errors == 0
        assert len(mode.direct_ms) == len(mode.proxied_ms) == len(mode.floor_ms) == 20
        assert mode.sse_proxied_eps > 0 and len(mode.ttfb_proxied_ms) == 5
    assert len(result.key_ms) == 3
    text = overhead.markdown(result)
    assert "| cache on " in text and "| pass-through " in text and "Keys for" in text
    assert "| cache on, agent turns " in text
    assert "minimal aiohttp pass-through added" in text


def test_overhead_agent_turns_grow_a_conversation_then_start_another() -> None:
    dialogue = overhead.Dialogue(overhead.AGENT_TURNS)
    reply = orjson.dumps({"choices": [{"message": {"content": "ok"}}]})
    bodies = []
    for _ in range(overhead.TURNS_A_CONVERSATION + 1):
        bodies.append(orjson.loads(dialogue.body())["messages"])
        dialogue.replied(reply)
    turns = overhead.TURNS_A_CONVERSATION
    assert [len(b) for b in bodies] == [2 * (i + 1) for i in range(turns)] + [2]
    assert bodies[1][:3] == [*bodies[0], {"role": "assistant", "content": "ok"}]
    assert bodies[-1][1]["content"] == "Say ok (2)."  # a new session
    same = overhead.Dialogue(overhead.CACHE_ON)
    before = same.body()
    same.replied(reply)
    assert same.body() == before


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The command a user types: header lines first, a table, the targets, files in --out."""
    out = tmp_path / "docs"
    code = cli.main(
        ["bench", "overhead", "--requests", "10", "--sse-events", "200", "--out", str(out)]
    )
    assert code == 0
    printed, err = capsys.readouterr()
    assert "] overhead (1/1)\n" in err and "] overhead done (" in err  # where a long run is
    for line in ("- command: `kvproxy ", "- machine: ", "- llama-server: ", "- model: "):
        assert line in printed
    assert "## overhead" in printed and "## targets" in printed
    assert (out / "benchmarks.md").stat().st_size > 0
