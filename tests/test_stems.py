"""Stems: a long system prompt's head, before the line that changes between sessions (a date,
a session id), kept as an entry of its own, so a date change costs only the tail."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.cache.stems import MIN_STEM_CHARS, Cuts, presumed_cut
from kvproxy.server.modelinfo import ModelClass

from .conftest import Maker, RunningProxy
from .test_cache import chat, settle
from .test_openings import as_class

HEAD = "You are an agent. Follow the rules below.\n" + "Rule: be precise and brief.\n" * 120
TAIL = "\n" + "Tool notes: read files before editing them.\n" * 30


def system(day: str, head: str = HEAD) -> str:
    return f"{head}Current date: 2026-12-{day}\n{TAIL}"


def session(n: int, day: str, head: str = HEAD) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system(day, head)},
        {"role": "user", "content": f"task {n}"},
    ]


def test_a_date_line_is_presumed_to_start_what_changes() -> None:
    text = system("01")
    assert presumed_cut(text) == len(HEAD) and text[len(HEAD) :].startswith("Current date")
    assert presumed_cut("Short.\nCurrent date: 2026-12-01\n" + "x" * 5000) is None
    assert presumed_cut("no date at all " * 400) is None


def test_partings_inside_a_long_system_message_are_learnt_at_their_line() -> None:
    cuts = Cuts()
    messages = [{"role": "system", "content": "a line\n" * 600 + "Session: 7f3k\n" + "b" * 500}]
    offset = len("a line\n" * 600) + len("Session: 7f")
    cuts.learn("ns", messages, 0, offset)
    assert cuts.of("ns", messages) == [len("a line\n" * 600)]
    cuts.learn("ns", messages, 1, offset)  # not the system message: nothing learnt
    cuts.learn("ns", messages, 0, 10)  # too short a head to pay for a save
    assert cuts.of("ns", messages) == [len("a line\n" * 600)]
    assert cuts.of("other", messages) == []
    assert MIN_STEM_CHARS <= len("a line\n" * 600)


async def crowd(proxy: RunningProxy, n: int) -> None:
    for other in ("X", "Y"):
        await chat(proxy, [{"role": "system", "content": f"Other {other}{n}. " + "pad " * 300}])
    await settle(proxy)


@pytest.mark.parametrize(
    ("reuse", "model_class", "n_swa"),
    [("window", "swa", 1024), ("extend", "recurrent", 0), ("full", "dense", 0)],
)
async def test_after_a_date_change_a_new_session_restores_the_head(
    make: Maker, reuse: str, model_class: ModelClass, n_swa: int
) -> None:
    fake, proxy = await make({"reuse": reuse, "window": n_swa // 2 or 512, "n_ctx": 16384})
    as_class(proxy, model_class, n_swa)
    status, _, h = await chat(proxy, session(1, "01"))
    assert status == 200
    # The head was evaluated and saved on the way (the server counts it in cache_n).
    assert int(h.get("X-KVProxy-Evaluated-Tokens", 0)) >= len(HEAD)
    await settle(proxy)
    await crowd(proxy, 1)

    status, body, h = await chat(proxy, session(2, "02"))  # midnight has passed
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    restored = int(h["X-KVProxy-Restored-Tokens"])
    assert len(HEAD) <= restored < len(HEAD) + 40  # the head and the template's markup
    assert body["timings"]["cache_n"] >= 0.9 * len(HEAD)


async def test_a_volatile_line_no_pattern_shows_is_learnt_from_the_sessions_that_part_there(
    make: Maker,
) -> None:
    fake, proxy = await make({"reuse": "extend", "n_ctx": 16384})
    as_class(proxy, "recurrent")

    def with_id(n: int) -> list[dict[str, Any]]:
        content = f"{HEAD}Session handle: q{n}x{n * 7}z\n{TAIL}"
        return [{"role": "system", "content": content}, {"role": "user", "content": "go"}]

    for n in (1, 2):  # the second parts from the first at the handle's line: learnt
        await chat(proxy, with_id(n))
        await settle(proxy)
    await chat(proxy, with_id(3))  # makes the stem on the way
    await settle(proxy)
    await crowd(proxy, 3)
    status, body, h = await chat(proxy, with_id(4))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert body["timings"]["cache_n"] >= 0.9 * len(HEAD)
