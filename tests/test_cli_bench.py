"""`kvproxy bench` stays a full command, yet no other command loads a benchmark module: `serve`
runs without kvproxy_bench (nor the fake llama-server of kvproxy_fake) in memory.

What a command imports is checked in a fresh interpreter: this one has imported the
benchmarks for other tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvproxy import cli
from kvproxy.server.leftover import running

from .fakeserver import FakeLlamaServer

PACKAGE = Path(cli.__file__).parent
NOT_AT_RUNTIME = ("kvproxy_bench", "kvproxy_fake")

# Runs `kvproxy serve ARGS…` as the console script does; once the proxy is listening (its
# "ready" line), prints the kvproxy_bench / kvproxy_fake modules loaded and exits at once.
SERVE_UNTIL_READY = """
import json, logging, os, sys
from kvproxy import cli

class Ready(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("kvproxy ready"):
            loaded = [m for m in sys.modules if m.startswith(("kvproxy_bench", "kvproxy_fake"))]
            print(json.dumps(sorted(loaded)), flush=True)
            os._exit(0)

logging.getLogger("kvproxy").addHandler(Ready())
sys.exit(cli.main(sys.argv[1:]))
"""


async def test_serve_loads_no_benchmark_module(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    async with FakeLlamaServer(slot_save_path=tmp_path) as fake:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            SERVE_UNTIL_READY,
            *("serve", "--upstream", fake.url, "--port", "0", "--cache-dir", str(tmp_path)),
            *("--log-level", "info"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0 and out, err.decode()
    assert json.loads(out) == []


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_bench_help_lists_the_scenarios(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(["bench", "--help"], capsys)
    for scenario in (
        "workload",
        "restore",
        "overhead",
        "load",
        "chaos",
        "store",
        "canonical",
        "shared",
        "fim",
        "all",
    ):
        assert scenario in text


@pytest.mark.parametrize(
    ("scenario", "flags"),
    [
        ("workload", ["--conversations", "--turns", "--slots", "--prompt-tokens", "--restart"]),
        ("restore", ["--max-ctx", "--sizes", "--repeats"]),
        ("overhead", ["--requests", "--sse-events"]),
        ("load", ["--clients", "--conversations", "--slots", "--turns", "--arms"]),
        ("all", ["--max-ctx"]),
        ("chaos", ["--seed", "--requests", "--faults", "--duration", "--clients", "--tenants"]),
        ("canonical", ["--sizes", "--repeats"]),
        ("shared", ["--sessions", "--turns", "--subagents", "--slots", "--prompt-tokens"]),
        ("fim", ["--edits", "--n-predict", "--returning", "--slots", "--seed"]),
    ],
)
def test_bench_scenario_help_lists_its_flags(
    scenario: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    text = _help(["bench", scenario, "--help"], capsys)
    for flag in [*flags, "--model", "--server-bin", "--threads", "--out", "--workdir", "--keep"]:
        assert flag in text


def test_bench_flags_left_out_keep_the_scenario_defaults() -> None:
    """None means "the options dataclass decides": the defaults are written down once."""
    args = cli.build_parser().parse_args(["bench", "overhead", "--requests", "7"])
    assert (args.requests, args.sse_events, args.func.__module__) == (7, None, "kvproxy.cli.bench")


def test_arms_are_named_by_flag_words() -> None:
    """The arms' names have commas in them; `--arms` is comma-separated, so it takes words."""
    from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY
    from kvproxy_bench.command import arms_of

    assert arms_of("ram-cache, kvproxy") == (DIRECT_RAM_CACHE, KVPROXY)
    with pytest.raises(SystemExit, match="no-cache"):
        arms_of("direct, no cache")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_bytes()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.real
def test_a_bench_ended_by_sigterm_stops_what_it_started(tmp_path: Path) -> None:
    """Its helper processes run in sessions of their own: without the bench stopping them,
    a SIGTERM would leave the fake server and kvproxy running."""
    err = tmp_path / "stderr"
    with open(err, "w") as out:
        bench = subprocess.Popen(
            [sys.executable, "-m", "kvproxy", "bench", "overhead", "--requests", "1000000"],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 120
        while "overhead: cache on" not in err.read_text():
            assert bench.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.2)
        time.sleep(1)
        started = _children(bench.pid)
        assert len(started) >= 2, started  # the fake server and kvproxy
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(60) == 143
        assert [pid for pid in started if running(pid) is not None] == []
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
