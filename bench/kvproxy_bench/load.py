"""`load`: C concurrent clients sharing M conversations through S slots, for a bounded number
of requests (M × turns). A conversation's next turn is sent only after its previous reply,
by whichever client is free, so slots keep changing hands: evictions, saves and restores
under contention.

Per request: latency at the client, and the server's own time for it (`prompt_ms` +
`predicted_ms` from `timings`). Wait = latency − server time: queueing for a slot, saves and
restores, relaying. A stall is `stall_after` seconds with no reply at all; the run then stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.arms import KVPROXY, BenchEnv, ProxyArm, make_arm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.overhead import percentile
from kvproxy_bench.report import progress, table


@dataclass
class LoadOptions:
    clients: int = 16
    conversations: int = 32
    slots: int = 4
    turns: int = 3
    prompt_tokens: int = 350  # above kvproxy's --min-tokens, so evicted conversations are saved
    max_tokens: int = 8
    ctx_per_slot: int = 2048
    stall_after: float = 180.0
    arms: tuple[str, ...] = (KVPROXY,)
    proxy_args: tuple[str, ...] = ()  # extra `kvproxy serve` flags for the kvproxy arm


@dataclass
class Sample:
    conversation: int
    turn: int
    seconds: float
    server_ms: float
    cached: int
    presented: int
    cache_state: str
    error: str | None


@dataclass
class ArmLoad:
    arm: str
    wall_s: float = 0.0
    stalled: bool = False
    samples: list[Sample] = field(default_factory=list)
    proxy_stats: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.error is None]
        waits = [max(0.0, s.seconds * 1000 - s.server_ms) for s in ok]
        later = [s for s in ok if s.turn > 1]
        return {
            "requests": len(self.samples),
            "errors": len(self.samples) - len(ok),
            "stalled": self.stalled,
            "wall_s": self.wall_s,
            "requests_per_s": len(ok) / self.wall_s if self.wall_s else 0.0,
            "latency_p50_s": percentile([s.seconds for s in ok], 50),
            "latency_p99_s": percentile([s.seconds for s in ok], 99),
            "wait_p50_ms": percentile(waits, 50),
            "wait_p99_ms": percentile(waits, 99),
            "later_turns_cached": sum(s.cached for s in later),
            "later_turns_presented": sum(s.presented for s in later),
        }


@dataclass
class LoadResult:
    options: dict[str, Any]
    arms: list[ArmLoad] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "arms": [
                {
                    "arm": a.arm,
                    "summary": a.summary(),
                    "proxy_stats": a.proxy_stats,
                    "samples": [asdict(s) for s in a.samples],
                }
                for a in self.arms
            ],
        }


async def run_load(env: BenchEnv, opts: LoadOptions) -> LoadResult:
    result = LoadResult(options=asdict(opts))
    for arm_name in opts.arms:
        arm = make_arm(arm_name, env, opts.slots, opts.ctx_per_slot, list(opts.proxy_args))
        progress(
            f"load: {opts.clients} clients × {opts.conversations} conversations × "
            f"{opts.turns} turns through {opts.slots} slots: {arm_name}"
        )
        async with arm:
            out = await _drive(arm.url, arm_name, opts)
            if isinstance(arm, ProxyArm):
                out.proxy_stats = await arm.stats()
        result.arms.append(out)
    return result


async def _drive(url: str, arm_name: str, opts: LoadOptions) -> ArmLoad:
    out = ArmLoad(arm_name)
    n_facts = facts_for(opts.prompt_tokens)
    ready: asyncio.Queue[tuple[int, int, list[dict[str, Any]]]] = asyncio.Queue()
    for c in range(1, opts.conversations + 1):
        ready.put_nowait((c, 1, first_turn(20_000 + c, n_facts)))
    remaining = opts.conversations * opts.turns
    done = asyncio.Event()
    last_reply = time.monotonic()
    client = Client()

    async def worker() -> None:
        nonlocal remaining, last_reply
        while not done.is_set():
            c, turn, messages = await ready.get()
            reply = await client.chat(url, messages, opts.max_tokens)
            last_reply = time.monotonic()
            out.samples.append(
                Sample(
                    c,
                    turn,
                    reply.seconds,
                    reply.server_ms,
                    reply.cache_n,
                    reply.cache_n + reply.prompt_n,
                    reply.cache_state,
                    reply.error,
                )
            )
            remaining -= 1
            if len(out.samples) % 16 == 0 or reply.error:
                progress(
                    f"  {len(out.samples)} replies"
                    + (f"; error: {reply.error}" if reply.error else "")
                )
            if turn < opts.turns:
                ready.put_nowait((c, turn + 1, next_turn(messages, reply.content, turn + 1)))
            if remaining <= 0:
                done.set()

    started = time.monotonic()
    workers = [asyncio.create_task(worker()) for _ in range(opts.clients)]
    try:
        while not done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 1.0)
            if not done.is_set() and time.monotonic() - last_reply > opts.stall_after:
                out.stalled = True
                progress(f"  STALL: no reply for {opts.stall_after:g}s")
                break
    finally:
        out.wall_s = time.monotonic() - started
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await client.close()
    return out


def markdown(result: LoadResult) -> str:
    rows = []
    for a in result.arms:
        s = a.summary()
        rows.append(
            [
                a.arm,
                s["requests"],
                s["errors"],
                "yes" if s["stalled"] else "no",
                round(s["wall_s"], 1),
                f"{s['requests_per_s']:.2f}",
                f"{s['latency_p50_s']:.2f} / {s['latency_p99_s']:.2f}",
                f"{s['wait_p50_ms']:,.0f} / {s['wait_p99_ms']:,.0f}",
                f"{100 * s['later_turns_cached'] / max(1, s['later_turns_presented']):.1f}%",
            ]
        )
    cols = [
        "arm",
        "requests",
        "errors",
        "stall",
        "wall (s)",
        "requests/s",
        "latency p50 / p99 (s)",
        "wait p50 / p99 (ms)",
        "turns ≥ 2 served from cache",
    ]
    text = table(cols, rows)
    for a in result.arms:
        if a.proxy_stats:
            st = a.proxy_stats
            text += (
                f"\n\n{a.arm}: {st.get('saves', 0)} saves, {st.get('restores', 0)} restores, "
                f"{st.get('restore_failures', 0)} restore failures, requests {st.get('requests')}"
            )
    return text
