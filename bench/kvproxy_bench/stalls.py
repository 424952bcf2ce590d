"""`stalls`: what cache work on one slot costs the token stream of another. llama-server runs
slot saves and restores on its one loop, between decode steps, so a save or a restore of a
long conversation pauses every other slot's stream for as long as it takes.

Per arm, on one server with two slots:

1. **Alone**: one streamed reply (`--stream-tokens`, `ignore_eos`) and nothing else; the
   gaps between its tokens are the undisturbed reference (same server, same run).
2. The other conversations' first turns (`--prompt-tokens` each, so a saved state is tens of
   MB), one after another, then until kvproxy has saved every slot. Their prefills are the
   server's own cost with or without a cache, so they run before the measured stream.
3. **With cache work**: a second streamed reply of the same length; from its first token on,
   each other conversation sends its turn 2 (a tool result) after a seeded 0.3–1.0 s gap, as
   an agent does. On the other slot kvproxy restores each one (a request's path: it cannot
   wait), saves what the slot held when that was not on disk yet, and saves in the
   background what each turn left.

The stream's gaps are reported whole and split by when they fell: during another
conversation's request (its restore, any save on its path, its short prefill and reply) or
between them (where only background saves run). Counts of saves and restores are taken from
`/kvproxy/stats` around step 3. Turn 2's "% of ideal" is computed as in `workload`, after the
stream.

Arms: kvproxy with its background saves held back while another slot serves a request and
another idle slot is free for a new conversation (the default;
`kvproxy/cache/decisions/pressure.py`), kvproxy with `--save-wait 0` (saves at once), and
llama-server alone with its RAM cache (which copies states to and from RAM on the same loop). With
`--slots 2` one slot streams and the other is the only one left, so every save is urgent and both
kvproxy arms save at once; `--slots 3` shows the hold.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.fleet import quantile
from kvproxy_bench.report import pct, progress, table
from kvproxy_bench.servers import _saved
from kvproxy_bench.workload import _reusable, tool_result

KVPROXY_AT_ONCE = "kvproxy, saves at once"
STALLS_ARMS = (KVPROXY, KVPROXY_AT_ONCE, DIRECT_RAM_CACHE)
STALLS_ARM_FLAGS = {"kvproxy": KVPROXY, "at-once": KVPROXY_AT_ONCE, "ram-cache": DIRECT_RAM_CACHE}
# Seconds between one conversation's turn-2 reply and the next one's request (uniform, seeded).
TURN_GAP = (0.3, 1.0)


@dataclass
class StallsOptions:
    conversations: int = 3  # the others, through the other slots
    slots: int = 2
    prompt_tokens: int = 3000
    stream_tokens: int = 256
    max_tokens: int = 16  # the others' replies
    ctx_per_slot: int = 4096
    seed: int = 1
    arms: tuple[str, ...] = STALLS_ARMS


@dataclass
class Turn:
    conversation: int
    started: float  # perf_counter
    ended: float
    cached: int
    prefilled: int
    reusable: int
    cache_state: str
    error: str | None = None


@dataclass
class ArmRun:
    arm: str
    alone: list[float] = field(default_factory=list)  # token times, the stream alone
    loaded: list[float] = field(default_factory=list)  # token times, with cache work
    turns: list[Turn] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)  # kvproxy's, during step 3


@dataclass
class StallsResult:
    options: dict[str, Any]
    arms: list[ArmRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "arms": [asdict(a) for a in self.arms]}


def stream_messages(k: int) -> list[dict[str, Any]]:
    """A short prompt asking for a long reply (`ignore_eos` makes it exactly as long)."""
    return [
        {"role": "system", "content": f"You are storyteller {k}."},
        {"role": "user", "content": f"Tell a very long story about lighthouse {k}."},
    ]


def make_stalls_arm(name: str, env: BenchEnv, opts: StallsOptions) -> Arm:
    if name == DIRECT_RAM_CACHE:
        return DirectArm(env, opts.slots, opts.ctx_per_slot, ram_cache=True)
    wait = ["--save-wait", "0"] if name == KVPROXY_AT_ONCE else []
    return ProxyArm(env, opts.slots, opts.ctx_per_slot, wait, name=name)


async def run_stalls(env: BenchEnv, opts: StallsOptions) -> StallsResult:
    result = StallsResult(options=asdict(opts))
    client = Client()
    try:
        for name in opts.arms:
            arm = make_stalls_arm(name, env, opts)
            progress(f"stalls: {name}")
            async with arm:
                result.arms.append(await _run_arm(client, arm, opts))
    finally:
        await client.close()
    return result


async def _counts(arm: Arm) -> dict[str, int]:
    if not isinstance(arm, ProxyArm):
        return {}
    stats = await arm.stats()
    return {k: int(stats[k]) for k in ("saves", "background_saves", "restores")}


async def _settle(arm: Arm) -> None:
    """Until kvproxy has saved what the slots hold (the server alone: a moment's rest)."""
    if isinstance(arm, ProxyArm):
        await _saved(arm, 0)
    await asyncio.sleep(1.0)


async def _run_arm(client: Client, arm: Arm, opts: StallsOptions) -> ArmRun:
    out = ArmRun(arm.name)
    stream: dict[str, Any] = {"ignore_eos": True}
    out.alone = await client.stream_times(arm.url, stream_messages(1), opts.stream_tokens, **stream)
    progress(f"  alone: {len(out.alone)} tokens")

    n_facts = facts_for(opts.prompt_tokens)
    convs = {c: first_turn(c, n_facts) for c in range(1, opts.conversations + 1)}
    for c in convs:
        reply = await client.chat(arm.url, convs[c], opts.max_tokens)
        if not reply.ok:
            raise RuntimeError(f"stalls: turn 1 of conversation {c} failed: {reply.error}")
        convs[c] = next_turn(convs[c], reply.content, 2)
        convs[c][-1] = {"role": "user", "content": tool_result(2, c)}
        progress(f"  turn 1 conversation {c}: {reply.prompt_n} prefilled, {reply.seconds:.2f}s")
    await _settle(arm)

    before = await _counts(arm)
    first = asyncio.Event()
    streaming = asyncio.ensure_future(
        client.stream_times(arm.url, stream_messages(2), opts.stream_tokens, first, **stream)
    )
    # From the stream's first token on: its prefill is over, its decoding has begun.
    begun = asyncio.ensure_future(first.wait())
    await asyncio.wait([streaming, begun], return_when=asyncio.FIRST_COMPLETED)
    begun.cancel()
    gaps = random.Random(opts.seed * 7919 + 23)
    for c in convs:
        await asyncio.sleep(gaps.uniform(*TURN_GAP))
        started = time.perf_counter()
        reply = await client.chat(arm.url, convs[c], opts.max_tokens)
        ended = time.perf_counter()
        out.turns.append(
            Turn(
                c,
                started,
                ended,
                reply.cache_n,
                reply.prompt_n,
                0,
                reply.cache_state,
                reply.error,
            )
        )
        progress(
            f"  turn 2 conversation {c}: {reply.cache_n} cached, {reply.prompt_n} prefilled, "
            f"{reply.seconds:.2f}s {reply.cache_state}"
            + (f" ERROR {reply.error}" if reply.error else "")
        )
    out.loaded = await streaming
    after = await _counts(arm)
    out.counts = {k: after[k] - before[k] for k in after}
    progress(f"  with cache work: {len(out.loaded)} tokens; {out.counts}")
    for turn in out.turns:
        if turn.error is None:
            turn.reusable = await _reusable(client, arm.url, convs[turn.conversation])
    return out


@dataclass(frozen=True)
class Gaps:
    n: int
    p50: float | None  # milliseconds
    p99: float | None
    max: float | None


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def summary(values: list[float]) -> Gaps:
    return Gaps(
        len(values),
        quantile(values, 0.5),
        quantile(values, 0.99),
        max(values) if values else None,
    )


def split(times: list[float], turns: list[Turn]) -> tuple[list[float], list[float]]:
    """The gaps that overlap another conversation's request, and the others (ms)."""
    during: list[float] = []
    between: list[float] = []
    for a, b in itertools.pairwise(times):
        overlaps = any(a < t.ended and b > t.started for t in turns)
        (during if overlaps else between).append((b - a) * 1000)
    return during, between


def _ms(value: float | None) -> str | None:
    return None if value is None else f"{value:.0f}"


def markdown(result: StallsResult) -> str:
    opts = StallsOptions(**{**result.options, "arms": tuple(result.options["arms"])})
    gap_rows, turn_rows = [], []
    for run in result.arms:
        alone = summary(gaps_ms(run.alone))
        loaded = summary(gaps_ms(run.loaded))
        during, between = (summary(g) for g in split(run.loaded, run.turns))
        ratio = f"{loaded.p99 / alone.p99:.2f}×" if loaded.p99 is not None and alone.p99 else None
        between_ratio = (
            f"{between.p99 / alone.p99:.2f}×" if between.p99 is not None and alone.p99 else None
        )
        gap_rows.append(
            [
                run.arm,
                f"{_ms(alone.p50)} / {_ms(alone.p99)} / {_ms(alone.max)}",
                f"{_ms(loaded.p50)} / {_ms(loaded.p99)} / {_ms(loaded.max)}",
                ratio,
                f"{between.n}: {_ms(between.p99)} / {_ms(between.max)}",
                between_ratio,
                f"{during.n}: {_ms(during.p99)} / {_ms(during.max)}",
            ]
        )
        ok = [t for t in run.turns if t.error is None]
        times = [t.ended - t.started for t in ok]
        saves = run.counts.get("saves")
        background = run.counts.get("background_saves")
        turn_rows.append(
            [
                run.arm,
                pct(sum(t.cached for t in ok), sum(t.reusable for t in ok)),
                quantile(times, 0.5),
                max(times) if times else None,
                run.counts.get("restores"),
                None if saves is None or background is None else saves - background,
                background,
                len(run.turns) - len(ok),
            ]
        )
    gap_cols = [
        "arm",
        "alone: p50 / p99 / max (ms)",
        "with cache work: p50 / p99 / max",
        "p99 vs alone",
        "between requests: n: p99 / max",
        "p99 vs alone",
        "during requests: n: p99 / max",
    ]
    turn_cols = [
        "arm",
        "turn 2: % of ideal",
        "turn 2 p50 (s)",
        "turn 2 max (s)",
        "restores",
        "saves on a request's path",
        "background saves",
        "errors",
    ]
    head = (
        f"A {opts.stream_tokens}-token stream on one slot, alone and while "
        f"{opts.conversations} other conversations of ~{opts.prompt_tokens:,} tokens send "
        f"turn 2 through the other slots ({opts.slots} in all; gaps between tokens; "
        '"during requests": the gaps that overlap another conversation\'s request, its '
        "restore and any save on its path included)."
    )
    return (
        f"{head}\n\n{table(gap_cols, gap_rows)}\n\n"
        f"The other conversations (saves and restores counted during the stream):\n\n"
        f"{table(turn_cols, turn_rows)}"
    )
