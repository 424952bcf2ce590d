"""`kvproxy bench agents`' cases beyond its plan: agents as people really run them.

- **interrupted**: a turn stopped mid-reply as its user stops it (Claude Code: Ctrl-C; the
  OpenAI SDK loop: the stream closed, as a chat UI's stop button does), then the next turn.
  The slot held the interrupted prompt and what was generated of the reply.
- **date-change**: a long system prompt with a `Current date:` line ~400 tokens before its
  end (as OpenClaw writes one); the next day's new session, after other conversations took
  every slot, against what it shares with the first day's: the unchanged head.
- **date-in-a-sentence**: the same, the prompt one paragraph and the date inside a sentence
  (`… reports. Current date: 2026-12-02. The crews …`).
- **two-agents**: two clients' sessions interleaved on one server, a third plain
  conversation between every turn (three conversations, two slots: the slots churn).

Each runs on a fresh arm of its own (kvproxy, then llama-server alone), through the same
recording tap as the plan; its rows are labelled `CASE: …` in the same table.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvproxy_bench.agentdrivers import (
    AIDER,
    CLAUDE_CODE,
    CODEX,
    INTERRUPTIBLE,
    LABELS,
    OPENCLAW,
    SDK,
    Driver,
    Interruptible,
    SdkDriver,
    Settings,
    make_driver,
)
from kvproxy_bench.agentrecord import AgentsResult, record_turn, take_every_slot
from kvproxy_bench.arms import Arm, BenchEnv, make_arm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import first_turn
from kvproxy_bench.report import progress
from kvproxy_bench.tap import Tap

if TYPE_CHECKING:
    from kvproxy_bench.agents import AgentsOptions


class Case(enum.Enum):
    INTERRUPTED = "interrupted"
    DATE_CHANGE = "date-change"
    DATE_IN_SENTENCE = "date-in-a-sentence"
    TWO_AGENTS = "two-agents"


CASES = tuple(c.value for c in Case)
DATED = (Case.DATE_CHANGE, Case.DATE_IN_SENTENCE)


class Do(enum.Enum):
    TURN = "turn"
    INTERRUPT = "interrupt"  # a turn stopped mid-reply
    EVICT = "evict"  # other conversations take every slot
    CHURN = "churn"  # the third conversation's next turn


@dataclass(frozen=True)
class CaseStep:
    do: Do
    label: str = ""
    agent: int = 0  # which of the case's clients
    session: int = 1
    first: bool = False
    message: str = ""


INTERRUPTED_TURN = "interrupted: 2 (stopped mid-reply)"
AFTER_INTERRUPT = "interrupted: 3 (the next turn)"
NEW_DAY = "date change: new session, next day"
NEW_DAY_IN_SENTENCE = "date in a sentence: new session, next day"
TWO_AGENTS_LATER = ("two agents: 2", "two agents: 3")
CHURN = CaseStep(Do.CHURN)

PLANS: dict[Case, tuple[CaseStep, ...]] = {
    Case.INTERRUPTED: (
        CaseStep(Do.TURN, "interrupted: 1", first=True, message="Say hi."),
        CaseStep(Do.INTERRUPT, INTERRUPTED_TURN, message="Write a long story about shelves."),
        CaseStep(Do.TURN, AFTER_INTERRUPT, message="Now say bye."),
    ),
    Case.DATE_CHANGE: (
        CaseStep(Do.TURN, "date change: day 1", first=True, message="Which fact names a tower?"),
        CaseStep(Do.EVICT),
        CaseStep(Do.TURN, NEW_DAY, session=2, first=True, message="How heavy is fact 3?"),
    ),
    Case.DATE_IN_SENTENCE: (
        CaseStep(
            Do.TURN, "date in a sentence: day 1", first=True, message="Which fact names a tower?"
        ),
        CaseStep(Do.EVICT),
        CaseStep(
            Do.TURN, NEW_DAY_IN_SENTENCE, session=2, first=True, message="How heavy is fact 3?"
        ),
    ),
    Case.TWO_AGENTS: (
        CaseStep(Do.TURN, "two agents: 1", 0, first=True, message="Say hi."),
        CHURN,
        CaseStep(Do.TURN, "two agents: 1", 1, first=True, message="Say hi."),
        CHURN,
        CaseStep(Do.TURN, TWO_AGENTS_LATER[0], 0, message="Now say bye."),
        CHURN,
        CaseStep(Do.TURN, TWO_AGENTS_LATER[0], 1, message="Bye."),
        CHURN,
        CaseStep(Do.TURN, TWO_AGENTS_LATER[1], 0, message="One more word?"),
        CHURN,
        CaseStep(Do.TURN, TWO_AGENTS_LATER[1], 1, message="Why?"),
    ),
}

# The bars: the turn after an interruption ≥ 95% of its ideal, the next day's session
# ≥ 90% of the unchanged head, each agent's later turns ≥ 99%.
TARGETS: dict[str, float] = {
    AFTER_INTERRUPT: 0.95,
    NEW_DAY: 0.90,
    NEW_DAY_IN_SENTENCE: 0.90,
    **{label: 0.99 for label in TWO_AGENTS_LATER},
}
# Two agents at once: the agents first (the pair first), the SDK loop when fewer than
# two are installed.
PAIR_ORDER = (OPENCLAW, CLAUDE_CODE, CODEX, AIDER, SDK)


def case_clients(case: Case, chosen: Sequence[str]) -> tuple[str, ...]:
    """The clients a case runs with, of those chosen for the run; () when it cannot run."""
    if case is Case.INTERRUPTED:
        return tuple(c for c in chosen if c in INTERRUPTIBLE)
    if case in DATED:
        return (SDK,) if SDK in chosen else ()
    pair = tuple(c for c in PAIR_ORDER if c in chosen)[:2]
    return pair if len(pair) == 2 else ()


def parse_cases(text: str) -> tuple[str, ...]:
    """`--cases` (comma-separated; `none`: the plan only)."""
    names = tuple(c.strip() for c in text.split(",") if c.strip())
    if names == ("none",):
        return ()
    unknown = [c for c in names if c not in CASES]
    if unknown:
        raise SystemExit(f"kvproxy bench: unknown case(s) {unknown}; known: {list(CASES)}")
    return names


async def run_case(
    client: Client,
    case: Case,
    chosen: Mapping[str, Any],
    env: BenchEnv,
    opts: AgentsOptions,
    result: AgentsResult,
) -> None:
    """Every arm in turn, the case's plan once (one run per client for `interrupted`)."""
    names = case_clients(case, list(chosen))
    if not names:
        result.failures.append(f"case {case.value}: none of the chosen clients can run it")
        return
    groups = [(n,) for n in names] if case is Case.INTERRUPTED else [names]
    for group in groups:
        for arm_name in opts.arms:
            arm = make_arm(arm_name, env, opts.slots, opts.ctx_per_slot, list(opts.proxy_args))
            who = " and ".join(LABELS[n] for n in group)
            progress(f"agents: case {case.value} ({who}) through {arm_name}")
            async with arm:
                tap = Tap(arm.url)
                await tap.start()
                drivers: list[Driver] = []
                try:
                    for name in group:
                        home = env.new_dir(f"{case.value}-{name}-home")
                        settings = Settings(home, tap.url, opts.max_output, opts.sdk_prompt_tokens)
                        driver = make_driver(name, settings, chosen[name])
                        if case in DATED:
                            in_sentence = case is Case.DATE_IN_SENTENCE
                            driver = SdkDriver(settings, dated=True, date_in_sentence=in_sentence)
                        drivers.append(driver)
                    await _run_steps(client, case, arm, tap, drivers, opts, result)
                finally:
                    for driver in drivers:
                        await driver.close()
                    await tap.stop()


async def _run_steps(
    client: Client,
    case: Case,
    arm: Arm,
    tap: Tap,
    drivers: list[Driver],
    opts: AgentsOptions,
    result: AgentsResult,
) -> None:
    for driver in drivers:
        failed = await driver.prepare()
        if failed:
            result.failures.append(f"{LABELS[driver.name]} ({arm.name}): {failed}")
            return
    histories: list[list[list[int]]] = [[] for _ in drivers]
    plain = first_turn(7, opts.evict_facts)
    evictions = 0
    for step in PLANS[case]:
        if step.do is Do.EVICT:
            evictions += 1
            await take_every_slot(client, arm.url, opts.slots, opts.evict_facts, 10 + evictions)
            continue
        if step.do is Do.CHURN:
            plain = await _churn(client, arm.url, plain)
            continue
        driver = drivers[step.agent]
        tap.take()  # nothing of another client's counts as this turn's
        tap.replying.clear()
        if step.do is Do.INTERRUPT:
            stoppable = cast(Interruptible, driver)
            failed = await stoppable.interrupted_turn(step.session, step.message, tap.replying)
            await tap.settled()
        else:
            failed = await driver.turn(step.session, step.first, step.message)
        if failed:
            result.failures.append(f"{LABELS[driver.name]} ({arm.name}) {step.label}: {failed}")
        history = histories[step.agent]
        await record_turn(client, arm.url, tap, driver.name, arm.name, step.label, history, result)


async def _churn(client: Client, url: str, plain: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The plain conversation's next turn, straight to the arm (not recorded)."""
    reply = await client.chat(url, plain, 4)
    if reply.error:
        raise RuntimeError(f"the third conversation failed: {reply.error}")
    n = len(plain)
    return [
        *plain,
        {"role": "assistant", "content": reply.content},
        {"role": "user", "content": f"And fact {n}?"},
    ]
