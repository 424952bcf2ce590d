"""`servers`: the same work through kvproxy with one llama-server and with several (managed
mode's `--servers N`, the same slots each), beside llama-server alone with its RAM cache.

C clients share N conversations (client i takes conversations i, i + C, …) and send T turns
each, all clients at once. Throughput is requests (and prompt tokens) per second of wall time
over turns 1..T-1. Before the last turn the states are saved (idle saves), then one server is
SIGKILLed (every kvproxy arm; llama-server alone would lose everything, so it is not killed):
the last turn shows what a dead server costs — with several servers the others restore its
conversations from the shared cache dir; with one, requests fail until managed mode has
started it again.

Each server gets `--threads` = the machine's cores / the most servers compared, so the arms
differ only in how many servers share the work, as servers with a GPU each would.
"% of ideal" as in `workload`: cache_n over the tokens any cache could serve (every earlier
turn as echoed), computed after the timed requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy_bench.arms import DIRECT_RAM_CACHE, Arm, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.report import pct, progress, table
from kvproxy_bench.workload import _reusable


@dataclass
class ServersOptions:
    conversations: int = 8
    turns: int = 3
    clients: int = 4
    slots: int = 2  # per server
    servers: tuple[int, ...] = (1, 2)
    prompt_tokens: int = 1000
    max_tokens: int = 16
    ctx_per_slot: int = 4096
    direct: bool = True  # llama-server alone (RAM cache) as the reference
    kill: bool = True  # SIGKILL a server before the last turn


@dataclass
class Request:
    arm: str
    turn: int
    conversation: int
    status: int
    cache_state: str
    cached: int
    prefilled: int
    seconds: float
    reusable: int = 0
    error: str | None = None


@dataclass
class ArmResult:
    arm: str
    servers: int
    wall_s: float  # turns before the last, all clients
    killed: str | None = None  # the server SIGKILLed before the last turn
    requests: list[Request] = field(default_factory=list)


@dataclass
class ServersResult:
    options: dict[str, Any]
    arms: list[ArmResult] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "arms": [asdict(a) for a in self.arms]}


def arm_label(servers: int) -> str:
    return f"kvproxy, {servers} server{'s' if servers > 1 else ''}"


async def run_servers(env: BenchEnv, opts: ServersOptions) -> ServersResult:
    result = ServersResult(options=asdict(opts))
    client = Client()
    try:
        if opts.direct:
            arm: Arm = DirectArm(env, opts.slots, opts.ctx_per_slot, ram_cache=True)
            progress(f"servers: {DIRECT_RAM_CACHE}")
            async with arm:
                result.arms.append(await _run_arm(client, arm, 1, opts, kill=False))
        for n in opts.servers:
            args = ["--servers", str(n), "--idle-save-after", "1"]
            arm = ProxyArm(env, opts.slots, opts.ctx_per_slot, args)
            arm.name = arm_label(n)
            progress(f"servers: {arm.name}")
            async with arm:
                result.arms.append(await _run_arm(client, arm, n, opts, kill=opts.kill))
    finally:
        await client.close()
    return result


async def _run_arm(
    client: Client, arm: Arm, servers: int, opts: ServersOptions, kill: bool
) -> ArmResult:
    n_facts = facts_for(opts.prompt_tokens)
    convs = {c: first_turn(c, n_facts) for c in range(1, opts.conversations + 1)}
    sent: dict[tuple[int, int], list[dict[str, Any]]] = {}
    out = ArmResult(arm.name, servers, 0.0)

    async def one_client(i: int, turn: int) -> None:
        for c in range(i + 1, opts.conversations + 1, opts.clients):
            messages = convs[c]
            reply = await client.chat(arm.url, messages, opts.max_tokens)
            sent[(turn, c)] = messages
            out.requests.append(
                Request(
                    arm.name,
                    turn,
                    c,
                    reply.status,
                    reply.cache_state,
                    reply.cache_n,
                    reply.prompt_n,
                    reply.seconds,
                    error=reply.error,
                )
            )
            progress(
                f"  turn {turn} conversation {c}: {reply.cache_n} cached, {reply.prompt_n} "
                f"prefilled, {reply.seconds:.2f}s {reply.cache_state}"
                + (f" ERROR {reply.error}" if reply.error else "")
            )
            if reply.ok:
                convs[c] = next_turn(messages, reply.content, turn + 1)

    async def one_turn(turn: int) -> None:
        await asyncio.gather(*(one_client(i, turn) for i in range(opts.clients)))

    began = time.perf_counter()
    for turn in range(1, opts.turns):
        await one_turn(turn)
    out.wall_s = time.perf_counter() - began
    if kill and isinstance(arm, ProxyArm):
        await _saved(arm, opts.conversations)
        out.killed = await _kill_one_server(arm)
        progress(f"  SIGKILLed llama-server {out.killed}")
    await one_turn(opts.turns)
    if isinstance(arm, ProxyArm):
        await _all_back(arm, servers)
    for request in out.requests:
        if request.turn > 1 and request.status == 200:
            request.reusable = await _reusable(
                client, arm.url, sent[(request.turn, request.conversation)]
            )
    return out


async def _saved(arm: ProxyArm, conversations: int, timeout: float = 120.0) -> None:
    """Until every slot's conversation is on disk (idle saves), as a while after the turns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = await arm.stats()
        if all(s["saved"] or not s["n_tokens"] for s in stats["slots"]) and stats["entries"]:
            return
        await asyncio.sleep(0.5)
    progress("  (not every slot was saved in time)")


async def _kill_one_server(arm: ProxyArm) -> str | None:
    """SIGKILL the first of the arm's llama-servers (found by its cache dir and port)."""
    stats = await arm.stats()
    name = str(stats["backends"][0]["name"])
    port = name.rsplit(":", 1)[1]
    pid = await asyncio.to_thread(_server_pid, arm.cache_dir, port)
    if pid is None:
        return None
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return name


def _server_pid(cache_dir: Path, port: str) -> int | None:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = [a.decode() for a in (entry / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if "--slot-save-path" in argv and str(cache_dir) in argv and port in argv:
            return int(entry.name)
    return None


async def _all_back(arm: ProxyArm, servers: int, timeout: float = 300.0) -> None:
    """Until managed mode has started the killed server again and kvproxy has it back in
    rotation (the token counts afterwards need a server)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            stats = await arm.stats()
            up = [b for b in stats["backends"] if b["enabled"] and not b["down"]]
            async with (
                aiohttp.ClientSession() as session,
                session.get(arm.url + "/health") as resp,
            ):
                if resp.status == 200 and len(up) == servers:
                    return
        await asyncio.sleep(0.5)


@dataclass
class ArmSummary:
    arm: str
    servers: int
    requests_per_s: float
    tokens_per_s: float
    later_pct: str | None  # turns 2..T-1
    last_ok: int
    last_requests: int
    last_restored: int
    last_pct: str | None
    errors_before: int


def summarize(result: ServersResult) -> list[ArmSummary]:
    turns = int(result.options["turns"])
    out = []
    for arm in result.arms:
        before = [r for r in arm.requests if r.turn < turns]
        later = [r for r in before if r.turn > 1]
        last = [r for r in arm.requests if r.turn == turns]
        tokens = sum(r.cached + r.prefilled for r in before)
        out.append(
            ArmSummary(
                arm=arm.arm,
                servers=arm.servers,
                requests_per_s=len(before) / arm.wall_s if arm.wall_s else 0.0,
                tokens_per_s=tokens / arm.wall_s if arm.wall_s else 0.0,
                later_pct=pct(sum(r.cached for r in later), sum(r.reusable for r in later)),
                last_ok=sum(1 for r in last if r.status == 200),
                last_requests=len(last),
                last_restored=sum(1 for r in last if r.cache_state == "restored"),
                last_pct=pct(
                    sum(r.cached for r in last if r.status == 200),
                    sum(r.reusable for r in last if r.status == 200),
                ),
                errors_before=sum(1 for r in before if r.status != 200),
            )
        )
    return out


def markdown(result: ServersResult) -> str:
    opts = ServersOptions(**{**result.options, "servers": tuple(result.options["servers"])})
    summaries = summarize(result)
    one = next((s for s in summaries if s.servers == 1 and s.arm != DIRECT_RAM_CACHE), None)
    rows = []
    killed = {a.arm: a.killed for a in result.arms}
    for s in summaries:
        ratio = (
            f"{s.requests_per_s / one.requests_per_s:.2f}×"
            if one is not None and one.requests_per_s and s.arm != DIRECT_RAM_CACHE
            else None
        )
        rows.append(
            [
                s.arm,
                f"{s.requests_per_s:.2f}",
                round(s.tokens_per_s),
                ratio,
                s.later_pct,
                s.errors_before,
                "killed one" if killed.get(s.arm) else "none killed",
                f"{s.last_ok}/{s.last_requests}",
                s.last_restored,
                s.last_pct,
            ]
        )
    cols = [
        "arm",
        "requests/s",
        "prompt tok/s",
        "vs 1 server",
        ("turn 2" if opts.turns == 3 else f"turns 2–{opts.turns - 1}") + ": % of ideal",
        "errors",
        f"before turn {opts.turns}",
        f"turn {opts.turns}: 200s",
        "restored",
        "% of ideal",
    ]
    head = (
        f"{opts.conversations} conversations × {opts.turns} turns from {opts.clients} clients "
        f"at once, {opts.slots} slots per server; before turn {opts.turns} every slot is saved "
        "and one llama-server is SIGKILLed (not llama-server alone)."
    )
    return f"{head}\n\n{table(cols, rows)}"
