"""`fleet`: a working set beyond the server's RAM. Many conversations at an agent's pace
(workload's agent-paced case: tool-result turns, seeded 0.5–3 s gaps, the same requests in
every arm) through few slots, with llama-server's RAM prompt cache given a quarter of the
working set's KV bytes — a 30B model's 10k-token conversations on a 64 GB box, scaled to the
bundled model.

The working set is sized from a real save first: one conversation's first turn on a one-slot
server, saved with `POST /slots/0?action=save`; its bytes / its tokens is the KV per token (what
the RAM cache stores per token too: both hold the slot's state). Times its estimated tokens at
the last turn, times the conversations, is the working set; `--cache-ram` is in MiB.

Arms: no cache; RAM cache starved (¼ of the set); RAM cache with room for everything (2× the
set); kvproxy (the server's RAM cache off); kvproxy with the server's starved RAM cache on.
Reported per arm over the later turns (those a cache can serve): % of ideal, request time
p50/p95, turn 2's time and its ratio to the starved RAM cache's, and the case's wall time
(gaps included, the same in every arm).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.arms import (
    DIRECT_NO_CACHE,
    KVPROXY,
    Arm,
    BenchEnv,
    DirectArm,
    ProxyArm,
)
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn
from kvproxy_bench.report import pct, progress, table
from kvproxy_bench.workload import PACED, Row, WorkloadOptions, WorkloadResult, run_case

RAM_STARVED = "RAM cache, ¼ of the set"
RAM_ROOMY = "RAM cache, room for all"
KVPROXY_RAM = "kvproxy + RAM cache ¼"
FLEET_ARMS = (DIRECT_NO_CACHE, RAM_STARVED, RAM_ROOMY, KVPROXY, KVPROXY_RAM)
FLEET_ARM_FLAGS = {
    "no-cache": DIRECT_NO_CACHE,
    "ram-starved": RAM_STARVED,
    "ram-room": RAM_ROOMY,
    "kvproxy": KVPROXY,
    "kvproxy-ram": KVPROXY_RAM,
}
MIB = 1024 * 1024
# A later turn adds the reply as echoed, a tool result (~35 tokens) and the turn markup.
GROWTH_BESIDES_REPLY = 60


@dataclass
class FleetOptions:
    conversations: int = 16
    turns: int = 3
    slots: int = 2
    prompt_tokens: int = 3000  # system prompt size of each conversation
    max_tokens: int = 16
    ram_fraction: float = 0.25  # the starved RAM cache: this share of the working set
    seed: int = 1
    arms: tuple[str, ...] = FLEET_ARMS
    proxy_args: tuple[str, ...] = ()

    def ctx_per_slot(self) -> int:
        """Room for the last turn, rounded up to 1k."""
        need = self.prompt_tokens + self.turns * (self.max_tokens + GROWTH_BESIDES_REPLY) + 256
        return 1024 * math.ceil(need / 1024)

    def workload(self) -> WorkloadOptions:
        return WorkloadOptions(
            conversations=self.conversations,
            turns=self.turns,
            slots=self.slots,
            prompt_tokens=self.prompt_tokens,
            max_tokens=self.max_tokens,
            ctx_per_slot=self.ctx_per_slot(),
            seed=self.seed,
            arms=self.arms,
            only_cases=(PACED,),
            proxy_args=self.proxy_args,
        )


@dataclass(frozen=True)
class Sizing:
    """The working set's KV bytes, from one real save."""

    saved_tokens: int
    saved_bytes: int
    conversations: int
    tokens_per_conversation: int  # at its last turn, estimated

    @property
    def bytes_per_token(self) -> float:
        return self.saved_bytes / self.saved_tokens

    @property
    def working_set_bytes(self) -> int:
        return round(self.bytes_per_token * self.tokens_per_conversation * self.conversations)

    def cache_ram_mib(self, fraction: float) -> int:
        """`--cache-ram` (MiB) for `fraction` of the working set; never 0 (that disables it)."""
        return max(1, math.floor(self.working_set_bytes * fraction / MIB))


def sizing(opts: FleetOptions, first_tokens: int, saved_tokens: int, saved_bytes: int) -> Sizing:
    """`first_tokens`: a conversation's first prompt; each later turn adds a reply and a tool
    result."""
    growth = (opts.turns - 1) * (opts.max_tokens + GROWTH_BESIDES_REPLY)
    return Sizing(saved_tokens, saved_bytes, opts.conversations, first_tokens + growth)


def arm_cache_ram(arm: str, size: Sizing, opts: FleetOptions) -> int:
    """The `--cache-ram` each arm's llama-server runs with (0: off)."""
    if arm in (RAM_STARVED, KVPROXY_RAM):
        return size.cache_ram_mib(opts.ram_fraction)
    if arm == RAM_ROOMY:
        return size.cache_ram_mib(2.0)
    return 0


def make_fleet_arm(name: str, env: BenchEnv, opts: FleetOptions, size: Sizing) -> Arm:
    mib = arm_cache_ram(name, size, opts)
    ctx = opts.ctx_per_slot()
    if name in (KVPROXY, KVPROXY_RAM):
        return ProxyArm(env, opts.slots, ctx, list(opts.proxy_args), mib, name)
    return DirectArm(env, opts.slots, ctx, ram_cache=mib > 0, cache_ram_mib=mib, name=name)


@dataclass
class FleetResult:
    options: dict[str, Any]
    sizing: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    wall_seconds: dict[str, float] = field(default_factory=dict)
    proxy_stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "sizing": self.sizing,
            "rows": [asdict(r) for r in self.rows],
            "wall_seconds": self.wall_seconds,
            "proxy_stats": self.proxy_stats,
        }


async def measure_sizing(env: BenchEnv, opts: FleetOptions, client: Client) -> Sizing:
    """Conversation 1's first turn on a one-slot server without a cache, saved to a file."""
    arm = DirectArm(env, 1, opts.ctx_per_slot(), ram_cache=False, name="sizing")
    progress("fleet: sizing the working set from a real save")
    async with arm:
        messages = first_turn(1, facts_for(opts.prompt_tokens))
        reply = await client.chat(arm.url, messages, 1)
        if reply.error:
            raise RuntimeError(f"fleet: sizing request failed: {reply.error}")
        saved = await client.post_json(arm.url + "/slots/0?action=save", {"filename": "size.bin"})
    size = sizing(opts, reply.cache_n + reply.prompt_n, int(saved["n_saved"]), saved["n_written"])
    progress(
        f"fleet: {size.bytes_per_token:,.0f} KV bytes/token; working set "
        f"{size.working_set_bytes / MIB:,.0f} MiB ({size.conversations} × "
        f"~{size.tokens_per_conversation:,} tokens)"
    )
    return size


async def run_fleet(env: BenchEnv, opts: FleetOptions) -> FleetResult:
    client = Client()
    try:
        size = await measure_sizing(env, opts, client)
        result = FleetResult(options=asdict(opts), sizing=asdict(size))
        wopts = opts.workload()
        for name in opts.arms:
            arm = make_fleet_arm(name, env, opts, size)
            progress(f"fleet: {name} (--cache-ram {arm_cache_ram(name, size, opts)})")
            into = WorkloadResult(options=asdict(wopts))
            async with arm:
                started = time.monotonic()
                await run_case(client, arm, PACED, wopts, into)
                result.wall_seconds[name] = time.monotonic() - started
                if isinstance(arm, ProxyArm):
                    result.proxy_stats[name] = await arm.stats()
            result.rows += into.rows
    finally:
        await client.close()
    return result


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (no interpolation: with few requests p95 is a real request)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass
class ArmSummary:
    arm: str
    requests: int  # later turns
    cached: int
    reusable: int
    p50: float | None
    p95: float | None
    turn2_seconds: float
    errors: int

    @property
    def pct_of_ideal(self) -> float | None:
        return self.cached / self.reusable if self.reusable else None


def summarize(rows: list[Row], arm: str) -> ArmSummary:
    later = [r for r in rows if r.arm == arm and r.turn > 1]
    times = [r.seconds for r in later]
    return ArmSummary(
        arm=arm,
        requests=len(later),
        cached=sum(r.cached for r in later),
        reusable=sum(r.reusable for r in later),
        p50=quantile(times, 0.5),
        p95=quantile(times, 0.95),
        turn2_seconds=sum(r.seconds for r in later if r.turn == 2),
        errors=sum(r.error is not None for r in rows if r.arm == arm),
    )


def label(result: FleetResult) -> str:
    opts = FleetOptions(**{**result.options, "arms": tuple(result.options["arms"])})
    size = Sizing(**result.sizing)
    return (
        f"{opts.conversations} conversations × {opts.turns} turns through {opts.slots} slots at "
        f"an agent's pace, ~{size.tokens_per_conversation:,} tokens each; KV "
        f"{size.bytes_per_token / 1024:,.1f} KiB/token (a real save: {size.saved_bytes:,} "
        f"bytes / {size.saved_tokens:,} tokens), working set "
        f"{size.working_set_bytes / MIB:,.0f} MiB"
    )


def markdown(result: FleetResult) -> str:
    opts = FleetOptions(**{**result.options, "arms": tuple(result.options["arms"])})
    size = Sizing(**result.sizing)
    summaries = [summarize(result.rows, arm) for arm in opts.arms]
    starved = next((s.turn2_seconds for s in summaries if s.arm == RAM_STARVED), None)
    rows = []
    for s in summaries:
        mib = arm_cache_ram(s.arm, size, opts)
        rows.append(
            [
                s.arm,
                f"{mib:,} MiB" if mib else "off",
                s.requests,
                pct(s.cached, s.reusable),
                s.p50,
                s.p95,
                round(s.turn2_seconds, 2),
                f"{starved / s.turn2_seconds:.1f}×" if starved and s.turn2_seconds else None,
                round(result.wall_seconds.get(s.arm, 0.0), 1),
                s.errors,
            ]
        )
    cols = [
        "arm",
        "server RAM cache",
        "later requests",
        "% of ideal",
        "p50 (s)",
        "p95 (s)",
        "turn 2 (s)",
        "turn 2 vs starved RAM",
        "wall (s)",
        "errors",
    ]
    return f"#### {label(result)}\n\n{table(cols, rows)}"


def later_pct(result: FleetResult, arm: str) -> float | None:
    return summarize(result.rows, arm).pct_of_ideal
