"""Claude Code, Codex and OpenClaw, the real clients from npm, through kvproxy in front of the
real llama-server (bundled model, -np 2), with other conversations taking both slots between
their turns: each later turn's prompt comes back from cache, Codex does at least as well
through kvproxy as talking to the server directly, and two agents interleaved with a third
conversation each reach 99% of their ideal."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

import aiohttp
import orjson
import pytest
from aiohttp import web
from kvproxy_bench import agents
from kvproxy_bench.agentcases import TWO_AGENTS_LATER, Case
from kvproxy_bench.agentdrivers import CLAUDE_CODE as CLAUDE_CODE_CLIENT
from kvproxy_bench.agentdrivers import OPENCLAW as OPENCLAW_CLIENT
from kvproxy_bench.arms import KVPROXY, BenchEnv
from kvproxy_bench.dialogues import first_turn

from kvproxy.cache.reports.events import Count, RequestEvent, SlotActionEvent
from kvproxy.edge.app import SERVICE
from kvproxy.http.relay import send
from kvproxy.server.managed import free_port

from .agents import CLAUDE_CODE, CODEX, client_env, install
from .conftest import RealServer, RunningProxy, start_proxy, start_real_server

pytestmark = pytest.mark.real

# Agent prompts are ~4–5k tokens; room for them in each of the two slots.
CTX_PER_SLOT = 32768
# Neither client lets the server stop early on its own: keep replies short.
MAX_OUTPUT = "64"


@dataclass
class Turn:
    decision: str
    cache_n: int
    prompt_n: int

    @property
    def cached(self) -> float:
        return self.cache_n / max(1, self.cache_n + self.prompt_n)


class Recorder:
    """Every keyed request kvproxy served, as it reported it."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.statuses: list[int] = []

    def on_request(self, event: RequestEvent) -> None:
        self.statuses.append(event.status)
        if event.cache_n is not None and event.prompt_n is not None:
            self.turns.append(Turn(str(event.decision), event.cache_n, event.prompt_n))

    def on_slot_action(self, event: SlotActionEvent) -> None:
        del event

    def on_count(self, what: Count, n: int) -> None:
        del what, n

    def take(self) -> list[Turn]:
        out, self.turns = self.turns, []
        return out


def run(command: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,  # a pipe left open makes `claude -p` wait for input
        capture_output=True,
        text=True,
        timeout=900,
    )


async def settled(proxy: RunningProxy) -> None:
    """Until kvproxy's detached work is done: a miss is reported once it is explained, off
    the request path, so the others' last one would otherwise count as the agent's."""
    for _ in range(1200):
        if not len(proxy.cache.background):
            return
        await asyncio.sleep(0.1)


async def take_both_slots(url: str) -> None:
    """Three other conversations at once take both slots: whatever the slots held goes to
    disk (or is lost, direct). One after another, kvproxy may keep the agent's long state
    and give the others the same slot."""

    async def one(s: aiohttp.ClientSession, n: int) -> None:
        body = {"messages": first_turn(n, n_facts=30), "max_tokens": 4, "temperature": 0}
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, n) for n in (101, 102, 103)))


# A real llama-server, kvproxy in front of it, and what kvproxy reported.
Stack: TypeAlias = tuple[RealServer, RunningProxy, "Recorder"]


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    extra = ("--cache-ram", "0", "--swa-full", "-n", MAX_OUTPUT)
    server = start_real_server(cache, ctx_per_slot=CTX_PER_SLOT, extra=extra)
    proxy: RunningProxy = await start_proxy(server.url, cache)
    recorder = Recorder()
    proxy.app[SERVICE].events.listeners.append(recorder)
    try:
        yield server, proxy, recorder
    finally:
        await proxy.stop()
        server.stop()


def table(client: str, rows: list[tuple[str, list[Turn]]]) -> None:
    print("\n| client | turn | decision | cache_n | prompt_n | from cache |")
    print("|---|---|---|---|---|---|")
    for name, turns in rows:
        for t in turns:
            print(
                f"| {client} | {name} | {t.decision} | {t.cache_n} | {t.prompt_n} | {t.cached:.1%} |"
            )


def claude_env(home: Path, base_url: str, max_output: str = MAX_OUTPUT) -> dict[str, str]:
    """Claude Code pointed at `base_url`, offline, its replies capped."""
    return client_env(
        home,
        ANTHROPIC_BASE_URL=base_url,
        ANTHROPIC_API_KEY="kvproxy-test",
        DISABLE_TELEMETRY="1",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=max_output,
    )


# The first agent test installs its client (npm) and loads the stack: a few minutes alone,
# more on a loaded machine; the default 300 s was seen to cut it off in a full run.
@pytest.mark.timeout(900)
async def test_claude_code_turns_come_back_after_other_conversations(
    stack: Stack, tmp_path: Path
) -> None:
    server, proxy, recorder = stack
    claude = await asyncio.to_thread(install, CLAUDE_CODE)
    home = tmp_path / "claude-home"
    home.mkdir()
    env = claude_env(home, proxy.url)
    # A reply cut at the output limit makes claude exit 1 after it; the requests are what
    # this measures.
    first = await asyncio.to_thread(run, [str(claude), "-p", "Say hi."], env, home)
    turn1 = recorder.take()
    assert turn1, first.stdout + first.stderr
    await take_both_slots(proxy.url)
    await settled(proxy)
    recorder.take()
    later = await asyncio.to_thread(
        run, [str(claude), "-p", "--continue", "Now say bye."], env, home
    )
    turn2 = recorder.take()
    table("Claude Code", [("1", turn1), ("2 (after 2 others)", turn2)])
    assert turn2, later.stdout + later.stderr
    assert turn2[0].decision == "restored", turn2
    assert all(t.decision in ("restored", "resident") for t in turn2), turn2
    assert all(t.cached >= 0.95 for t in turn2), turn2


def codex_config(home: Path, base_url: str) -> None:
    """A custom provider speaking the Responses API (`wire_api = "chat"` is refused by this
    version); Codex reads it from ~/.codex/config.toml."""
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text(
        'model = "gemma"\n'
        'model_provider = "kvproxy"\n\n'
        "[model_providers.kvproxy]\n"
        'name = "kvproxy"\n'
        f'base_url = "{base_url}/v1"\n'
        'wire_api = "responses"\n'
    )


async def codex_two_turns(
    codex: Path,
    base_url: str,
    home: Path,
    between: Callable[[], Awaitable[None]],
    seen: Callable[[], Awaitable[list[Turn]]],
) -> list[tuple[str, list[Turn]]]:
    home.mkdir()
    codex_config(home, base_url)
    env = client_env(home)
    rows = []
    for name, args in (
        ("1", ["exec", "--skip-git-repo-check", "Say hi."]),
        ("2 (after 2 others)", ["exec", "--skip-git-repo-check", "resume", "--last", "Now bye."]),
    ):
        done = await asyncio.to_thread(run, [str(codex), *args], env, home)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        rows.append((name, await seen()))
        if name == "1":
            await between()
    return rows


@pytest.mark.timeout(900)
async def test_codex_turns_come_back_and_beat_the_server_alone(
    stack: Stack, tmp_path: Path
) -> None:
    server, proxy, recorder = stack
    codex = await asyncio.to_thread(install, CODEX)

    async def evict_through_proxy() -> None:
        await take_both_slots(proxy.url)
        await settled(proxy)
        recorder.take()

    async def seen_by_proxy() -> list[Turn]:
        return recorder.take()

    through = await codex_two_turns(
        codex, proxy.url, tmp_path / "codex-proxy", evict_through_proxy, seen_by_proxy
    )

    # The same two turns straight to llama-server, with the same two conversations between
    # them; what it reused is read off its /slots-free answer: the Responses usage.
    direct_seen: list[Turn] = []

    async def evict_direct() -> None:
        await take_both_slots(server.url)

    async def seen_direct() -> list[Turn]:
        out = list(direct_seen)
        direct_seen.clear()
        return out

    tap = ResponsesTap(server.url, direct_seen)
    await tap.start()
    try:
        direct = await codex_two_turns(
            codex, tap.url, tmp_path / "codex-direct", evict_direct, seen_direct
        )
    finally:
        await tap.stop()
    table("Codex via kvproxy", through)
    table("Codex direct", direct)
    later_proxy, later_direct = through[1][1], direct[1][1]
    assert later_proxy and later_direct
    assert later_proxy[0].decision == "restored", later_proxy
    assert all(t.cached >= 0.95 for t in later_proxy), later_proxy
    assert sum(t.cache_n for t in later_proxy) >= sum(t.cache_n for t in later_direct)


class ResponsesTap:
    """A pass-through in front of the server that reads the usage of every Responses reply
    (what the server reused when talking to it directly)."""

    def __init__(self, upstream: str, sink: list[Turn]) -> None:
        self.upstream = upstream
        self.sink = sink
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with (
                aiohttp.ClientSession() as s,
                s.request(
                    request.method,
                    self.upstream + request.path_qs,
                    data=body,
                    headers={"Content-Type": request.content_type or "application/json"},
                ) as r,
            ):
                resp = web.StreamResponse(status=r.status)
                resp.content_type = r.content_type
                await resp.prepare(request)
                raw = b""
                gone = False
                async for chunk in r.content.iter_any():
                    raw += chunk
                    gone = gone or not await send(resp, chunk)
                self._usage(raw)  # Codex hangs up at the last event: the usage is still read
                if not gone:
                    await send(resp, b"", eof=True)
                return resp

        app = web.Application(client_max_size=1 << 26)
        app.router.add_route("*", "/{tail:.*}", forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    def _usage(self, raw: bytes) -> None:
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                data = orjson.loads(line[6:])
                usage = (data.get("response") or {}).get("usage")
                if data.get("type") == "response.completed" and usage:
                    cached = usage["input_tokens_details"]["cached_tokens"]
                    self.sink.append(Turn("direct", cached, usage["input_tokens"] - cached))

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.mark.timeout(900)
async def test_a_claude_code_turn_interrupted_mid_reply_leaves_its_state(
    stack: Stack, tmp_path: Path
) -> None:
    """`claude -p --continue` stopped with Ctrl-C while its reply streams (a user pressing
    Esc or Ctrl-C): the next turn is served from the interrupted prompt kept in the slot."""
    server, proxy, recorder = stack
    claude = await asyncio.to_thread(install, CLAUDE_CODE)
    home = tmp_path / "claude-home"
    home.mkdir()
    env = claude_env(home, proxy.url)
    await asyncio.to_thread(run, [str(claude), "-p", "Say hi."], env, home)
    await settled(proxy)
    recorder.take()
    # A long reply this time (the request's cap overrides the server's -n), stopped midway.
    long_env = claude_env(home, proxy.url, max_output="4000")
    proc = await asyncio.create_subprocess_exec(
        str(claude),
        *("-p", "--continue", "Write a long story about shelves."),
        env=long_env,
        cwd=home,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        for _ in range(1200):  # until the reply streams: the slot is busy generating
            slots = await proxy.app[SERVICE].cache.backend.client.slots()
            if any(s.is_processing for s in slots) and recorder.turns == []:
                await asyncio.sleep(2.0)  # well into the reply
                break
            await asyncio.sleep(0.1)
        proc.send_signal(2)  # SIGINT: Ctrl-C
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    await settled(proxy)
    recorder.take()
    assert 499 in recorder.statuses, "the turn was cut off mid-reply (a client gone: 499)"
    later = await asyncio.to_thread(
        run, [str(claude), "-p", "--continue", "Now say bye."], env, home
    )
    turn3 = recorder.take()
    table("Claude Code", [("3 (after an interrupted turn)", turn3)])
    assert turn3, later.stdout + later.stderr
    assert turn3[0].decision in ("resident", "restored"), turn3
    assert turn3[0].cached >= 0.95, turn3


@pytest.fixture
async def bench_env(tmp_path: Path) -> AsyncIterator[BenchEnv]:
    env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work")
    env.server_args.append("--no-warmup")  # nothing here is timed
    yield env


@pytest.mark.timeout(1800)  # six agent turns (OpenClaw's prompt: ~10k tokens) and five others
async def test_two_agents_at_once_come_back_while_a_third_conversation_churns_the_slots(
    bench_env: BenchEnv,
) -> None:
    """OpenClaw and Claude Code sessions interleaved on a 2-slot server, a plain conversation
    between every turn (three conversations, two slots: each agent's state leaves its slot
    and comes back), as `kvproxy bench agents` runs its two-agents case: each agent's later
    turns reuse ≥ 99% of their ideal (what a perfect cache of every earlier state of that
    agent could reuse, from the server's own rendering and tokens)."""
    opts = agents.AgentsOptions(
        clients=(OPENCLAW_CLIENT, CLAUDE_CODE_CLIENT),
        arms=(KVPROXY,),
        install=True,  # from npm, as `kvproxy bench agents --install` does
        cases=(Case.TWO_AGENTS.value,),
        plan=False,
    )
    result = await agents.run_agents(bench_env, opts)
    print("\n" + agents.markdown(result))
    assert result.failures == [] and result.skipped == {}, result
    assert all(r.error is None for r in result.rows), result.rows
    for client in (OPENCLAW_CLIENT, CLAUDE_CODE_CLIENT):
        mine = [r for r in result.rows if r.client == client]
        for label in TWO_AGENTS_LATER:
            judged = [r for r in mine if r.turn == label and (r.ideal or 0) >= agents.WORTH_JUDGING]
            assert judged, (client, label, mine)
            assert judged[0].decision in ("resident", "restored"), judged
    checks = [c for c in agents.checks(result) if any(t in c.target for t in TWO_AGENTS_LATER)]
    assert len(checks) == 4, checks
    assert all(c.met for c in checks), checks
