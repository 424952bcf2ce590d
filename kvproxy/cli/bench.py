"""`kvproxy bench`'s command line, kept out of kvproxy_bench so that building the parser (which
every `kvproxy` command does) imports no benchmark module: `serve` never loads them.

Invariant: this module imports nothing from kvproxy_bench at module level; the benchmarks load
when `bench` runs. A scenario flag left out is None and means that scenario's own default (its
options dataclass in kvproxy_bench), so the defaults live in one place.
"""

from __future__ import annotations

import argparse
from pathlib import Path

MAX_CTX = 8192  # restore and all: the largest size (1k, 2k, … up to it)
# `bench big`'s default model: a random-weight GGUF with an 8B's KV geometry, written once
# into kvproxy's models dir (kvproxy_bench.ggufmodels). Handed to the benchmarks as data
# (`args.big_model`): they import nothing from here.
BIG_MODEL = "big"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks: kvproxy vs llama-server's RAM cache vs no cache",
        description=(
            "Run the same work through llama-server without a cache, with its RAM prompt "
            "cache, and through kvproxy; print tables and ratios. Starts its own servers. "
            "Flags after `--` go to every llama-server."
        ),
    )
    scenarios = bench.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")

    p = scenarios.add_parser("workload", help="N conversations × T turns through S slots")
    _common(p)
    p.add_argument("--conversations", type=int, help="N")
    p.add_argument("--turns", type=int, help="T")
    p.add_argument("--slots", type=int, help="S")
    p.add_argument("--prompt-tokens", type=int, help="system prompt")
    p.add_argument("--max-tokens", type=int, help="reply length")
    p.add_argument("--restart", action="store_true", help="add the case with restarts")
    p.add_argument("--arms", help="comma-separated: no-cache, ram-cache, kvproxy")

    p = scenarios.add_parser(
        "fleet", help="agent conversations beyond the server's RAM cache, through few slots"
    )
    _common(p)
    p.add_argument("--conversations", type=int, help="N (default 16)")
    p.add_argument("--turns", type=int, help="T (default 3)")
    p.add_argument("--slots", type=int, help="S (default 2)")
    p.add_argument("--prompt-tokens", type=int, help="system prompt of each (default 3000)")
    p.add_argument("--max-tokens", type=int, help="reply length")
    p.add_argument(
        "--arms", help="comma-separated: no-cache, ram-starved, ram-room, kvproxy, kvproxy-ram"
    )

    p = scenarios.add_parser(
        "stalls", help="a token stream's gaps while kvproxy saves and restores on another slot"
    )
    _common(p)
    p.add_argument("--conversations", type=int, help="the others, on the other slots (default 3)")
    p.add_argument("--slots", type=int, help="the server's slots (default 2)")
    p.add_argument("--prompt-tokens", type=int, help="system prompt of each other (default 3000)")
    p.add_argument("--stream-tokens", type=int, help="the stream's length (default 256)")
    p.add_argument("--max-tokens", type=int, help="the others' reply length")
    p.add_argument("--arms", help="comma-separated: kvproxy, at-once, ram-cache")

    p = scenarios.add_parser("restore", help="TTFT restored vs re-prefilled, by size")
    _common(p)
    p.add_argument("--max-ctx", type=int, default=MAX_CTX, help="largest size (1k, 2k, … up to it)")
    p.add_argument("--sizes", default=None, help="comma-separated sizes instead")
    p.add_argument("--repeats", type=int)

    p = scenarios.add_parser("overhead", help="the proxy's own cost on a fake upstream")
    _common(p)
    p.add_argument("--requests", type=int, help="small requests per path")
    p.add_argument("--sse-events", type=int)

    p = scenarios.add_parser("load", help="C clients × M conversations through S slots")
    _common(p)
    p.add_argument("--clients", type=int, help="C")
    p.add_argument("--conversations", type=int, help="M")
    p.add_argument("--slots", type=int, help="S")
    p.add_argument("--turns", type=int)
    p.add_argument("--arms", help="comma-separated: no-cache, ram-cache, kvproxy")

    p = scenarios.add_parser("store", help="the disk index at N entries (no llama-server)")
    p.add_argument("--entries", type=int, help="N (default 10,000)")
    p.add_argument("--workdir", type=Path, default=None, help="the synthetic cache (temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.set_defaults(func=run)

    p = scenarios.add_parser("chaos", help="mixed load, SIGKILLs of kvproxy and the server, audit")
    _common(p)
    p.add_argument("--seed", type=int, help="seeds every random choice")
    p.add_argument("--requests", type=int, help="at least this many answered requests")
    p.add_argument("--faults", type=int, help="SIGKILLs, of kvproxy and the server in turn")
    p.add_argument("--duration", type=float, help="hard bound on the workload, seconds")
    p.add_argument("--clients", type=int)
    p.add_argument("--tenants", type=int, help="API keys")
    p.add_argument("--conversations", type=int)
    p.add_argument("--slow-clients", type=int, help="slowloris connections through the run")
    p.add_argument("--latency-requests", type=int, help="per phase: without, with slow clients")
    p.add_argument(
        "--full-disk", action="store_true", default=None, help="fill the cache disk mid-run (root)"
    )
    p.add_argument("--disk-mib", type=int, help="the cache dir's tmpfs for --full-disk")
    p.add_argument("--full-for", type=int, help="answered requests the disk stays full")
    p.add_argument("--timing-pairs", type=int, help="cross-tenant timing probes at the end")
    p.add_argument(
        "--servers", type=int, help="llama-servers behind kvproxy (a server fault kills one)"
    )

    p = scenarios.add_parser("agents", help="the real agents' turns: kvproxy vs the server alone")
    _common(p)
    p.add_argument("--clients", help="comma-separated: sdk,codex,claude,openclaw (installed)")
    p.add_argument("--install", action="store_true", help="install the missing agents first")
    p.add_argument(
        "--cases",
        help=(
            "comma-separated: interrupted,date-change,date-in-a-sentence,two-agents "
            "(default all; none: plan only)"
        ),
    )
    p.add_argument("--no-plan", dest="plan", action="store_false", help="the cases only")
    p.add_argument("--max-output", type=int, help="reply cap, tokens")
    p.add_argument("--ctx-size", type=int, dest="ctx_per_slot", help="context per slot")
    p.add_argument("--arms", help="comma-separated: no-cache, ram-cache, kvproxy")

    p = scenarios.add_parser(
        "servers", help="the same work through kvproxy with 1 and N llama-servers, one killed"
    )
    _common(p)
    p.add_argument("--servers", help="comma-separated server counts to compare (default 1,2)")
    p.add_argument("--conversations", type=int)
    p.add_argument("--turns", type=int, help="the last one follows a SIGKILL of a server")
    p.add_argument("--clients", type=int, help="clients sending at once")
    p.add_argument("--slots", type=int, help="slots per server")
    p.add_argument("--prompt-tokens", type=int, help="system prompt")
    p.add_argument("--no-direct", action="store_true", help="leave out llama-server alone")

    p = scenarios.add_parser(
        "swaps", help="two models on one router (--models-max 1), turns alternating"
    )
    _common(p)
    p.add_argument("--turns", type=int, help="turns per conversation")
    p.add_argument("--prompt-tokens", type=int, help="system prompt")

    p = scenarios.add_parser(
        "shared", help="agent sessions of one system prompt with sub-agent windows, a restart"
    )
    _common(p)
    p.add_argument("--sessions", type=int, help="main sessions at once (default 3)")
    p.add_argument("--turns", type=int, help="turns per main session (default 6)")
    p.add_argument("--subagents", type=int, help="sub-agent sessions per window (default 2)")
    p.add_argument("--slots", type=int, help="S (default 2)")
    p.add_argument("--prompt-tokens", type=int, help="the shared system prompt (default 1500)")
    p.add_argument("--max-tokens", type=int, help="reply length")

    p = scenarios.add_parser("fim", help="llama.vscode's editing session: /infill, OpenAI SDK")
    _common(p)
    p.add_argument("--edits", type=int, help="lines typed (default 12)")
    p.add_argument("--n-predict", type=int, help="completion length (default 8)")
    p.add_argument("--returning", type=int, help="completions sent again after the restart")
    p.add_argument("--slots", type=int, help="S (default 2)")
    p.add_argument("--seed", type=int, help="the session's choices")
    p.add_argument("--file-lines", type=int, help="lines of the edited file (default 400)")
    p.add_argument("--ctx-per-slot", type=int, help="context per slot (default 4096)")

    p = scenarios.add_parser("canonical", help="a save's canonical-prefix step, by size")
    _common(p)
    p.add_argument("--sizes", default=None, help="comma-separated sizes (1024,4096,8192)")
    p.add_argument("--repeats", type=int)

    p = scenarios.add_parser(
        "big", help="an 8B model's KV size (128 KiB a token): restores, saves, RSS, SIGTERM"
    )
    _common(p)
    p.set_defaults(model=BIG_MODEL)
    p.add_argument("--sizes", default=None, help="comma-separated tokens (default 2048)")
    p.add_argument("--slots", type=int, help="S (default 2)")
    p.add_argument("--others-tokens", type=int, help="the evicting conversations' cap (8192)")
    p.add_argument("--stream-tokens", type=int, help="the streams' length (default 512)")
    p.add_argument("--max-tokens", type=int, help="reply length (default 8)")
    p.add_argument(
        "--kv-type", default=None, help="KV cache type of every server (-ctk/-ctv), e.g. q8_0"
    )
    p.add_argument("--arms", help="comma-separated: ram-cache, kvproxy, no-cache")

    p = scenarios.add_parser(
        "toolloop", help="a tool result's TTFT while newcomers want the slots (Gemma, tools)"
    )
    _common(p)
    p.add_argument("--loops", type=int, help="tool calls of the agent (default 5)")
    p.add_argument("--slots", type=int, help="S (default 2)")
    p.add_argument("--newcomers", type=int, help="new conversations per call (default: S)")
    p.add_argument("--prompt-tokens", type=int, help="the agent's conversation (default 3000)")
    p.add_argument("--newcomer-tokens", type=int, help="each newcomer's prompt (default 100)")
    p.add_argument("--tool-seconds", type=float, help="the tool runs this long (default 2)")
    p.add_argument(
        "--at-once",
        action="store_true",
        default=None,
        help="the newcomers arrive together (one takes the agent's slot), not one by one",
    )
    p.add_argument("--max-tokens", type=int, help="the agent's reply cap (default 48)")
    p.add_argument("--arms", help="comma-separated: kvproxy, no-rule, ram-cache")

    p = scenarios.add_parser("all", help="every scenario with its defaults (workload --restart)")
    _common(p)
    p.add_argument("--max-ctx", type=int, default=MAX_CTX, help="restore: largest size")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="default",
        help="GGUF path (default: bundled Gemma 3 270M; big: the 8B-geometry model)",
    )
    p.add_argument("--server-bin", type=Path, default=None, help="llama-server binary")
    p.add_argument("--threads", type=int, default=None, help="llama-server --threads (all cores)")
    p.add_argument("--out", type=Path, default=None, help="write benchmarks.md, img/, json here")
    p.add_argument("--workdir", type=Path, default=None, help="cache dirs and logs (temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument(
        "--flash-attn",
        choices=("on", "off", "auto"),
        default=None,
        help="every server's --flash-attn (default: the server's own, auto)",
    )
    p.set_defaults(func=run, server_args=[], big_model=BIG_MODEL)


# The benchmarks are a distribution of their own (bench/, not on PyPI), so no extra of
# kvproxy's could install them: a wheel install gets this line instead of a traceback.
NOT_INSTALLED = (
    "kvproxy bench: the benchmarks are not installed (package kvproxy-bench, in kvproxy's "
    "source tree): from a checkout, run `make install` or `pip install -e ./bench`"
)


def run(args: argparse.Namespace) -> int:
    try:
        if args.scenario == "store":  # needs no model or llama-server: not bench.command's run
            from kvproxy_bench.index_scale import main

            return main(args)
        from kvproxy_bench.command import run as run_bench  # the benchmarks load here only
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "kvproxy_bench":
            raise
        raise SystemExit(NOT_INSTALLED) from None
    return run_bench(args)
