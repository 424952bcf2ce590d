"""`fim`: llama.vscode's editing session (fim.py) replayed against each arm, two ways:

- `infill`: llama.cpp mode, every body posted to `/infill` as the extension does, its
  n_predict 0 ring updates included (a model without FIM tokens answers 501: reported);
- `openai`: the extension's OpenAI mode, the OpenAI SDK's `client.completions.create` on
  `/v1/completions` (no ring updates in that mode);
- `after restart`: the arm restarts (the server alone loses its RAM cache), then the last
  `returning` completions of the OpenAI pass come again.

Three arms: the server alone (RAM cache), kvproxy (write-back: a slot's state is saved when
something else needs the slot, when idle, at shutdown), and kvproxy `--write-through` (every
reply's state saved): what each completion's own file buys after a restart, and what the
files cost (kvproxy's saves while it served the session, from /kvproxy/stats).

Ideal prefill of a request: its tokens beyond the longest token prefix it shares with any
earlier prompt of the pass. For `/v1/completions` the prompt is tokenised by the server
(`/tokenize`, `add_special`); for `/infill` it is assembled as `format_prompt_infill`
(tools/server/server-common.cpp) lays it out — extra chunks, BOS, FIM_PRE prefix prompt,
FIM_SUF suffix, FIM_MID — from the pieces' tokens, cut as it cuts them to n_batch and n_ctx.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy.keys import shared_prefix
from kvproxy_bench.arms import (
    DIRECT_RAM_CACHE,
    KVPROXY,
    Arm,
    BenchEnv,
    ProxyArm,
    side_by_side,
)
from kvproxy_bench.client import Client
from kvproxy_bench.fim import FimConfig, FimRequest, editing_session
from kvproxy_bench.prefill import Request, detail_table, summary_table
from kvproxy_bench.report import progress, table

KVPROXY_WRITE_THROUGH = "kvproxy, write-through"
PHASES = ["infill", "openai", "after restart"]
# Stand-ins for the FIM special tokens: only equality matters to a common prefix.
FIM_REP, FIM_SEP, FIM_PRE, FIM_SUF, FIM_MID = -1, -2, -3, -4, -5
N_BATCH = 2048  # llama-server's default --batch-size, which no arm changes


@dataclass
class FimOptions:
    edits: int = 12
    n_predict: int = 8  # the extension's default is 128; a CPU run keeps replies short
    returning: int = 3
    n_cmpl: int = 1  # the extension's default 3 exceeds 2 slots: the server answers 400
    slots: int = 2
    ctx_per_slot: int = 4096
    seed: int = 35
    file_lines: int = 400


@dataclass
class FimResult:
    options: dict[str, Any]
    requests: list[Request] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    saves: list[Saves] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "requests": [asdict(r) for r in self.requests],
            "notes": self.notes,
            "saves": [asdict(s) for s in self.saves],
        }


@dataclass
class Saves:
    """A kvproxy arm's saves while it served the session (before its restart)."""

    arm: str
    files: int
    bytes: int
    seconds: float

    @classmethod
    def of(cls, arm: str, stats: dict[str, Any]) -> Saves:
        spent = stats.get("histograms", {}).get("save_seconds", {}).get("sum")
        return cls(arm, int(stats.get("saves", 0)), int(stats.get("saved_bytes", 0)), spent or 0.0)


def session(opts: FimOptions) -> list[FimRequest]:
    return editing_session(
        opts.seed,
        opts.edits,
        FimConfig(n_predict=opts.n_predict, max_parallel_completions=opts.n_cmpl),
        opts.file_lines,
    )


@dataclass
class Tokens:
    """The server's tokens of text pieces, each tokenised once."""

    client: Client
    base: str
    n_ctx: int  # per slot
    known: dict[tuple[str, bool], list[int]] = field(default_factory=dict)

    async def of(self, text: str, special: bool = False) -> list[int]:
        if (text, special) not in self.known:
            got = await self.client.post_json(
                self.base + "/tokenize", {"content": text, "add_special": special}
            )
            self.known[text, special] = [int(t) for t in got["tokens"]]
        return self.known[text, special]

    async def infill(self, body: dict[str, Any]) -> list[int]:
        """`format_prompt_infill`'s layout and cuts (no spm_infill): the end of the prefix
        that fits 3/4 of a batch, the start of the suffix that fits the rest, the end of the
        extra chunks that fits the context beyond a batch (the server's n_predict: -1)."""
        extra: list[int] = []
        chunks = body.get("input_extra") or []
        if chunks:
            extra = [FIM_REP, *await self.of("myproject\n")]
        for chunk in chunks:
            extra += [FIM_SEP, *await self.of(chunk.get("filename", "tmp") + "\n")]
            extra += await self.of(chunk["text"])
        if chunks:
            extra += [FIM_SEP, *await self.of("filename\n")]
        bos = (await self.of("", True))[:1]
        prefix = await self.of(body["input_prefix"])
        prompt = await self.of(body["prompt"])
        suffix = await self.of(body["input_suffix"])
        prefix = prefix[len(prefix) - min(len(prefix), 3 * (N_BATCH // 4)) :]
        suffix = suffix[: min(len(suffix), max(0, N_BATCH // 4 - (2 + len(prompt))))]
        extra = extra[len(extra) - min(max(0, self.n_ctx - N_BATCH + 2), len(extra)) :]
        return [*extra, *bos, FIM_PRE, *prefix, *prompt, FIM_SUF, *suffix, FIM_MID]


def ideal(now: list[int], earlier: list[list[int]]) -> int:
    return len(now) - max((shared_prefix(now, e) for e in earlier), default=0)


async def run_fim(env: BenchEnv, opts: FimOptions) -> FimResult:
    result = FimResult(options=asdict(opts))
    client = Client()
    try:
        for arm in arms(env, opts):
            progress(f"fim: {arm.name}")
            async with arm:
                await _replay(client, arm, opts, result)
    finally:
        await client.close()
    return result


def arms(env: BenchEnv, opts: FimOptions) -> list[Arm]:
    writes = ProxyArm(
        env, opts.slots, opts.ctx_per_slot, ["--write-through"], name=KVPROXY_WRITE_THROUGH
    )
    return [*side_by_side(env, opts.slots, opts.ctx_per_slot), writes]


def _record(
    result: FimResult,
    arm: Arm,
    phase: str,
    req: FimRequest,
    status: int,
    timings: Any,
    evaluated: int = 0,
    **kw: Any,
) -> None:
    t = timings if isinstance(timings, dict) else {}
    cached, prefilled = int(t.get("cache_n", 0)), int(t.get("prompt_n", 0))
    # Evaluated by kvproxy before forwarding (X-KVProxy-Evaluated-Tokens): prefilled for it.
    moved = min(cached, evaluated)
    cached, prefilled = cached - moved, prefilled + moved
    row = Request(arm.name, phase, f"{req.kind} {req.note}", status, cached, prefilled, **kw)
    result.requests.append(row)
    progress(
        f"  {arm.name} {phase} {row.what}: {cached} cached, {prefilled} prefilled {row.cache_state}"
    )


async def _replay(client: Client, arm: Arm, opts: FimOptions, result: FimResult) -> None:
    requests = session(opts)
    tokens = Tokens(client, arm.url, opts.ctx_per_slot)
    seen: list[list[int]] = []
    for req in requests:
        async with client.session.post(arm.url + "/infill", json=req.body) as resp:
            body = await resp.json(content_type=None)
            state = resp.headers.get("X-KVProxy-Cache", "-")
            evaluated = int(resp.headers.get("X-KVProxy-Evaluated-Tokens", 0))
        if resp.status == 501:
            result.notes.append(f"{arm.name}: /infill answered 501: {str(body)[:160]}")
            break
        now = await tokens.infill(req.body)
        error = None if resp.status == 200 else str(body)[:160]
        _record(
            result,
            arm,
            "infill",
            req,
            resp.status,
            body.get("timings"),
            evaluated,
            ideal=ideal(now, seen),
            cache_state=state,
            error=error,
        )
        seen.append(now)
    completions = [r for r in requests if r.openai is not None]
    seen = []
    for req in completions:
        seen.append(await _openai(client, tokens, arm, req, "openai", seen, result))
    if isinstance(arm, ProxyArm):
        result.saves.append(Saves.of(arm.name, await arm.stats()))
    await arm.restart()
    tokens.base = arm.url
    for req in completions[-opts.returning :]:
        await _openai(client, tokens, arm, req, "after restart", seen, result)


async def _openai(
    client: Client,
    tokens: Tokens,
    arm: Arm,
    req: FimRequest,
    phase: str,
    seen: list[list[int]],
    result: FimResult,
) -> list[int]:
    """One `client.completions.create` with the OpenAI SDK, as handleOpenAICompletion sends it."""
    from openai import APIStatusError, AsyncOpenAI

    assert req.openai is not None
    now = await tokens.of(req.openai["prompt"], True)
    sdk = AsyncOpenAI(base_url=arm.url + "/v1", api_key="kvproxy-bench", max_retries=0)
    status, timings, state, error, evaluated = 200, None, "-", None, 0
    try:
        async with sdk:
            raw = await sdk.completions.with_raw_response.create(**req.openai)
            state = raw.headers.get("X-KVProxy-Cache", "-")
            evaluated = int(raw.headers.get("X-KVProxy-Evaluated-Tokens", 0))
            timings = (raw.parse().model_extra or {}).get("timings")
    except APIStatusError as exc:
        status, error = exc.status_code, str(exc)[:160]
    _record(
        result,
        arm,
        phase,
        req,
        status,
        timings,
        evaluated,
        ideal=ideal(now, seen),
        cache_state=state,
        error=error,
    )
    return now


def markdown(result: FimResult) -> str:
    opts = FimOptions(**result.options)
    n = session(opts)
    head = (
        f"llama.vscode's editing session (fim.py, seed {opts.seed}): {opts.edits} lines typed, "
        f"{sum(r.kind == 'infill' for r in n)} completions, "
        f"{sum(r.kind == 'ring' for r in n)} ring updates (n_predict 0), replayed to "
        f"`/infill`, then the completions with the OpenAI SDK on `/v1/completions`, then "
        f"after a restart the last {opts.returning} again; {opts.slots} slots."
    )
    notes = "".join(f"\n- {n}" for n in result.notes)
    names = [DIRECT_RAM_CACHE, KVPROXY, KVPROXY_WRITE_THROUGH]
    saves = table(
        ["arm", "saves while serving", "MB written", "seconds saving"],
        [[s.arm, s.files, f"{s.bytes / 1e6:.1f}", f"{s.seconds:.2f}"] for s in result.saves],
    )
    return (
        f"{head}\n{notes}\n\n{summary_table(result.requests, names, PHASES)}\n\n"
        f"{saves}\n\n"
        f"<details><summary>every request</summary>\n\n{detail_table(result.requests)}\n\n"
        "</details>"
    )
