"""`toolloop`: an agent's tool loop while other conversations want the slots.

An agent's conversation of `prompt_tokens` (the bundled Gemma 3 270M with the tool-calling
template of toolcalls.py) asks; its reply ends in a tool call. While the tool runs
(`tool_seconds`), `newcomers` new conversations (as many as slots by default, each of
`newcomer_tokens`) arrive one after another, each once the one before is answered, and want
slots: from the second on, the agent's slot is the least recently used (`at_once`: all at the
start, so that one of them takes the agent's slot in every arm). Then, once the pause
is over and the newcomers are answered, the tool's result comes back, streamed: its time to
first token (TTFT, the first event), `cache_n` / `prompt_n` from its last event's timings and
kvproxy's `X-KVProxy-Cache` label are what this measures. Its reply is the next tool call.

Arms, each on fresh servers with the same slots: kvproxy (its default: a reply ending in a tool
call keeps its slot against newcomers for `--tool-result-within`, and a conversation that had
to leave is restored into the next slot that frees before its result comes), kvproxy with
`--tool-result-within 0` (without that rule), and llama-server alone with its RAM cache.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.big_stream import Streamed, stream
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn
from kvproxy_bench.report import progress, table
from kvproxy_bench.toolcalls import TOOL_REQUEST, agent, reply_of, with_result, write_template

KVPROXY_NO_RULE = "kvproxy, --tool-result-within 0"
TOOLLOOP_ARMS = (KVPROXY, KVPROXY_NO_RULE, DIRECT_RAM_CACHE)
TOOLLOOP_ARM_FLAGS = {"kvproxy": KVPROXY, "no-rule": KVPROXY_NO_RULE, "ram-cache": DIRECT_RAM_CACHE}
# The agent's system prompt: tokens of the conversation without padding, and per padding word
# ("note12": measured 3,089 tokens with 900 words, Gemma's tokenizer).
BASE_TOKENS = 490
TOKENS_PER_WORD = 2.89


@dataclass
class ToolLoopOptions:
    loops: int = 5
    slots: int = 2
    newcomers: int | None = None  # None: as many as slots
    prompt_tokens: int = 3000  # the agent's conversation
    newcomer_tokens: int = 100
    tool_seconds: float = 2.0  # the tool runs this long
    at_once: bool = False  # the newcomers all arrive as the tool starts (one takes its slot)
    max_tokens: int = 48  # the agent's replies (a tool call); newcomers get 8
    arms: tuple[str, ...] = TOOLLOOP_ARMS

    @property
    def n_newcomers(self) -> int:
        return self.slots if self.newcomers is None else self.newcomers

    @property
    def ctx_per_slot(self) -> int:
        """Room for the conversation and every loop's call and result."""
        need = self.prompt_tokens + 64 * self.loops + 1024
        return max(4096, -(-need // 256) * 256)


@dataclass
class ResultTurn:
    arm: str
    loop: int
    ttft_s: float
    cache_n: int
    prompt_n: int
    cache_state: str
    error: str | None = None
    waited_s: float = 0.0  # from the tool call's reply to the result's request


@dataclass
class ArmRun:
    arm: str
    prompt_tokens: int = 0  # the agent's first request
    turns: list[ResultTurn] = field(default_factory=list)
    newcomer_errors: int = 0
    prefetches: int | None = None  # kvproxy's count at the end


@dataclass
class ToolLoopResult:
    options: dict[str, Any]
    arms: list[ArmRun] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "arms": [asdict(a) for a in self.arms]}


def pad_words(tokens: int) -> int:
    return max(0, round((tokens - BASE_TOKENS) / TOKENS_PER_WORD))


def make_toolloop_arm(name: str, env: BenchEnv, opts: ToolLoopOptions) -> Arm:
    if name == DIRECT_RAM_CACHE:
        return DirectArm(env, opts.slots, opts.ctx_per_slot, ram_cache=True)
    off = ["--tool-result-within", "0"] if name == KVPROXY_NO_RULE else []
    return ProxyArm(env, opts.slots, opts.ctx_per_slot, off, name=name)


async def run_toolloop(env: BenchEnv, opts: ToolLoopOptions) -> ToolLoopResult:
    result = ToolLoopResult(options={**asdict(opts), "ctx_per_slot": opts.ctx_per_slot})
    template = await asyncio.to_thread(write_template, env.workdir)
    # Every arm's llama-server renders tools and tool calls with it.
    env = replace(env, server_args=[*env.server_args, "--chat-template-file", str(template)])
    client = Client()
    try:
        for name in opts.arms:
            arm = make_toolloop_arm(name, env, opts)
            progress(f"toolloop: {name}")
            run = ArmRun(name)
            result.arms.append(run)
            async with arm:
                await _loops(client, arm, opts, run)
                if isinstance(arm, ProxyArm):
                    run.prefetches = int((await arm.stats()).get("prefetches", 0))
    finally:
        await client.close()
    return result


async def _agent_turn(
    client: Client, arm: Arm, messages: list[Any], opts: ToolLoopOptions
) -> Streamed:
    return await stream(client.session, arm.url, messages, opts.max_tokens, **TOOL_REQUEST)


def _called(reply: Streamed) -> str | None:
    """What went wrong when the reply is not a tool call."""
    if reply.error:
        return reply.error
    if reply.finish_reason != "tool_calls" or not reply.tool_calls:
        return f"no tool call (finish_reason {reply.finish_reason}): {reply.content[:80]!r}"
    return None


async def _loops(client: Client, arm: Arm, opts: ToolLoopOptions, run: ArmRun) -> None:
    messages = agent(1, pad=pad_words(opts.prompt_tokens))
    reply = await _agent_turn(client, arm, messages, opts)
    run.prompt_tokens = reply.cache_n + reply.prompt_n
    if (error := _called(reply)) is not None:
        progress(f"  {arm.name}: the agent's first turn: {error}")
        run.turns.append(ResultTurn(arm.name, 0, reply.ttft_s, 0, 0, "-", error))
        return
    progress(
        f"  {arm.name}: agent of {run.prompt_tokens:,} tokens, first call in {reply.ttft_s:.1f}s"
    )
    for loop in range(1, opts.loops + 1):
        # The result comes after the pause and once the newcomers are answered: its TTFT is
        # then the cache's, not a wait for a newcomer's prefill on the server's one loop.
        paused = time.perf_counter()
        _, failed = await asyncio.gather(
            asyncio.sleep(opts.tool_seconds), _newcomers(client, arm, opts, loop)
        )
        run.newcomer_errors += failed
        waited = time.perf_counter() - paused
        messages = with_result(messages, reply_of(reply.content, reply.tool_calls), f"file {loop}")
        reply = await _agent_turn(client, arm, messages, opts)
        error = _called(reply)
        run.turns.append(
            ResultTurn(
                arm.name,
                loop,
                reply.ttft_s,
                reply.cache_n,
                reply.prompt_n,
                reply.cache_state,
                error,
                waited,
            )
        )
        progress(
            f"  {arm.name} loop {loop}: TTFT {reply.ttft_s:.2f}s, {reply.cache_n} cached, "
            f"{reply.prompt_n} prefilled, {reply.cache_state}" + (f" {error}" if error else "")
        )
        if error is not None:
            return


async def _newcomers(client: Client, arm: Arm, opts: ToolLoopOptions, loop: int) -> int:
    """Loop `loop`'s newcomers from the start of the pause, one after another (each once the
    one before is answered, so each finds the slots the one before left) or all at once; how
    many failed."""
    turns = [
        first_turn(1000 * loop + k, facts_for(opts.newcomer_tokens))
        for k in range(opts.n_newcomers)
    ]
    if opts.at_once:
        replies = await asyncio.gather(*(client.chat(arm.url, m, 8) for m in turns))
    else:
        replies = [await client.chat(arm.url, m, 8) for m in turns]
    return sum(not r.ok for r in replies)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(base: float | None, value: float | None) -> str | None:
    """How many times faster `value` is than `base` (both seconds)."""
    return f"{base / value:.2f}×" if base is not None and value else None


def labels(turns: list[ResultTurn]) -> str:
    """kvproxy's labels of the result turns, most frequent first ("resident 4, restored 1")."""
    counts = Counter(t.cache_state for t in turns if t.cache_state != "-")
    return ", ".join(f"{label} {n}" for label, n in counts.most_common()) or "—"


def markdown(result: ToolLoopResult) -> str:
    opts = ToolLoopOptions(**{k: v for k, v in result.options.items() if k != "ctx_per_slot"})
    ok = {run.arm: [t for t in run.turns if t.loop > 0 and t.error is None] for run in result.arms}
    ttft = {arm: median([t.ttft_s for t in turns]) for arm, turns in ok.items()}
    rows: list[list[Any]] = []
    for run in result.arms:
        turns = ok[run.arm]
        rows.append(
            [
                run.arm,
                len(turns),
                ttft[run.arm],
                max((t.ttft_s for t in turns), default=None),
                median([float(t.cache_n) for t in turns]),
                median([float(t.prompt_n) for t in turns]),
                labels(turns),
                run.prefetches,
                ratio(ttft.get(DIRECT_RAM_CACHE), ttft[run.arm]),
                ratio(ttft.get(KVPROXY_NO_RULE), ttft[run.arm]),
                len(run.turns) - len(turns) + run.newcomer_errors,
            ]
        )
    cols = [
        "arm",
        "tool results",
        "TTFT median (s)",
        "TTFT max (s)",
        "cache_n median",
        "prompt_n median",
        "X-KVProxy-Cache",
        "prefetches",
        "vs server alone",
        "vs without the rule",
        "errors",
    ]
    tokens = max((run.prompt_tokens for run in result.arms), default=0)
    head = (
        f"An agent's conversation of {tokens:,} tokens calls a tool {opts.loops} times; while "
        f"each call's tool runs ({opts.tool_seconds:g} s), {opts.n_newcomers} new "
        f"conversations of ~{opts.newcomer_tokens} tokens arrive "
        f"{'at once' if opts.at_once else 'one after another'} through {opts.slots} slots, "
        "then, once they are answered, the tool's result comes back (streamed; TTFT: its first "
        "event; medians over "
        'the loops; "vs": how many times faster than that arm).'
    )
    every = f"<details><summary>every tool result</summary>\n\n{detail(result)}\n\n</details>"
    return f"{head}\n\n{table(cols, rows)}\n\n{every}"


def detail(result: ToolLoopResult) -> str:
    rows = [
        [
            *(t.arm, t.loop, round(t.waited_s, 1), t.ttft_s, t.cache_n, t.prompt_n),
            *(t.cache_state.strip("-") or None, t.error),
        ]
        for run in result.arms
        for t in run.turns
    ]
    cols = [
        "arm",
        "loop",
        "tool (s)",
        "TTFT (s)",
        "cache_n",
        "prompt_n",
        "X-KVProxy-Cache",
        "error",
    ]
    return table(cols, rows)
