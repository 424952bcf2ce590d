"""Clients that rewrite earlier messages on their next turn (cache/habits/rewrites.py, cache/habits/__init__.py): OpenClaw
moves its per-turn context message, aider strips its reminder from the last user message.
Once kvproxy has seen it, a save stores the conversation as the client will send it next, so
the next turn extends the state exactly: with the fake's recurrent-model rule
(`reuse="extend"`), anything else is reused not at all after a restore."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import orjson
from hypothesis import given
from hypothesis import strategies as st

from kvproxy.cache.habits import Habits
from kvproxy.cache.habits.rewrites import Kind, Rewrite, Rewrites, observe, rewrite
from kvproxy.store import dirfiles

from .conftest import Maker, RunningProxy, start_proxy
from .fakeserver import render_chat
from .test_cache import chat, settle

SYSTEM = {"role": "system", "content": "You are a careful agent. " + "rule " * 300}
CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nchannel: cli, time: {t}\n<<<END>>>"
REMINDER = "\n\nTo suggest changes to a file you MUST return the entire content of the file."


def ctx(turn: int) -> dict[str, str]:
    return {"role": "user", "content": CONTEXT.format(t=turn)}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


# --- what one observation teaches (plain data)


def test_a_dropped_context_message_is_learnt_and_applied() -> None:
    ours = [SYSTEM, user("q1"), ctx(1), assistant("a1")]
    theirs = [SYSTEM, user("q1"), assistant("a1"), user("q2"), ctx(2)]
    found = observe(ours, theirs, 2)
    assert found == Rewrite(Kind.DROP, "user", "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>")
    # Applied to the next recorded turn, it gives what the client sends after it.
    recorded = [*theirs, assistant("a2")]
    assert rewrite([found], recorded) == [
        SYSTEM,
        user("q1"),
        assistant("a1"),
        user("q2"),
        assistant("a2"),
    ]


def test_a_dropped_context_message_in_text_parts_is_learnt() -> None:
    """OpenClaw 2026.9.6 sends its context message as a list of text parts."""

    def parts(turn: int) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "text", "text": CONTEXT.format(t=turn)}]}

    ours = [SYSTEM, user("q1"), parts(1), assistant("a1")]
    theirs = [SYSTEM, user("q1"), assistant("a1"), user("q2"), parts(2)]
    found = observe(ours, theirs, 2)
    assert found == Rewrite(Kind.DROP, "user", "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>")
    recorded = [*theirs, assistant("a2")]
    assert rewrite([found], recorded) == [*theirs[:4], assistant("a2")]


def test_a_stripped_reminder_is_learnt_and_applied() -> None:
    ours = [SYSTEM, user("fix it" + REMINDER), assistant("done")]
    theirs = [SYSTEM, user("fix it"), assistant("done"), user("again" + REMINDER)]
    found = observe(ours, theirs, 1)
    assert found == Rewrite(Kind.CUT, "user", REMINDER)
    recorded = [*theirs, assistant("ok")]
    assert rewrite([found], recorded)[3] == user("again")
    assert rewrite([found], recorded)[-1] == assistant("ok")  # the reply is never rewritten


def test_an_edited_or_regenerated_turn_teaches_nothing() -> None:
    ours = [SYSTEM, user("q1" + REMINDER), assistant("a1")]
    # The user message changed and the reply after it is another: an edit, not a habit.
    assert observe(ours, [SYSTEM, user("q1"), assistant("other"), user("q2")], 1) is None
    # Another text in place of the old one.
    assert observe(ours, [SYSTEM, user("something else"), assistant("a1"), user("q2")], 1) is None
    # A dropped message whose opening is too short to recognise again.
    assert (
        observe([SYSTEM, user("ok"), assistant("a1")], [SYSTEM, assistant("a1"), user("q")], 1)
        is None
    )
    # A request that does not go on past the recorded conversation.
    assert observe(ours, [SYSTEM, user("q1"), assistant("a1")], 1) is None


def test_only_rewrites_near_the_end_are_compared() -> None:
    habits = Habits()
    long = [SYSTEM, *[user(f"m{i}") for i in range(10)], ctx(1), assistant("a")]
    # Parting at message 1 of 13 is a branch or a new session: not compared at all.
    assert not habits.learn("ns", long, [SYSTEM, assistant("a"), *long[2:]], 1)
    assert habits.rewrites.get("ns") == []
    theirs = [*long[:-2], assistant("a"), user("q"), ctx(2)]
    assert habits.learn("ns", long, theirs, len(long) - 2)
    assert [r.kind for r in habits.rewrites.get("ns")] == [Kind.DROP]
    assert habits.rewrites.get("other") == []


def test_each_namespace_keeps_a_few_rewrites() -> None:
    rewrites = Rewrites()
    for i in range(10):
        marker = f"<<<MARKER NUMBER {i:02d}>>>"
        ours = [SYSTEM, user(marker), assistant("a")]
        rewrites.learn("ns", ours, [SYSTEM, assistant("a"), user("q")], 1)
    kept = rewrites.get("ns")
    assert len(kept) == 4 and kept[-1].text == "<<<MARKER NUMBER 09>>>"


@given(st.lists(st.text(min_size=0, max_size=30), min_size=1, max_size=6), st.text(max_size=20))
def test_rewriting_never_touches_messages_the_rule_does_not_name(
    texts: list[str], extra: str
) -> None:
    rule = Rewrite(Kind.CUT, "user", "\n\nREMINDER TEXT")
    messages: list[Any] = [assistant(t) for t in texts] + [user(extra)]
    assert rewrite([rule], messages) == messages


# --- through the proxy, with a recurrent model's reuse rule


async def turn(
    proxy: RunningProxy, messages: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, str]]:
    status, body, headers = await chat(proxy, messages)
    assert status == 200, body
    return body, headers


async def crowd_out(proxy: RunningProxy, rounds: int) -> None:
    """Three other conversations at once take both slots, so the agent's state goes to disk.
    They start once the agent's background save is done: while it runs, all three would wait
    for the other slot and rightly leave the agent's state where it is."""
    await settle(proxy)
    await asyncio.gather(
        *(
            turn(
                proxy,
                [
                    {"role": "system", "content": f"other {other} {rounds} " + "x " * 200},
                    user("hi"),
                ],
            )
            for other in (1, 2, 3)
        )
    )
    await settle(proxy)


def reply_of(body: dict[str, Any]) -> dict[str, str]:
    return assistant(body["choices"][0]["message"]["content"])


def bound(*new: dict[str, Any]) -> int:
    """What a later turn may prefill: its new messages as rendered, the reply's closing
    marker, and a handful."""
    return len(render_chat(list(new))) + len("<end_of_turn>\n") + 8


async def test_openclaw_context_message_moves_and_later_turns_extend_the_saved_state(
    make: Maker,
) -> None:
    _fake, proxy = await make(server={"reuse": "extend"})
    messages = [SYSTEM, user("q1"), ctx(1)]
    body, _ = await turn(proxy, messages)
    history = [SYSTEM, user("q1"), reply_of(body)]
    prompt_n = []
    for t in (2, 3, 4):
        await crowd_out(proxy, t)
        new = [user(f"q{t}"), ctx(t)]
        body, headers = await turn(proxy, [*history, *new])
        prompt_n.append((t, headers["X-KVProxy-Cache"], body["timings"]["prompt_n"], bound(*new)))
        history = [*history, new[0], reply_of(body)]
    # Turn 2 teaches the habit (its state was saved with the context message in it); every
    # turn after it comes back from disk and prefills only what is new.
    for _t, decision, n, limit in prompt_n[1:]:
        assert decision == "restored" and n <= limit, prompt_n


async def test_aider_reminder_is_stripped_and_later_turns_extend_the_saved_state(
    make: Maker,
) -> None:
    _fake, proxy = await make(server={"reuse": "extend"})
    body, _ = await turn(proxy, [SYSTEM, user("change a" + REMINDER)])
    history = [SYSTEM, user("change a"), reply_of(body)]
    seen = []
    for t in (2, 3, 4):
        await crowd_out(proxy, t)
        new = user(f"change {t}" + REMINDER)
        body, headers = await turn(proxy, [*history, new])
        seen.append((headers["X-KVProxy-Cache"], body["timings"]["prompt_n"], bound(new)))
        history = [*history, user(f"change {t}"), reply_of(body)]
    for decision, n, limit in seen[1:]:
        assert decision == "restored" and n <= limit, seen


async def test_a_restarted_proxy_remembers_the_habit_from_its_first_save(make: Maker) -> None:
    """The habit is kept in the cache dir: after a restart, the first state saved is already
    the one the client's next request extends (without it, turn 4 would part from it)."""
    fake, proxy = await make(server={"reuse": "extend"})
    cache = proxy.cache.store.root
    body, _ = await turn(proxy, [SYSTEM, user("q1"), ctx(1)])
    history = [SYSTEM, user("q1"), reply_of(body)]
    await crowd_out(proxy, 1)
    body, _ = await turn(proxy, [*history, user("q2"), ctx(2)])  # shows the habit
    history = [*history, user("q2"), reply_of(body)]
    await proxy.stop()
    saved = orjson.loads((cache / dirfiles.HABITS).read_bytes())
    assert saved["rewrites"], saved
    assert (cache / dirfiles.HABITS).stat().st_mode & 0o777 == 0o600

    proxy = await start_proxy(fake.url, cache)
    try:
        seen = []
        for t in (3, 4):
            new = [user(f"q{t}"), ctx(t)]
            body, headers = await turn(proxy, [*history, *new])
            seen.append((headers["X-KVProxy-Cache"], body["timings"]["prompt_n"], bound(*new)))
            history = [*history, new[0], reply_of(body)]
            await crowd_out(proxy, t)
        for decision, n, limit in seen:
            assert decision == "restored" and n <= limit, seen
    finally:
        await proxy.stop()


def test_habits_survive_their_file_and_nothing_else_is_read(tmp_path: Path) -> None:
    habits = Habits()
    ours = [SYSTEM, user("q1"), ctx(1), assistant(" a1 ")]
    assert habits.learn("ns", ours, [SYSTEM, user("q1"), assistant("a1"), user("q2"), ctx(2)], 2)
    habits.echo.learn("ns", ours[:2] + ours[3:], [SYSTEM, user("q1"), assistant("a1")])
    dirfiles.write(tmp_path, dirfiles.HABITS, habits.to_json())
    again = Habits()
    again.load(dirfiles.read(tmp_path, dirfiles.HABITS))
    assert again.rewrites.get("ns") == habits.rewrites.get("ns") != []
    assert again.echo.get("ns") == habits.echo.get("ns") == "strip"
    for junk in (
        b"{not json",
        b'{"version": 9, "rewrites": {"ns": [["drop", "user", "xxxxxxxxx"]]}}',
        b'{"version": 1, "rewrites": {"ns": [["zap", "user", "xxxxxxxxx"], 3]}, "echo": {"ns": 5}}',
    ):
        (tmp_path / dirfiles.HABITS).write_bytes(junk)
        fresh = Habits()
        fresh.load(dirfiles.read(tmp_path, dirfiles.HABITS))
        assert fresh.rewrites.get("ns") == [] and fresh.echo.get("ns") is None
    (tmp_path / dirfiles.HABITS).unlink()
    os.mkfifo(tmp_path / dirfiles.HABITS)  # never blocks, never read
    assert dirfiles.read(tmp_path, dirfiles.HABITS) is None
