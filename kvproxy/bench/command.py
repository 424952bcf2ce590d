"""`kvproxy bench SCENARIO`: workload, restore, overhead, load, or all of them.

Every run prints its command line, the machine, the llama-server build and the model, then a
table per scenario on stdout (progress on stderr). `--out DIR` writes `DIR/benchmarks.md`,
the plots under `DIR/img/`, and the raw results as `DIR/benchmarks.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shlex
import shutil
import tempfile
from pathlib import Path
from typing import Any

from . import load, overhead, restore, targets, workload
from .arms import ALL_ARMS, KVPROXY, BenchEnv
from .report import header, header_lines, progress, write_json

SCENARIOS = ("workload", "restore", "overhead", "load")


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
    d = workload.WorkloadOptions()
    p.add_argument("--conversations", type=int, default=d.conversations, help="N")
    p.add_argument("--turns", type=int, default=d.turns, help="T")
    p.add_argument("--slots", type=int, default=d.slots, help="S")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="reply length")
    p.add_argument("--restart", action="store_true", help="add the case with restarts")
    p.add_argument("--arms", default=",".join(ALL_ARMS), help="comma-separated arms")

    p = scenarios.add_parser("restore", help="TTFT restored vs re-prefilled, by size")
    _common(p)
    p.add_argument("--max-ctx", type=int, default=8192, help="largest size (1k, 2k, … up to it)")
    p.add_argument("--sizes", default=None, help="comma-separated sizes instead")
    p.add_argument("--repeats", type=int, default=restore.RestoreOptions.repeats)

    p = scenarios.add_parser("overhead", help="the proxy's own cost on a fake upstream")
    _common(p)
    o = overhead.OverheadOptions()
    p.add_argument("--requests", type=int, default=o.requests, help="small requests per path")
    p.add_argument("--sse-events", type=int, default=o.sse_events)

    p = scenarios.add_parser("load", help="C clients × M conversations through S slots")
    _common(p)
    lo = load.LoadOptions()
    p.add_argument("--clients", type=int, default=lo.clients, help="C")
    p.add_argument("--conversations", type=int, default=lo.conversations, help="M")
    p.add_argument("--slots", type=int, default=lo.slots, help="S")
    p.add_argument("--turns", type=int, default=lo.turns)
    p.add_argument("--arms", default=KVPROXY, help="comma-separated arms")

    p = scenarios.add_parser("all", help="every scenario with its defaults (workload --restart)")
    _common(p)
    p.add_argument("--max-ctx", type=int, default=8192, help="restore: largest size")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="GGUF path (default: bundled Gemma 3 270M)")
    p.add_argument("--server-bin", type=Path, default=None, help="llama-server binary")
    p.add_argument("--threads", type=int, default=None, help="llama-server --threads (all cores)")
    p.add_argument("--out", type=Path, default=None, help="write benchmarks.md, img/, json here")
    p.add_argument("--workdir", type=Path, default=None, help="cache dirs and logs (temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.set_defaults(func=run, server_args=[])


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


def _arms(text: str) -> tuple[str, ...]:
    arms = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise SystemExit(f"kvproxy bench: unknown arm(s) {unknown}; known: {list(ALL_ARMS)}")
    return arms


async def _run(args: argparse.Namespace) -> int:
    workdir = args.workdir or Path(await asyncio.to_thread(tempfile.mkdtemp, "", "kvproxy-bench-"))
    await asyncio.to_thread(workdir.mkdir, 0o700, True, True)
    env = await asyncio.to_thread(
        BenchEnv.create, workdir, args.model, args.server_bin, args.threads, args.server_args
    )
    argv = ["kvproxy", *args.argv]
    head = await asyncio.to_thread(header, env, argv[1:])
    head["command"] = shlex.join(argv)
    print("\n".join(header_lines(head)) + "\n", flush=True)

    chosen = SCENARIOS if args.scenario == "all" else (args.scenario,)
    results: dict[str, Any] = {}
    checks: list[targets.Check] = []
    try:
        for name in chosen:
            if name == "workload":
                wopts = workload.WorkloadOptions(restart=True)
                if args.scenario == "workload":
                    wopts = workload.WorkloadOptions(
                        conversations=args.conversations,
                        turns=args.turns,
                        slots=args.slots,
                        prompt_tokens=args.prompt_tokens,
                        max_tokens=args.max_tokens,
                        restart=args.restart,
                        arms=_arms(args.arms),
                    )
                res: Any = await workload.run_workload(env, wopts)
                text = workload.markdown(res)
                checks += targets.workload_checks(res)
            elif name == "restore":
                ropts = restore.RestoreOptions(sizes=_sizes(args))
                if args.scenario == "restore":
                    ropts.repeats = args.repeats
                res = await restore.run_restore(env, ropts)
                text = restore.markdown(res)
                checks += targets.restore_checks(res)
            elif name == "overhead":
                oopts = overhead.OverheadOptions()
                if args.scenario == "overhead":
                    oopts.requests, oopts.sse_events = args.requests, args.sse_events
                res = await overhead.run_overhead(env, oopts)
                text = overhead.markdown(res)
                checks += targets.overhead_checks(res)
            else:
                lopts = load.LoadOptions()
                if args.scenario == "load":
                    lopts = load.LoadOptions(
                        clients=args.clients,
                        conversations=args.conversations,
                        slots=args.slots,
                        turns=args.turns,
                        arms=_arms(args.arms),
                    )
                res = await load.run_load(env, lopts)
                text = load.markdown(res)
                checks += targets.load_checks(res)
            results[name] = res
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
    return 0


def write_outputs(out: Path, head: dict[str, Any], results: dict[str, Any]) -> None:
    from .document import document

    out.mkdir(parents=True, exist_ok=True)
    images: dict[str, str] = {}
    if "workload" in results:
        workload.plot(results["workload"], out / "img" / "workload.png")
        images["workload"] = "img/workload.png"
    if "restore" in results:
        restore.plot(results["restore"], out / "img" / "restore.png")
        images["restore"] = "img/restore.png"
    (out / "benchmarks.md").write_text(document(head, results, images), encoding="utf-8")
    write_json(
        out / "benchmarks.json",
        {"header": head, **{name: r.to_json() for name, r in results.items()}},
    )
