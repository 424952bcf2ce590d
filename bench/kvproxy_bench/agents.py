"""`agents`: the real clients (the OpenAI SDK loop always; Codex, Claude Code and OpenClaw
when installed, or with `--install`) through kvproxy and through llama-server alone, over one
plan: a session's turns 1, 2 after an eviction (other conversations take every slot), 3 after
a restart of every process, then new sessions (after an eviction, after a restart).

Every request the client makes goes through a recording tap (bench/kvproxy_bench/tap.py) in front
of the arm, which reads the server's own numbers from each reply (`cache_n`, `prompt_n`) and
kvproxy's decision (`X-KVProxy-Cache`).

Ideal: what a perfect cache holding every earlier state of this client could reuse. For a
request, the longest common token prefix of its rendered prompt with any earlier request's
rendered prompt plus its reply, or with an earlier prompt alone: the conversation's previous
turn; for a new session, the opening it shares with the earlier ones. kvproxy can exceed it
(above 100%) where its canonical prefix also holds the end-of-turn markup after the reply.
Rendered by the server's `/apply-template` from the chat form the server makes of the body,
tokenised by its `/tokenize`. "% of ideal" = cache_n / ideal. What a client rewrites itself
is below the ideal: that is the client's cost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
from dataclasses import asdict, dataclass
from typing import Any

from kvproxy_bench import agentcases, agentclients
from kvproxy_bench.agentcases import CASES, TARGETS, Case
from kvproxy_bench.agentdrivers import CLIENTS, LABELS, PACKAGES, SDK, Driver, Settings, make_driver
from kvproxy_bench.agentrecord import AgentsResult as AgentsResult
from kvproxy_bench.agentrecord import Row as Row
from kvproxy_bench.agentrecord import record_turn, take_every_slot
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, make_arm
from kvproxy_bench.client import Client
from kvproxy_bench.report import pct, progress, table
from kvproxy_bench.tap import Tap
from kvproxy_bench.targets import Check


class Action(enum.Enum):
    TURN = "turn"
    EVICT = "evict"  # other conversations take every slot
    RESTART = "restart"  # every process of the arm: only the disk survives


@dataclass(frozen=True)
class Step:
    action: Action
    label: str = ""
    session: int = 0
    first: bool = False  # the session's first turn
    message: str = ""


EVICT = Step(Action.EVICT)
RESTART = Step(Action.RESTART)
AFTER_EVICTION = "2 (after eviction)"
AFTER_RESTART = "3 (after restart)"
NEW_AFTER_EVICTION = "new session (after eviction)"
# A request sharing fewer tokens than kvproxy's default --min-tokens with anything earlier
# has nothing a cache should bring back: not judged.
WORTH_JUDGING = 256
NEW_AFTER_RESTART = "new session (after restart)"
PLAN = (
    Step(Action.TURN, "1", 1, True, "Say hi."),
    EVICT,
    Step(Action.TURN, AFTER_EVICTION, 1, False, "Now say bye."),
    RESTART,
    Step(Action.TURN, AFTER_RESTART, 1, False, "Thanks. One more word?"),
    EVICT,
    Step(Action.TURN, NEW_AFTER_EVICTION, 2, True, "Say hello."),
    RESTART,
    Step(Action.TURN, NEW_AFTER_RESTART, 3, True, "Name a colour."),
)
LATER = (AFTER_EVICTION, AFTER_RESTART)
NEW_SESSIONS = (NEW_AFTER_EVICTION, NEW_AFTER_RESTART)


@dataclass
class AgentsOptions:
    clients: tuple[str, ...] | None = None  # None: the SDK and every installed agent
    arms: tuple[str, ...] = (KVPROXY, DIRECT_RAM_CACHE)
    install: bool = False  # install the missing agents (npm, PyPI)
    slots: int = 2
    ctx_per_slot: int = 32768  # `-np 2 -c 65536`: OpenClaw's prompt is ~10k tokens
    max_output: int = 64  # the agents' replies, capped (and the server's -n)
    sdk_prompt_tokens: int = 1400
    evict_facts: int = 30  # size of each conversation that takes a slot
    proxy_args: tuple[str, ...] = ()
    new_sessions: bool = True  # the plan's last four steps (False: a shorter run, the tests)
    cases: tuple[str, ...] = CASES  # agentcases.py's, after the plan
    plan: bool = True  # False: the cases only


def choose_clients(opts: AgentsOptions) -> tuple[dict[str, Any], dict[str, str]]:
    """The clients to run (name → executable, None for the SDK) and why others are not.
    Blocking (it may install): call it in a thread."""
    wanted = opts.clients or CLIENTS
    chosen: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for name in wanted:
        if name == SDK:
            chosen[name] = None
            continue
        package = PACKAGES[name]
        exe = agentclients.installed(package)
        if exe is None and opts.install:
            exe = agentclients.install(package)
        if exe is None:
            skipped[name] = (
                f"{package.name}@{package.version} not installed (--install installs it)"
            )
        else:
            chosen[name] = exe
    return chosen, skipped


async def run_agents(env: BenchEnv, opts: AgentsOptions) -> AgentsResult:
    result = AgentsResult(options=asdict(opts))
    chosen, result.skipped = await asyncio.to_thread(choose_clients, opts)
    if opts.clients is not None and result.skipped:
        raise RuntimeError(f"clients not installed: {result.skipped}")
    # Agents send no output limit (Codex) or one of their own: the server caps every reply.
    env = dataclasses.replace(env, server_args=[*env.server_args, "-n", str(opts.max_output)])
    client = Client()
    try:
        for name, exe in chosen.items() if opts.plan else ():
            for arm_name in opts.arms:
                arm = make_arm(arm_name, env, opts.slots, opts.ctx_per_slot, list(opts.proxy_args))
                progress(f"agents: {LABELS[name]} through {arm_name}")
                home = env.new_dir(f"{name}-home")
                async with arm:
                    tap = Tap(arm.url)
                    await tap.start()
                    settings = Settings(home, tap.url, opts.max_output, opts.sdk_prompt_tokens)
                    driver = make_driver(name, settings, exe)
                    try:
                        await _run_plan(client, arm, tap, driver, opts, result)
                    finally:
                        await driver.close()
                        await tap.stop()
        for case in opts.cases:
            await agentcases.run_case(client, Case(case), chosen, env, opts, result)
    finally:
        await client.close()
    return result


async def _run_plan(
    client: Client, arm: Arm, tap: Tap, driver: Driver, opts: AgentsOptions, result: AgentsResult
) -> None:
    failed = await driver.prepare()
    if failed:
        result.failures.append(f"{LABELS[driver.name]} ({arm.name}): {failed}")
        return
    history: list[list[int]] = []  # every earlier request's prompt + reply, as tokens
    evictions = 0
    for step in PLAN if opts.new_sessions else PLAN[:5]:
        if step.action is Action.EVICT:
            evictions += 1
            await take_every_slot(client, arm.url, opts.slots, opts.evict_facts, evictions)
            continue
        if step.action is Action.RESTART:
            progress(f"  restarting {arm.name}")
            await arm.restart()
            tap.upstream = arm.url
            continue
        failed = await driver.turn(step.session, step.first, step.message)
        if failed:
            result.failures.append(
                f"{LABELS[driver.name]} ({arm.name}) turn {step.label}: {failed}"
            )
        await record_turn(client, arm.url, tap, driver.name, arm.name, step.label, history, result)


# --- the tables

METHOD = """## agents: the real clients, turn by turn

`kvproxy bench agents` drives the clients that are installed (`--install` installs the pinned
npm releases; the OpenAI SDK loop always runs) through kvproxy and through llama-server alone
(default flags: its RAM prompt cache on). Each client runs one plan: a session's turn 1; turn 2
after two other conversations took both slots; turn 3 after a restart of every process (for
kvproxy: kvproxy and its llama-server; only the disk survives); a new session after another
eviction; a new session after another restart. Replies are capped (`-n 64` on the server, the
client's own cap where it has one). A recording pass-through in front of each arm reads every
request's body and the server's own `cache_n`/`prompt_n` from its reply, and kvproxy's
`X-KVProxy-Cache`. **ideal** = the longest common token prefix of the request's prompt with any
earlier request's prompt, or prompt + reply (rendered by the server's `/apply-template`,
counted by its `/tokenize`); for a new session that is what it shares with the earlier ones
(the system prompt and tools). What a client rewrites itself is beyond any cache: it lowers
the ideal, not the % of ideal. kvproxy may exceed 100% where its canonical prefix also holds
the end-of-turn markup after the reply.

Then three cases, each on fresh processes (`--cases` picks them): **interrupted** — Claude
Code stopped with Ctrl-C two seconds into a long reply, the OpenAI SDK loop's stream closed
likewise, then the next turn; **date change** — a ~1,400-token system prompt with a
`Current date:` line ~400 tokens before its end, the next day's new session after other
conversations took both slots (its ideal is the unchanged head); **two agents** — two
clients' sessions interleaved, a third plain conversation between every turn (three
conversations, two slots).
"""


def pct_of_ideal(cached: int, ideal: int | None) -> float | None:
    return cached / ideal if ideal else None


# kvproxy's decisions that bring nothing from its cache.
UNCACHED = frozenset({"miss", "bypass"})


def credited(r: Row) -> int:
    """What the cache served. The server's cache_n also counts what kvproxy had it evaluate
    on the way (X-KVProxy-Evaluated-Tokens: an opening, saved before the request extends it),
    prefilled within this request's time: not credited. A `miss` is credited 0."""
    return 0 if r.decision in UNCACHED else max(0, r.cache_n - r.evaluated)


def _ratio(r: Row | None) -> str | None:
    return None if r is None else f"{r.cache_n:,} / {r.prompt_n:,}"


def _of_ideal(r: Row | None) -> str | None:
    if r is None:
        return None
    value = pct_of_ideal(credited(r), r.ideal)
    return None if value is None else f"{100 * value:.1f}%"


def markdown(result: AgentsResult) -> str:
    opts = AgentsOptions(**result.options)
    proxy_arm = KVPROXY if KVPROXY in opts.arms else opts.arms[0]
    others = [a for a in opts.arms if a != proxy_arm]
    direct = others[0] if others else None
    by = {(r.client, r.arm, r.turn, r.request): r for r in result.rows}
    rows: list[list[object]] = []
    seen: set[tuple[str, str, int]] = set()
    for r in result.rows:
        key = (r.client, r.turn, r.request)
        if key in seen:
            continue
        seen.add(key)
        mine = by.get((r.client, proxy_arm, r.turn, r.request))
        theirs = by.get((r.client, direct, r.turn, r.request)) if direct else None
        rows.append(
            [
                LABELS[r.client],
                r.turn,
                r.request,
                mine.decision if mine else None,
                _ratio(mine),
                pct(mine.cache_n, mine.presented) if mine else None,
                mine.ideal if mine else None,
                _of_ideal(mine),
                _ratio(theirs),
                pct(theirs.cache_n, theirs.presented) if theirs else None,
                _of_ideal(theirs),
            ]
        )
    cols = [
        "client",
        "turn",
        "req.",
        "decision",
        "cache_n / prompt_n",
        "from cache",
        "ideal",
        "% of ideal",
        f"{direct or 'direct'}: cache_n / prompt_n",
        "from cache",
        "% of ideal",
    ]
    text = table(cols, rows)
    notes = []
    if any(r.decision in UNCACHED and r.cache_n for r in result.rows):
        notes.append(
            "- `miss` rows: the server's cache_n counts the shared opening kvproxy evaluated on "
            "the slot just before (to save it); prefilled within the request, so % of ideal "
            "counts 0."
        )
    if any(r.evaluated and r.decision not in UNCACHED for r in result.rows):
        notes.append(
            "- rows with tokens kvproxy evaluated on the way (a deeper opening, saved before "
            "the request extends it): the server's cache_n counts them; % of ideal does not."
        )
    notes += [f"- {LABELS[c]}: {why}" for c, why in result.skipped.items()]
    notes += [f"- {f}" for f in result.failures]
    notes += [
        f"- {LABELS[r.client]} ({r.arm}) turn {r.turn}.{r.request}: {r.error}"
        for r in result.rows
        if r.error
    ]
    return text + ("\n\n" + "\n".join(notes) if notes else "")


# --- the command line and the targets


def options(given: dict[str, Any], clients: str | None, cases: str | None = None) -> AgentsOptions:
    """The options from `kvproxy bench agents` flags (those given; the rest keep defaults)."""
    opts = AgentsOptions(**given)
    if clients is not None:
        names = tuple(c.strip() for c in clients.split(",") if c.strip())
        unknown = [c for c in names if c not in CLIENTS]
        if unknown:
            raise SystemExit(f"kvproxy bench: unknown client(s) {unknown}; known: {list(CLIENTS)}")
        opts.clients = names
    if cases is not None:
        opts.cases = agentcases.parse_cases(cases)
    return opts


def checks(result: AgentsResult) -> list[Check]:
    """Issue #14's targets: later turns after an eviction and after a restart ≥ 99% of the
    ideal, every client; a new session's first turn ≥ 95% of what it shares with the earlier
    ones (the system prompt), on a restarted proxy and when only the disk held it."""
    opts = AgentsOptions(**result.options)
    if KVPROXY not in opts.arms:
        return []
    # The first request of a turn with something to reuse is the one that meets the eviction
    # or the restart (Claude Code's continuations of a cut reply are resident after it; a
    # new Claude Code session opens with a prompt that shares ~30 tokens with the others).
    first: dict[tuple[str, str, str], Row] = {}
    for row in result.rows:
        if row.ideal is not None and row.ideal >= WORTH_JUDGING:
            first.setdefault((row.client, row.arm, row.turn), row)
    out = []
    for client in dict.fromkeys(r.client for r in result.rows) if opts.plan else ():
        for turn, bar in [*((t, 0.99) for t in LATER), *((t, 0.95) for t in NEW_SESSIONS)]:
            r = first.get((client, KVPROXY, turn))
            value = pct_of_ideal(credited(r), r.ideal) if r else None
            measured = (
                "not measured"
                if r is None or value is None
                else f"{100 * value:.1f}% ({credited(r):,} of {r.ideal:,}; {r.decision})"
            )
            out.append(
                Check(
                    f"agents: {LABELS[client]} turn {turn} ≥ {bar:.0%} of ideal",
                    measured,
                    None if value is None else value >= bar,
                )
            )
    return out + _case_checks(result, first)


def _case_checks(result: AgentsResult, first: dict[tuple[str, str, str], Row]) -> list[Check]:
    """The cases' targets, for each client that ran the case through kvproxy."""
    ran = dict.fromkeys(
        (r.client, r.turn) for r in result.rows if r.arm == KVPROXY and r.turn in TARGETS
    )
    out = []
    for client, turn in ran:
        bar = TARGETS[turn]
        r = first.get((client, KVPROXY, turn))
        value = pct_of_ideal(credited(r), r.ideal) if r else None
        measured = (
            "not measured"
            if r is None or value is None
            else f"{100 * value:.1f}% ({credited(r):,} of {r.ideal:,}; {r.decision})"
        )
        met = None if value is None else value >= bar
        out.append(Check(f"agents: {LABELS[client]} {turn} ≥ {bar:.0%} of ideal", measured, met))
    return out
