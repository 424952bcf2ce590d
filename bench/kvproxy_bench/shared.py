"""`shared`: agent sessions of one system prompt, with sub-agent windows, through 2 slots.

Three main sessions send their turns at once, all with the same ~1,500-token system message,
each growing turn by turn; between two main turns a sub-agent window opens two new sessions
of the same system prompt (one and two turns). Five sessions, two slots: sessions evict each
other. Then the arm restarts (the server alone loses its RAM cache; kvproxy keeps its store)
and every main session sends one more turn.

Arms: llama-server alone with its RAM prompt cache (its default `--cache-ram`), and kvproxy
(managed mode, `--cache-ram 0`). Ideal prefill of a request: its tokens minus those that do
not depend on its last user message (`workload._reusable`), when any request came before it
(the system prompt is shared): only the new content. Prefilled counts the tokens kvproxy
had the server evaluate for a request before forwarding it (`X-KVProxy-Evaluated-Tokens`),
not the canonical-prefix step of its saves.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, side_by_side
from kvproxy_bench.client import Client, Reply
from kvproxy_bench.dialogues import facts_for, system_prompt
from kvproxy_bench.prefill import Request, detail_table, summary_table
from kvproxy_bench.report import progress
from kvproxy_bench.workload import _reusable

PHASES = ["sessions", "after restart"]


@dataclass
class SharedOptions:
    sessions: int = 3
    turns: int = 6
    subagents: int = 2  # new sessions per window, between two main turns
    prompt_tokens: int = 1500
    max_tokens: int = 16
    slots: int = 2
    ctx_per_slot: int = 4096


@dataclass
class SharedResult:
    options: dict[str, Any]
    requests: list[Request] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "requests": [asdict(r) for r in self.requests]}


def opening(system: str, name: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"{name}: what does fact 3 say? Answer briefly."},
    ]


def follow_up(messages: list[dict[str, Any]], reply: str, name: str, turn: int) -> list[Any]:
    ask = f"{name}, turn {turn}: and what does fact {turn + 3} say?"
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": ask}]


@dataclass
class _Run:
    client: Client
    arm: Arm
    opts: SharedOptions
    result: SharedResult
    seen: bool = False  # a request came before: the system prompt is in some cache

    async def turn(self, phase: str, name: str, turn: int, messages: list[dict[str, Any]]) -> Reply:
        reusable = await _reusable(self.client, self.arm.url, messages) if self.seen else 0
        self.seen = True
        reply = await self.client.chat(self.arm.url, messages, self.opts.max_tokens)
        prompt = reply.cache_n + reply.prompt_n
        # What kvproxy had the server evaluate before forwarding (an opening to save): the
        # reply's cache_n counts it, but it was prefilled for this request.
        evaluated = min(reply.cache_n, int(reply.headers.get("X-KVProxy-Evaluated-Tokens", 0)))
        self.result.requests.append(
            Request(
                self.arm.name,
                phase,
                f"{name} turn {turn}",
                reply.status,
                reply.cache_n - evaluated,
                reply.prompt_n + evaluated,
                max(0, prompt - reusable),
                reply.cache_state,
                reply.error,
            )
        )
        progress(
            f"  {self.arm.name} {name} turn {turn}: {reply.cache_n} cached, "
            f"{reply.prompt_n} prefilled {reply.cache_state}"
            + (f" {reply.error}" if reply.error else "")
        )
        return reply

    async def session(self, phase: str, name: str, messages: list[Any], turns: int) -> list[Any]:
        for t in range(1, turns + 1):
            reply = await self.turn(phase, name, t, messages)
            messages = follow_up(messages, reply.content, name, t + 1)
        return messages


async def run_shared(env: BenchEnv, opts: SharedOptions) -> SharedResult:
    result = SharedResult(options=asdict(opts))
    client = Client()
    try:
        for arm in side_by_side(env, opts.slots, opts.ctx_per_slot):
            progress(f"shared: {arm.name}")
            async with arm:
                await _sessions(_Run(client, arm, opts, result))
    finally:
        await client.close()
    return result


async def _sessions(run: _Run) -> None:
    opts = run.opts
    system = system_prompt(0, facts_for(opts.prompt_tokens))
    names = [f"agent {k + 1}" for k in range(opts.sessions)]
    convs = {n: opening(system, n) for n in names}
    windows = 0

    async def main_turn(name: str, turn: int, phase: str) -> None:
        reply = await run.turn(phase, name, turn, convs[name])
        convs[name] = follow_up(convs[name], reply.content, name, turn + 1)

    for turn in range(1, opts.turns + 1):
        await asyncio.gather(*(main_turn(n, turn, PHASES[0]) for n in names))
        if turn < opts.turns:
            windows += 1
            subs = [f"sub-agent {windows}.{k + 1}" for k in range(opts.subagents)]
            await asyncio.gather(
                *(
                    run.session(PHASES[0], s, opening(system, s), 1 + k % 2)
                    for k, s in enumerate(subs)
                )
            )
    progress(f"shared: {run.arm.name} restarts")
    await run.arm.restart()
    for name in names:  # one at a time: each comes back after the others
        await main_turn(name, opts.turns + 1, PHASES[1])


def markdown(result: SharedResult) -> str:
    opts = SharedOptions(**result.options)
    head = (
        f"{opts.sessions} agent sessions at once with one ~{opts.prompt_tokens}-token system "
        f"prompt, {opts.turns} turns each, a window of {opts.subagents} sub-agent sessions "
        f"(1–2 turns) between main turns, {opts.slots} slots; then a restart of each arm and "
        "one more turn per main session. Ideal prefill: only each request's new content."
    )
    arms = [DIRECT_RAM_CACHE, KVPROXY]
    return (
        f"{head}\n\n{summary_table(result.requests, arms, PHASES)}\n\n"
        f"<details><summary>every request</summary>\n\n{detail_table(result.requests)}\n\n"
        "</details>"
    )
