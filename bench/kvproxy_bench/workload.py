"""`workload`: N conversations × T turns through S slots, the same requests in every arm.

Turn 1 goes in order (1, 2, …, N). Turn 2 swaps the last two (1, 2, 4, 3 for N = 4), so the
conversation that comes back first is not the one a plain LRU would keep; later turns use a
seeded shuffle. The agent-paced case sends the same orders at an agent's pace: a seeded gap of
0.5–3 s before every request (a tool running, the agent thinking) and, after turn 1, short
tool-result-like user turns, as a tool loop sends them; the gaps are not timed. A further case
sends S conversations in order every turn (1, 2, 1, 2 for S = 2): everything stays resident.
With `restart`, a last case repeats the first with every process of the arm restarted between
turns.

Per request: `timings.cache_n` (served from cache) and `prompt_n` (prefilled) from the reply,
and the ideal prefill: only the new turn. The prompt is rendered by `/apply-template` and
counted by `/tokenize` with `add_special` (as the server tokenises prompts); the reusable part
is its longest common token prefix with the same conversation (every earlier turn and the
replies as the client echoes them) ending in a different user message (the shorter of two,
so the new message itself never counts as reusable). Ideal prefill = presented − reusable.
"% of ideal" = cache_n / (presented − ideal) = cache_n / reusable: the share of the reusable
tokens that were actually served from cache.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvproxy.keys import shared_prefix
from kvproxy_bench.arms import (
    ALL_ARMS,
    DIRECT_NO_CACHE,
    DIRECT_RAM_CACHE,
    KVPROXY,
    Arm,
    BenchEnv,
    ProxyArm,
    make_arm,
)
from kvproxy_bench.client import Client, Reply
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.report import pct, progress, table

SHUFFLED = "shuffled"
PACED = "paced"  # the shuffled orders at an agent's pace, tool-result turns
RESIDENT = "resident"
RESTART = "restart"

# The agent-paced case: seconds between a reply and the next request (uniform, seeded).
AGENT_GAP = (0.5, 3.0)


@dataclass
class WorkloadOptions:
    conversations: int = 4
    turns: int = 2
    slots: int = 2
    prompt_tokens: int = 1400  # system prompt size
    max_tokens: int = 16
    ctx_per_slot: int = 4096
    restart: bool = False
    arms: tuple[str, ...] = ALL_ARMS
    seed: int = 1
    only_cases: tuple[str, ...] | None = None  # a subset of the cases (tests)
    proxy_args: tuple[str, ...] = ()  # extra `kvproxy serve` flags for the kvproxy arm


@dataclass
class Row:
    case: str
    arm: str
    turn: int
    conversation: int
    presented: int  # cache_n + prompt_n, as the server counted them
    cached: int
    prefilled: int
    reusable: int  # longest common token prefix with the previous turn as echoed
    ideal: int  # presented − reusable: only the new turn
    seconds: float
    cache_state: str
    error: str | None = None


@dataclass
class WorkloadResult:
    options: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    proxy_stats: dict[str, dict[str, Any]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "rows": [asdict(r) for r in self.rows],
            "proxy_stats": self.proxy_stats,
        }


def turn_order(n: int, turn: int, seed: int) -> list[int]:
    order = list(range(1, n + 1))
    if turn == 1:
        return order
    if turn == 2:
        return order[:-2] + order[-2:][::-1] if n >= 2 else order
    random.Random(seed * 1000 + turn).shuffle(order)
    return order


def case_label(case: str, opts: WorkloadOptions) -> str:
    n, s = opts.conversations, opts.slots
    if case == RESIDENT:
        seq = ",".join(str(c) for c in range(1, s + 1))
        return f"{s} conversations through {s} slots, order {seq},{seq}"
    order2 = ",".join(map(str, turn_order(n, 2, opts.seed)))
    label = f"{n} conversations through {s} slots, turn 2 in order {order2}"
    if case == PACED:
        low, high = AGENT_GAP
        return label + f", at an agent's pace ({low:g}–{high:g} s gaps, tool-result turns)"
    return label + (", both processes restarted between turns" if case == RESTART else "")


def cases(opts: WorkloadOptions) -> list[str]:
    if opts.only_cases is not None:
        return list(opts.only_cases)
    return [SHUFFLED, PACED, RESIDENT] + ([RESTART] if opts.restart else [])


def tool_result(turn: int, conversation: int) -> str:
    """A short user turn as a tool loop sends one: the output of the tool the agent ran."""
    return (
        f"Tool output (step {turn}, project {conversation}): exit code 0, "
        f"{turn + conversation} files checked, no errors. Continue."
    )


def agent_gaps(seed: int) -> random.Random:
    """The same gaps in every arm of a run."""
    return random.Random(seed * 7919 + 17)


async def run_workload(env: BenchEnv, opts: WorkloadOptions) -> WorkloadResult:
    result = WorkloadResult(options=asdict(opts))
    client = Client()
    try:
        for case in cases(opts):
            for arm_name in opts.arms:
                arm = make_arm(arm_name, env, opts.slots, opts.ctx_per_slot, list(opts.proxy_args))
                progress(f"workload: {case_label(case, opts)}: {arm_name}")
                async with arm:
                    await run_case(client, arm, case, opts, result)
                    if isinstance(arm, ProxyArm):
                        result.proxy_stats[f"{case}/{arm_name}"] = await arm.stats()
    finally:
        await client.close()
    return result


async def run_case(
    client: Client, arm: Arm, case: str, opts: WorkloadOptions, result: WorkloadResult
) -> None:
    n = opts.slots if case == RESIDENT else opts.conversations
    n_facts = facts_for(opts.prompt_tokens)
    convs = {c: first_turn(c, n_facts) for c in range(1, n + 1)}
    gaps = agent_gaps(opts.seed) if case == PACED else None
    for turn in range(1, opts.turns + 1):
        if turn > 1 and case == RESTART:
            progress(f"workload: restarting {arm.name}")
            await arm.restart()
        order = list(range(1, n + 1)) if case == RESIDENT else turn_order(n, turn, opts.seed)
        for c in order:
            messages = convs[c]
            if gaps is not None and (turn, c) != (1, order[0]):
                await asyncio.sleep(gaps.uniform(*AGENT_GAP))  # not part of any request's time
            reply = await client.chat(arm.url, messages, opts.max_tokens)
            # Token counts are taken after the timed request, so they cost the arm nothing.
            reusable = await _reusable(client, arm.url, messages) if turn > 1 else 0
            presented = reply.cache_n + reply.prompt_n
            result.rows.append(
                Row(
                    case=case,
                    arm=arm.name,
                    turn=turn,
                    conversation=c,
                    presented=presented,
                    cached=reply.cache_n,
                    prefilled=reply.prompt_n,
                    reusable=reusable,
                    ideal=presented - reusable,
                    seconds=reply.seconds,
                    cache_state=reply.cache_state,
                    error=reply.error,
                )
            )
            progress(
                f"  turn {turn} conversation {c}: {reply.cache_n} cached, {reply.prompt_n} "
                f"prefilled, {reply.seconds:.2f}s {reply.cache_state}"
                + (f" ERROR {reply.error}" if reply.error else "")
            )
            convs[c] = next_turn(messages, _echo(reply), turn + 1)
            if case == PACED:
                convs[c][-1] = {"role": "user", "content": tool_result(turn + 1, c)}


def _echo(reply: Reply) -> str:
    return reply.content


# Two next messages with different first characters: the new message's own tokens can match
# at most one of them, so the shorter common prefix stops where the new turn starts.
OTHER_MESSAGES = ("0", "Zz")


async def _reusable(
    client: Client, base: str, messages: list[dict[str, Any]], **fields: Any
) -> int:
    """Tokens of this prompt that do not depend on its last (new) user message: everything the
    conversation held before, replies as echoed and turn markup included. The most any cache
    could serve. `fields`: more of the request's body (a router's `model`)."""
    now = await client.prompt_tokens(base, messages, **fields)
    shared = len(now)
    for other in OTHER_MESSAGES:
        alt = [*messages[:-1], {"role": "user", "content": other}]
        shared = min(shared, shared_prefix(now, await client.prompt_tokens(base, alt, **fields)))
    return shared


@dataclass
class TurnSummary:
    case: str
    arm: str
    turn: int
    requests: int
    presented: int
    cached: int
    prefilled: int
    ideal: int
    reusable: int
    seconds: float
    errors: int

    @property
    def pct_of_ideal(self) -> float | None:
        return self.cached / self.reusable if self.reusable else None


def summarize(result: WorkloadResult) -> list[TurnSummary]:
    out: dict[tuple[str, str, int], TurnSummary] = {}
    for r in result.rows:
        key = (r.case, r.arm, r.turn)
        s = out.setdefault(key, TurnSummary(r.case, r.arm, r.turn, 0, 0, 0, 0, 0, 0, 0.0, 0))
        s.requests += 1
        s.presented += r.presented
        s.cached += r.cached
        s.prefilled += r.prefilled
        s.ideal += r.ideal
        s.reusable += r.reusable
        s.seconds += r.seconds
        s.errors += r.error is not None
    return list(out.values())


def markdown(result: WorkloadResult) -> str:
    opts = WorkloadOptions(**result.options)
    summaries = summarize(result)
    parts = []
    for case in cases(opts):
        rows = []
        mine = [s for s in summaries if s.case == case]
        base = {s.turn: s.seconds for s in mine if s.arm == DIRECT_NO_CACHE}
        for arm in opts.arms:
            arm_rows = [s for s in mine if s.arm == arm]
            for s in arm_rows:
                speedup = base.get(s.turn)
                rows.append(
                    [
                        arm,
                        s.turn,
                        s.presented,
                        s.cached,
                        s.prefilled,
                        s.ideal,
                        pct(s.cached, s.reusable),
                        round(s.seconds, 2),
                        f"{speedup / s.seconds:.1f}×" if speedup and s.seconds else None,
                        s.errors,
                    ]
                )
            total = sum(s.seconds for s in arm_rows)
            rows.append([arm, "total", None, None, None, None, None, round(total, 2), None, None])
        cols = [
            "arm",
            "turn",
            "presented",
            "from cache",
            "prefilled",
            "ideal prefill",
            "% of ideal",
            "time (s)",
            "vs no cache",
            "errors",
        ]
        parts.append(f"#### {case_label(case, opts)}\n\n{table(cols, rows)}")
    return "\n\n".join(parts)


def turn2(result: WorkloadResult, case: str, arm: str = KVPROXY) -> TurnSummary | None:
    for s in summarize(result):
        if s.case == case and s.arm == arm and s.turn == 2:
            return s
    return None


def turn2_pct(result: WorkloadResult, case: str, arm: str = KVPROXY) -> float | None:
    s = turn2(result, case, arm)
    return None if s is None else s.pct_of_ideal


def plot(result: WorkloadResult, path: Path) -> None:
    """Turn-2 (and later) share of the ideal served from cache, per case and arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    opts = WorkloadOptions(**result.options)
    later: dict[tuple[str, str], list[int]] = {}
    for s in summarize(result):
        if s.turn > 1:
            got = later.setdefault((s.case, s.arm), [0, 0])
            got[0] += s.cached
            got[1] += s.reusable
    case_names = cases(opts)
    labels = {
        SHUFFLED: "evictions",
        PACED: "agent-paced",
        RESIDENT: "all resident",
        RESTART: "after restart",
    }
    colors = {DIRECT_NO_CACHE: "tab:red", DIRECT_RAM_CACHE: "tab:orange", KVPROXY: "tab:blue"}
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    width = 0.8 / max(1, len(opts.arms))
    for i, arm in enumerate(opts.arms):
        values = []
        for case in case_names:
            cached, reusable = later.get((case, arm), (0, 0))
            values.append(100.0 * cached / reusable if reusable else 0.0)
        xs = [c + (i - (len(opts.arms) - 1) / 2) * width for c in range(len(case_names))]
        bars = ax.bar(xs, values, width, label=arm, color=colors.get(arm))
        ax.bar_label(bars, fmt="%.0f%%", fontsize=7)
    ax.set_xticks(range(len(case_names)), [labels.get(c, c) for c in case_names])
    ax.set_ylabel("later turns: % of ideal served from cache")
    ax.set_ylim(0, 115)
    ax.set_title(
        f"{opts.conversations} conversations × {opts.turns} turns through {opts.slots} slots"
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
