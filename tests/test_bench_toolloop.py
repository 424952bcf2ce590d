"""`kvproxy bench toolloop`'s pure parts: each arm's command (the one without the rule really
turns it off), the tool calls a stream's deltas make, and the table's medians and ratios — on
plain data."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvproxy_bench import toolloop
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.command import arms_of
from kvproxy_bench.toolcalls import add_call_deltas, reply_of, with_result

from kvproxy.cli import build_parser
from kvproxy.server.modelinfo import ModelInfo


def env() -> BenchEnv:
    info = ModelInfo(Path("/m.gguf"), architecture="gemma3", n_swa=512, has_swa=True)
    return BenchEnv(Path("/bin/llama-server"), Path("/m.gguf"), info, Path("/tmp/w"), 2)


def test_the_arm_without_the_rule_passes_tool_result_within_0_and_the_default_none() -> None:
    opts = toolloop.ToolLoopOptions()
    without = toolloop.make_toolloop_arm(toolloop.KVPROXY_NO_RULE, env(), opts)
    default = toolloop.make_toolloop_arm(KVPROXY, env(), opts)
    alone = toolloop.make_toolloop_arm(DIRECT_RAM_CACHE, env(), opts)
    assert isinstance(without, ProxyArm) and isinstance(default, ProxyArm)
    cmd = without.command(8080)
    # A kvproxy flag: before the `--` that starts llama-server's.
    assert cmd.index("--tool-result-within") < cmd.index("--")
    assert cmd[cmd.index("--tool-result-within") + 1] == "0"
    assert "--tool-result-within" not in default.command(8080)
    assert without.name != default.name
    assert isinstance(alone, DirectArm) and alone.ram_cache and alone.slots == 2
    assert "--tool-result-within" not in alone.command(8080)
    flags = arms_of("no-rule,ram-cache,kvproxy", toolloop.TOOLLOOP_ARM_FLAGS)
    assert flags == (toolloop.KVPROXY_NO_RULE, DIRECT_RAM_CACHE, KVPROXY)


def test_newcomers_are_as_many_as_slots_unless_given_and_the_context_fits_the_loops() -> None:
    assert toolloop.ToolLoopOptions(slots=3).n_newcomers == 3
    assert toolloop.ToolLoopOptions(slots=3, newcomers=1).n_newcomers == 1
    assert toolloop.ToolLoopOptions(prompt_tokens=3000).ctx_per_slot == 4352
    assert toolloop.ToolLoopOptions(prompt_tokens=500).ctx_per_slot == 4096


def test_a_streamed_tool_call_is_assembled_and_echoed_with_its_result() -> None:
    calls: list[dict[str, object]] = []
    # As llama-server streams one: id, type and name first, the arguments in pieces.
    add_call_deltas(
        calls,
        [
            {
                "index": 0,
                "id": "abc",
                "type": "function",
                "function": {"name": "read_file", "arguments": "{"},
            }
        ],
    )
    add_call_deltas(calls, [{"index": 0, "function": {"arguments": "}"}}])
    assert calls == [
        {"id": "abc", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    ]
    messages = with_result([{"role": "user", "content": "Read it."}], reply_of("", calls), "text")
    assert messages[1] == {"role": "assistant", "content": None, "tool_calls": calls}
    assert messages[2] == {"role": "tool", "tool_call_id": "abc", "content": "text"}


def turn(arm: str, loop: int, ttft: float, state: str = "-", error: str | None = None) -> Any:
    return toolloop.ResultTurn(arm, loop, ttft, 3000, 20, state, error)


def test_the_table_gives_medians_labels_and_ratios_to_the_server_and_to_the_arm_without() -> None:
    runs = [
        toolloop.ArmRun(
            KVPROXY,
            3100,
            [turn(KVPROXY, 1, 0.2, "resident"), turn(KVPROXY, 2, 0.4, "resident")],
            prefetches=1,
        ),
        toolloop.ArmRun(
            toolloop.KVPROXY_NO_RULE,
            3100,
            [
                turn(toolloop.KVPROXY_NO_RULE, 1, 0.6, "restored"),
                turn(toolloop.KVPROXY_NO_RULE, 2, 0.6, "restored"),
                turn(toolloop.KVPROXY_NO_RULE, 3, 9.0, "restored", "HTTP 503"),
            ],
            prefetches=0,
        ),
        toolloop.ArmRun(DIRECT_RAM_CACHE, 3100, [turn(DIRECT_RAM_CACHE, 1, 1.2)]),
    ]
    result = toolloop.ToolLoopResult(asdict(toolloop.ToolLoopOptions()) | {"ctx_per_slot": 1}, runs)
    text = toolloop.markdown(result)
    summary = text.split("<details>")[0]
    rows = {ln.split("|")[1].strip(): ln for ln in summary.splitlines() if ln.startswith("|")}
    kv = [c.strip() for c in rows[KVPROXY].split("|")[1:-1]]
    # median 0.3 s: 4× faster than the server alone's 1.2 s, 2× than without the rule's 0.6 s
    assert kv[2] == "0.3" and kv[3] == "0.4"
    assert kv[6] == "resident 2" and kv[7] == "1"
    assert kv[8] == "4.00×" and kv[9] == "2.00×"
    off = [c.strip() for c in rows[toolloop.KVPROXY_NO_RULE].split("|")[1:-1]]
    assert off[1] == "2" and off[2] == "0.6" and off[-1] == "1"  # the failed turn left out
    assert off[6] == "restored 2" and off[9] == "1.00×"
    alone = [c.strip() for c in rows[DIRECT_RAM_CACHE].split("|")[1:-1]]
    assert alone[6] == "—" and alone[7] == "—" and alone[8] == "1.00×"
    assert "3,100 tokens" in text


def test_the_command_line_takes_the_toolloop_flags() -> None:
    args = build_parser().parse_args(
        ["bench", "toolloop", "--loops", "3", "--tool-seconds", "1.5", "--arms", "no-rule"]
    )
    assert (args.loops, args.tool_seconds, args.arms, args.slots) == (3, 1.5, "no-rule", None)
    assert args.at_once is None  # the options' default
    assert build_parser().parse_args(["bench", "toolloop", "--at-once"]).at_once is True


def test_out_writes_the_toolloop_section(tmp_path: Path) -> None:
    from kvproxy_bench.command import write_outputs

    head = {
        "command": "kvproxy bench toolloop",
        "date": "2026-12-06 07:23 UTC",
        "machine": {"cpu": "x", "cores": 2, "ram_gib": 1.0, "os": "Linux", "python": "3.11"},
        "llama_server": {"build": "b", "binary": "/bin/llama-server"},
        "model": {"path": "/m.gguf", "bytes": 1, "architecture": "gemma3", "class": "swa"},
        "server_flags": ["--threads", "1"],
    }
    run = toolloop.ArmRun(KVPROXY, 3006, [turn(KVPROXY, 1, 0.5, "resident")], prefetches=0)
    result = toolloop.ToolLoopResult(
        asdict(toolloop.ToolLoopOptions()) | {"ctx_per_slot": 1}, [run]
    )
    write_outputs(tmp_path, head, {"toolloop": result})
    text = (tmp_path / "benchmarks.md").read_text()
    assert "## toolloop" in text and "resident 1" in text
    assert (tmp_path / "benchmarks.json").exists()
