"""`swaps`: a user switching between two models on one llama-server in router mode
(`--models-dir`, `--models-max 1`): conversation A on model "coder", B on model "chat",
turns A1 B1 A2 B2 A3 B3, so every turn makes the router unload the other model and its KV.
Both models are the same GGUF under two names (the benchmark's model, linked twice), so the
arms differ only in what survives a swap.

Arms: the router alone with its RAM prompt cache (its default), and kvproxy managed mode
starting the same router (`kvproxy serve --models-dir … --models-max 1`). "% of ideal" as in
`workload`: cache_n over the tokens any cache could serve (the earlier turns as echoed),
counted after each timed request on the model it used (no swap in between).
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy.server.managed import router_command
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.report import pct, progress, table
from kvproxy_bench.workload import _reusable

MODELS = ("coder", "chat")  # conversation 1 on the first, 2 on the second


@dataclass
class SwapsOptions:
    turns: int = 3
    prompt_tokens: int = 1500
    max_tokens: int = 16
    slots: int = 2
    ctx_per_slot: int = 4096


@dataclass
class Turn:
    arm: str
    model: str
    turn: int
    cached: int
    prefilled: int
    reusable: int
    seconds: float
    cache_state: str
    error: str | None = None


@dataclass
class SwapsResult:
    options: dict[str, Any]
    turns: list[Turn] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "turns": [asdict(t) for t in self.turns]}


def models_dir(env: BenchEnv) -> Path:
    """The benchmark's model under each name of MODELS (blocking: call it in a thread)."""
    where = env.new_dir("models")
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in MODELS:
        (where / f"{name}.gguf").symlink_to(env.model)
    return where


class RouterArm(DirectArm):
    """llama-server alone as a router, with its RAM prompt cache (its default)."""

    def __init__(self, env: BenchEnv, models: Path, opts: SwapsOptions) -> None:
        super().__init__(env, opts.slots, opts.ctx_per_slot, ram_cache=True)
        self.models = models

    def command(self, port: int) -> list[str]:
        return router_command(
            self.env.binary,
            self.models,
            1,
            port,
            self.cache_dir,
            self.slots,
            self.ctx_per_slot,
            None,
            self.env.common_flags(),
        )


class RouterProxyArm(ProxyArm):
    """`kvproxy serve --models-dir … --models-max 1`: kvproxy starts the router."""

    def __init__(self, env: BenchEnv, models: Path, opts: SwapsOptions) -> None:
        super().__init__(env, opts.slots, opts.ctx_per_slot)
        self.models = models

    def model_args(self) -> list[str]:
        return ["--models-dir", str(self.models), "--models-max", "1"]

    async def answers(self, session: aiohttp.ClientSession) -> bool:
        """kvproxy answers /health: a router loads no model before a request names one, so no
        model's slots are known before (the stats' `enabled`)."""
        async with session.get(self.url + "/health") as resp:
            return resp.status == 200


async def run_swaps(env: BenchEnv, opts: SwapsOptions) -> SwapsResult:
    result = SwapsResult(options=asdict(opts))
    models = await asyncio.to_thread(models_dir, env)
    client = Client()
    try:
        for arm in (RouterArm(env, models, opts), RouterProxyArm(env, models, opts)):
            progress(f"swaps: {arm.name}")
            async with arm:
                await _alternate(client, arm, opts, result)
    finally:
        await client.close()
    return result


async def _alternate(client: Client, arm: Arm, opts: SwapsOptions, result: SwapsResult) -> None:
    n_facts = facts_for(opts.prompt_tokens)
    convs = {model: first_turn(i + 1, n_facts) for i, model in enumerate(MODELS)}
    for turn in range(1, opts.turns + 1):
        for model in MODELS:
            messages = convs[model]
            reply = await client.chat(arm.url, messages, opts.max_tokens, model=model)
            reusable = await _reusable(client, arm.url, messages, model=model) if turn > 1 else 0
            result.turns.append(
                Turn(
                    arm.name,
                    model,
                    turn,
                    reply.cache_n,
                    reply.prompt_n,
                    reusable,
                    reply.seconds,
                    reply.cache_state,
                    reply.error,
                )
            )
            progress(
                f"  {model} turn {turn}: {reply.cache_n} cached, {reply.prompt_n} prefilled, "
                f"{reply.seconds:.2f}s {reply.cache_state}"
                + (f" ERROR {reply.error}" if reply.error else "")
            )
            if reply.ok:
                convs[model] = next_turn(messages, reply.content, turn + 1)


def markdown(result: SwapsResult) -> str:
    opts = SwapsOptions(**result.options)
    arms = [DIRECT_RAM_CACHE, KVPROXY]
    rows: list[list[Any]] = []
    later: dict[str, tuple[int, int, float]] = {}
    for arm in arms:
        for t in (t for t in result.turns if t.arm == arm):
            rows.append(
                [
                    arm,
                    f"{t.model} {t.turn}",
                    t.cached,
                    t.prefilled,
                    pct(t.cached, t.reusable) if t.turn > 1 else None,
                    round(t.seconds, 2),
                    t.cache_state if arm == KVPROXY else None,
                    t.error,
                ]
            )
            if t.turn > 1:
                cached, reusable, seconds = later.get(arm, (0, 0, 0.0))
                later[arm] = (cached + t.cached, reusable + t.reusable, seconds + t.seconds)
    cols = ["arm", "turn", "from cache", "prefilled", "% of ideal", "time (s)", "kvproxy", "error"]
    summary = []
    base = later.get(DIRECT_RAM_CACHE)
    for arm in arms:
        if arm in later:
            cached, reusable, seconds = later[arm]
            ratio = f"{base[2] / seconds:.1f}×" if base and seconds else None
            summary.append([arm, pct(cached, reusable), round(seconds, 2), ratio])
    head = (
        f"Conversation A on model {MODELS[0]}, B on {MODELS[1]}, one router (`--models-max 1`), "
        f"turns {' '.join(f'{ab}{t}' for t in range(1, opts.turns + 1) for ab in 'AB')}: "
        "every turn swaps the model."
    )
    return f"{head}\n\n{table(cols, rows)}\n\nLater turns (after a swap), together:\n\n" + table(
        ["arm", "% of ideal", "time (s)", "vs the router alone"], summary
    )
