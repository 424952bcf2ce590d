"""`kvproxy bench stalls`'s pure parts: the gaps between a stream's tokens, split by whether
another conversation's request ran meanwhile, each arm's command and the tables — on plain
data."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from kvproxy_bench import stalls
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.command import arms_of

from kvproxy.cli import build_parser
from kvproxy.server.modelinfo import ModelInfo


def turn(conversation: int, started: float, ended: float) -> stalls.Turn:
    return stalls.Turn(conversation, started, ended, 990, 10, 1000, "restored")


def test_gaps_are_split_by_the_other_conversations_requests() -> None:
    times = [0.0, 0.02, 0.04, 0.30, 0.32, 0.34]  # a 260 ms stall while a request ran
    during, between = stalls.split(times, [turn(1, 0.05, 0.31)])
    assert [round(g) for g in during] == [260, 20]
    assert [round(g) for g in between] == [20, 20, 20]


def test_summary_takes_nearest_rank_quantiles_in_ms() -> None:
    gaps = stalls.gaps_ms([0.0, 0.01, 0.02, 0.03, 0.53])
    got = stalls.summary(gaps)
    assert (got.n, round(got.p50 or 0), round(got.max or 0)) == (4, 10, 500)
    assert round(got.p99 or 0) == 500
    assert stalls.summary([]) == stalls.Gaps(0, None, None, None)


def env() -> BenchEnv:
    info = ModelInfo(Path("/m.gguf"), architecture="gemma3", n_swa=512, has_swa=True)
    return BenchEnv(Path("/bin/llama-server"), Path("/m.gguf"), info, Path("/tmp/w"), 2)


def test_each_arm_is_started_as_it_is_named() -> None:
    opts = stalls.StallsOptions()
    at_once = stalls.make_stalls_arm(stalls.KVPROXY_AT_ONCE, env(), opts)
    held = stalls.make_stalls_arm(KVPROXY, env(), opts)
    ram = stalls.make_stalls_arm(DIRECT_RAM_CACHE, env(), opts)
    assert isinstance(at_once, ProxyArm) and isinstance(held, ProxyArm)
    cmd = at_once.command(8080)
    assert cmd[cmd.index("--save-wait") + 1] == "0"
    assert "--save-wait" not in held.command(8080)  # the default
    assert isinstance(ram, DirectArm) and ram.ram_cache and ram.slots == 2
    assert arms_of("at-once,kvproxy", stalls.STALLS_ARM_FLAGS) == (stalls.KVPROXY_AT_ONCE, KVPROXY)


def test_the_tables_show_each_arm_and_the_ratio_to_the_stream_alone() -> None:
    run = stalls.ArmRun(
        KVPROXY,
        alone=[i * 0.02 for i in range(101)],
        loaded=[*(i * 0.02 for i in range(50)), *(1.1 + i * 0.02 for i in range(51))],
        turns=[turn(1, 0.5, 1.2)],
        counts={"saves": 3, "background_saves": 2, "restores": 3},
    )
    result = stalls.StallsResult(options=asdict(stalls.StallsOptions()), arms=[run])
    text = stalls.markdown(result)
    assert "| kvproxy" in text
    assert "20 / 20 / 20" in text  # alone: every gap 20 ms
    assert "100.0%" not in text  # 990 of 1,000 reusable tokens
    assert "99.0%" in text
    assert "| 1 " in text or " 1 |" in text  # one save on a request's path


@pytest.mark.parametrize("flags", [["--stream-tokens", "64", "--arms", "kvproxy,at-once"]])
def test_the_command_line_takes_the_stalls_flags(flags: list[str]) -> None:
    args = build_parser().parse_args(["bench", "stalls", *flags])
    assert (args.stream_tokens, args.arms, args.conversations) == (64, "kvproxy,at-once", None)
