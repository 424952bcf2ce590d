"""`kvproxy bench SCENARIO`: workload, restore, overhead, load; chaos, agents, canonical,
servers, swaps, fleet, stalls, shared, fim, big and toolloop (not in `all`). The flags are
defined in kvproxy/cli/bench.py (parsing them imports nothing from here); `run` gets them.

Every run prints its command line, the machine, the llama-server build and the model, then a
table per scenario on stdout (progress on stderr). `--out DIR` writes `DIR/benchmarks.md`,
the plots under `DIR/img/`, and the raw results as `DIR/benchmarks.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from kvproxy.server.managed import default_models_dir
from kvproxy_bench import agents, load, overhead, restore, targets, workload
from kvproxy_bench.arms import ARM_FLAGS, BenchEnv
from kvproxy_bench.report import header, header_lines, progress, write_json

SCENARIOS = ("workload", "restore", "overhead", "load")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname).1s %(name)s: %(message)s")
    # The direct arms' llama-server lines would drown the tables (kvproxy's own arm logs to a
    # file in the work dir). Restored afterwards: `run` may be called in-process (tests).
    server_log = logging.getLogger("llama-server")
    propagate = server_log.propagate
    server_log.propagate = False
    try:
        return asyncio.run(_run(args))
    except KeyboardInterrupt:
        return 130
    except asyncio.CancelledError:  # SIGTERM or SIGHUP: every arm was stopped on the way out
        return 143
    finally:
        server_log.propagate = propagate


def _sizes(args: argparse.Namespace) -> tuple[int, ...]:
    if getattr(args, "sizes", None):
        return tuple(int(s) for s in args.sizes.split(","))
    sizes, size = [], 1024
    while size <= args.max_ctx:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The scenario flags among `names` that were given: the others keep their defaults."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def arms_of(text: str, flags: dict[str, str] = ARM_FLAGS) -> tuple[str, ...]:
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in flags]
    if unknown:
        raise SystemExit(f"kvproxy bench: unknown arm(s) {unknown}; known: {list(flags)}")
    return tuple(flags[a] for a in names)


async def _run(args: argparse.Namespace) -> int:
    # The arms' processes run in sessions of their own (so a kill of an arm reaches what it
    # started): a bench ended by a signal must stop them itself, as its Ctrl-C path does.
    loop, main = asyncio.get_running_loop(), asyncio.current_task()
    assert main is not None
    for sig in (signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, main.cancel)
    workdir = args.workdir or Path(await asyncio.to_thread(tempfile.mkdtemp, "", "kvproxy-bench-"))
    await asyncio.to_thread(workdir.mkdir, 0o700, True, True)
    if args.model == args.big_model:  # the name kvproxy/cli/bench.py gives it
        from kvproxy_bench.ggufmodels import big_model_file

        args.model = str(await asyncio.to_thread(big_model_file, default_models_dir()))
    if getattr(args, "kv_type", None):
        args.server_args = [*args.server_args, "-ctk", args.kv_type, "-ctv", args.kv_type]
    if getattr(args, "flash_attn", None):
        args.server_args = [*args.server_args, "--flash-attn", args.flash_attn]
    env = await asyncio.to_thread(
        BenchEnv.create, workdir, args.model, args.server_bin, args.threads, args.server_args
    )
    if args.scenario == "servers" and args.threads is None:
        # Each server its share of the cores, as servers with a GPU each would have.
        most = max(int(n) for n in (args.servers or "1,2").split(","))
        env.threads = max(1, (os.cpu_count() or 2) // most)
    argv = ["kvproxy", *args.argv]
    head = await asyncio.to_thread(header, env, argv[1:])
    head["command"] = shlex.join(argv)
    print("\n".join(header_lines(head)) + "\n", flush=True)

    chosen = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results: dict[str, Any] = {}
    checks: list[targets.Check] = []
    try:
        for k, name in enumerate(chosen, 1):
            started = time.monotonic()
            progress(f"{name} ({k}/{len(chosen)})")
            if name == "workload":
                wopts = workload.WorkloadOptions(restart=True)
                if args.scenario == "workload":
                    given = _given(
                        args, "conversations", "turns", "slots", "prompt_tokens", "max_tokens"
                    )
                    wopts = workload.WorkloadOptions(**given, restart=args.restart)
                    if args.arms is not None:
                        wopts.arms = arms_of(args.arms)
                res: Any = await workload.run_workload(env, wopts)
                text = workload.markdown(res)
                checks += targets.workload_checks(res)
            elif name == "fleet":
                from kvproxy_bench import fleet

                fopts = fleet.FleetOptions(
                    **_given(args, "conversations", "turns", "slots", "prompt_tokens", "max_tokens")
                )
                if args.arms is not None:
                    fopts.arms = arms_of(args.arms, fleet.FLEET_ARM_FLAGS)
                res = await fleet.run_fleet(env, fopts)
                text = fleet.markdown(res)
            elif name == "stalls":
                from kvproxy_bench import stalls

                stopts = stalls.StallsOptions(
                    **_given(
                        args,
                        *("conversations", "slots", "prompt_tokens", "stream_tokens"),
                        "max_tokens",
                    )
                )
                if args.arms is not None:
                    stopts.arms = arms_of(args.arms, stalls.STALLS_ARM_FLAGS)
                res = await stalls.run_stalls(env, stopts)
                text = stalls.markdown(res)
            elif name == "restore":
                ropts = restore.RestoreOptions(sizes=_sizes(args))
                if args.scenario == "restore" and args.repeats is not None:
                    ropts.repeats = args.repeats
                res = await restore.run_restore(env, ropts)
                text = restore.markdown(res)
                checks += targets.restore_checks(res)
            elif name == "overhead":
                oopts = overhead.OverheadOptions()
                if args.scenario == "overhead":
                    oopts = overhead.OverheadOptions(**_given(args, "requests", "sse_events"))
                res = await overhead.run_overhead(env, oopts)
                text = overhead.markdown(res)
                checks += targets.overhead_checks(res)
            elif name == "chaos":
                from kvproxy_bench import chaos, chaos_records, chaos_report

                flags = (
                    *("seed", "requests", "faults", "duration", "clients", "tenants"),
                    *("conversations", "slow_clients", "latency_requests", "full_disk"),
                    *("disk_mib", "full_for", "timing_pairs", "servers"),
                )
                copts = chaos_records.ChaosOptions(**_given(args, *flags))
                res = await chaos.run_chaos(env, copts)
                text = chaos_report.markdown(res)
                checks += chaos_report.checks(res)
            elif name == "canonical":
                from kvproxy_bench import canonical_cost as canonical

                kopts = canonical.CanonicalOptions(**_given(args, "repeats"))
                if args.sizes:
                    kopts.sizes = _sizes(args)
                res = await canonical.run_canonical(env, kopts)
                text = canonical.markdown(res)
            elif name == "big":
                from kvproxy_bench import big, big_report

                bopts = big.BigOptions(
                    **_given(args, "slots", "others_tokens", "stream_tokens", "max_tokens")
                )
                if args.sizes:
                    bopts.sizes = _sizes(args)
                if args.arms is not None:
                    bopts.arms = arms_of(args.arms, big.BIG_ARM_FLAGS)
                res = await big.run_big(env, bopts)
                text = big_report.markdown(res)
                checks += big_report.checks(res)
            elif name == "toolloop":
                from kvproxy_bench import toolloop

                topts = toolloop.ToolLoopOptions(
                    **_given(
                        args,
                        *("loops", "slots", "newcomers", "prompt_tokens", "newcomer_tokens"),
                        *("tool_seconds", "at_once", "max_tokens"),
                    )
                )
                if args.arms is not None:
                    topts.arms = arms_of(args.arms, toolloop.TOOLLOOP_ARM_FLAGS)
                res = await toolloop.run_toolloop(env, topts)
                text = toolloop.markdown(res)
            elif name == "servers":
                from kvproxy_bench import servers

                sopts = servers.ServersOptions(
                    **_given(args, "conversations", "turns", "clients", "slots", "prompt_tokens")
                )
                if args.servers:
                    sopts.servers = tuple(int(n) for n in args.servers.split(","))
                sopts.direct = not args.no_direct
                res = await servers.run_servers(env, sopts)
                text = servers.markdown(res)
            elif name == "shared":
                from kvproxy_bench import shared

                shopts = shared.SharedOptions(
                    **_given(
                        args,
                        *("sessions", "turns", "subagents", "slots", "prompt_tokens"),
                        "max_tokens",
                    )
                )
                res = await shared.run_shared(env, shopts)
                text = shared.markdown(res)
            elif name == "fim":
                from kvproxy_bench import fim_replay

                fiopts = fim_replay.FimOptions(
                    **_given(
                        args,
                        *("edits", "n_predict", "returning", "slots", "seed"),
                        *("file_lines", "ctx_per_slot"),
                    )
                )
                res = await fim_replay.run_fim(env, fiopts)
                text = fim_replay.markdown(res)
            elif name == "swaps":
                from kvproxy_bench import swaps

                wsopts = swaps.SwapsOptions(**_given(args, "turns", "prompt_tokens"))
                res = await swaps.run_swaps(env, wsopts)
                text = swaps.markdown(res)
            elif name == "agents":
                aopts = agents.options(
                    _given(args, "max_output", "ctx_per_slot"), args.clients, args.cases
                )
                aopts.install = args.install
                aopts.plan = args.plan
                if args.arms is not None:
                    aopts.arms = arms_of(args.arms)
                res = await agents.run_agents(env, aopts)
                text = agents.markdown(res)
                checks += agents.checks(res)
            else:
                lopts = load.LoadOptions()
                if args.scenario == "load":
                    lopts = load.LoadOptions(
                        **_given(args, "clients", "conversations", "slots", "turns")
                    )
                    if args.arms is not None:
                        lopts.arms = arms_of(args.arms)
                res = await load.run_load(env, lopts)
                text = load.markdown(res)
                checks += targets.load_checks(res)
            results[name] = res
            progress(f"{name} done ({time.monotonic() - started:.0f} s)")
            print(f"## {name}\n\n{text}\n", flush=True)
        print("## targets\n\n" + targets.checks_markdown(checks) + "\n")
        if len(results) > 1:
            print("## summary\n\n" + targets.summary_table(results) + "\n")
        if args.out is not None:
            await asyncio.to_thread(write_outputs, args.out, head, results)
            progress(f"wrote {args.out / 'benchmarks.md'}")
    finally:
        if not args.keep:
            await asyncio.to_thread(shutil.rmtree, workdir, True)
        else:
            progress(f"work dir kept: {workdir}")
    # chaos proves promises: any broken one is a failed command.
    return 1 if args.scenario == "chaos" and any(c.met is False for c in checks) else 0


def write_outputs(out: Path, head: dict[str, Any], results: dict[str, Any]) -> None:
    from kvproxy_bench.document import document

    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, str] = {}
    if "workload" in results:
        workload.plot(results["workload"], out / "img" / "workload.png")
        images["workload"] = "img/workload.png"
    if "restore" in results:
        restore.plot(results["restore"], out / "img" / "restore.png")
        images["restore"] = "img/restore.png"
    if "big" in results:
        from kvproxy_bench import big_report

        big_report.plot(results["big"], out / "img" / "big.png")
        images["big"] = "img/big.png"
    (out / "benchmarks.md").write_text(document(head, results, images), encoding="utf-8")
    write_json(
        out / "benchmarks.json",
        {"header": head, **{name: r.to_json() for name, r in results.items()}},
    )
