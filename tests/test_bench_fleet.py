"""`kvproxy bench fleet`'s pure parts: the working set's size from a save, each arm's
`--cache-ram`, the context each slot needs, the quantiles and the table — on plain data."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
from kvproxy_bench import fleet
from kvproxy_bench.arms import DIRECT_NO_CACHE, KVPROXY, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.command import arms_of
from kvproxy_bench.workload import Row

from kvproxy.server.modelinfo import ModelInfo

# Gemma 3 270M with --swa-full: 18 KiB of KV per token, as a real save of 487 tokens shows.
SIZE = fleet.Sizing(
    saved_tokens=487, saved_bytes=487 * 18432, conversations=16, tokens_per_conversation=3200
)


def test_working_set_and_cache_ram_from_a_save() -> None:
    assert SIZE.bytes_per_token == 18432
    assert SIZE.working_set_bytes == 16 * 3200 * 18432  # 900 MiB
    assert SIZE.cache_ram_mib(0.25) == 225
    assert SIZE.cache_ram_mib(2.0) == 1800
    # A tiny set never asks for `--cache-ram 0`, which would turn the cache off.
    tiny = fleet.Sizing(10, 100, 1, 10)
    assert tiny.cache_ram_mib(0.25) == 1


def test_sizing_adds_the_later_turns() -> None:
    opts = fleet.FleetOptions(turns=3, max_tokens=16)
    size = fleet.sizing(opts, first_tokens=3000, saved_tokens=3000, saved_bytes=3000 * 100)
    assert size.tokens_per_conversation == 3000 + 2 * (16 + fleet.GROWTH_BESIDES_REPLY)
    assert size.conversations == 16


def test_each_arm_gets_its_cache_ram() -> None:
    opts = fleet.FleetOptions()
    assert fleet.arm_cache_ram(DIRECT_NO_CACHE, SIZE, opts) == 0
    assert fleet.arm_cache_ram(KVPROXY, SIZE, opts) == 0
    assert fleet.arm_cache_ram(fleet.RAM_STARVED, SIZE, opts) == 225
    assert fleet.arm_cache_ram(fleet.KVPROXY_RAM, SIZE, opts) == 225
    assert fleet.arm_cache_ram(fleet.RAM_ROOMY, SIZE, opts) == 1800


def env() -> BenchEnv:
    info = ModelInfo(Path("/m.gguf"), architecture="gemma3", n_swa=512, has_swa=True)
    return BenchEnv(Path("/bin/llama-server"), Path("/m.gguf"), info, Path("/tmp/w"), 2)


@pytest.mark.parametrize(
    ("arm", "flag"),
    [(fleet.RAM_STARVED, "225"), (fleet.RAM_ROOMY, "1800"), (DIRECT_NO_CACHE, "0")],
)
def test_direct_arms_run_the_server_with_their_cache_ram(arm: str, flag: str) -> None:
    made = fleet.make_fleet_arm(arm, env(), fleet.FleetOptions(), SIZE)
    assert isinstance(made, DirectArm) and made.name == arm
    cmd = made.command(8080)
    assert cmd[cmd.index("--cache-ram") + 1] == flag
    assert cmd[cmd.index("--ctx-size") + 1] == str(2 * 4096)


@pytest.mark.parametrize(("arm", "flag"), [(KVPROXY, "0"), (fleet.KVPROXY_RAM, "225")])
def test_proxy_arms_pass_their_cache_ram_to_the_server(arm: str, flag: str) -> None:
    made = fleet.make_fleet_arm(arm, env(), fleet.FleetOptions(), SIZE)
    assert isinstance(made, ProxyArm) and made.name == arm
    cmd = made.command(8080)
    server_flags = cmd[cmd.index("--") :]
    assert server_flags[server_flags.index("--cache-ram") + 1] == flag


def test_ctx_per_slot_holds_the_last_turn() -> None:
    assert fleet.FleetOptions().ctx_per_slot() == 4096
    assert fleet.FleetOptions(prompt_tokens=500, turns=2).ctx_per_slot() == 1024
    big = fleet.FleetOptions(prompt_tokens=10_000, turns=10)
    assert big.ctx_per_slot() >= 10_000 + 10 * (16 + fleet.GROWTH_BESIDES_REPLY)


def test_quantile_is_a_real_request() -> None:
    assert fleet.quantile([], 0.5) is None
    assert fleet.quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    values = [float(v) for v in range(1, 21)]
    assert fleet.quantile(values, 0.95) == 19.0
    assert fleet.quantile(values, 1.0) == 20.0
    assert fleet.quantile([5.0], 0.95) == 5.0


def row(arm: str, turn: int, cached: int, reusable: int, seconds: float) -> Row:
    return Row(
        case="paced",
        arm=arm,
        turn=turn,
        conversation=1,
        presented=reusable + 40,
        cached=cached,
        prefilled=reusable + 40 - cached,
        reusable=reusable,
        ideal=40,
        seconds=seconds,
        cache_state="-",
    )


def result() -> fleet.FleetResult:
    opts = fleet.FleetOptions(arms=(fleet.RAM_STARVED, KVPROXY))
    res = fleet.FleetResult(options=asdict(opts), sizing=asdict(SIZE))
    res.rows = [
        row(fleet.RAM_STARVED, 1, 0, 0, 30.0),
        row(fleet.RAM_STARVED, 2, 100, 3000, 20.0),
        row(fleet.RAM_STARVED, 2, 3000, 3000, 2.0),
        row(KVPROXY, 1, 0, 0, 30.0),
        row(KVPROXY, 2, 3000, 3000, 1.0),
        row(KVPROXY, 2, 3000, 3000, 1.2),
    ]
    res.wall_seconds = {fleet.RAM_STARVED: 80.0, KVPROXY: 70.0}
    return res


def test_summary_counts_later_turns_only() -> None:
    s = fleet.summarize(result().rows, KVPROXY)
    assert (s.requests, s.cached, s.reusable, s.errors) == (2, 6000, 6000, 0)
    assert s.pct_of_ideal == 1.0
    assert s.turn2_seconds == pytest.approx(2.2)
    starved = fleet.summarize(result().rows, fleet.RAM_STARVED)
    assert starved.pct_of_ideal == pytest.approx(3100 / 6000)
    assert (starved.p50, starved.p95) == (2.0, 20.0)


def test_table_has_every_arm_and_the_ratio_to_the_starved_cache() -> None:
    text = fleet.markdown(result())
    assert "16 conversations × 3 turns through 2 slots" in text
    assert "18.0 KiB/token" in text and "900 MiB" in text
    starved = next(ln for ln in text.splitlines() if ln.startswith("| RAM cache, ¼"))
    mine = next(ln for ln in text.splitlines() if ln.startswith("| kvproxy "))
    assert "225 MiB" in starved and "51.7%" in starved and "1.0×" in starved
    assert "off" in mine and "100.0%" in mine and "10.0×" in mine  # 22 s / 2.2 s


def test_fleet_arm_names_on_the_command_line() -> None:
    assert arms_of("kvproxy,ram-starved", fleet.FLEET_ARM_FLAGS) == (KVPROXY, fleet.RAM_STARVED)
    with pytest.raises(SystemExit):
        arms_of("ram-cache", fleet.FLEET_ARM_FLAGS)
