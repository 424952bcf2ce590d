"""Stems: a long system prompt's head, before the line that changes between sessions (a date,
a session id), kept as an entry of its own, so a date change costs only the tail."""

from __future__ import annotations

from typing import Any

import pytest

from kvproxy.cache.prefixes.stems import MIN_STEM_CHARS, Cuts, moved_on, presumed_cut, stem_probes
from kvproxy.server.modelinfo import ModelClass

from .conftest import Maker, RunningProxy
from .test_cache import chat, settle
from .test_openings import as_class

HEAD = "You are an agent. Follow the rules below.\n" + "Rule: be precise and brief.\n" * 120
TAIL = "\n" + "Tool notes: read files before editing them.\n" * 30
# One paragraph, no line break near the date: `… reports. Current date: … The crews …`.
PARAGRAPH = "You are an agent. " + "Rule: be precise and brief. " * 120 + "Write reports. "
PARAGRAPH_TAIL = ". The crews read files before editing them." * 30


def system(day: str, head: str = HEAD) -> str:
    if head == PARAGRAPH:
        return f"{head}Current date: 2026-12-{day}{PARAGRAPH_TAIL}"
    return f"{head}Current date: 2026-12-{day}\n{TAIL}"


def unchanged(head: str = HEAD) -> int:
    """Characters of the system message before the date: what a new day leaves as it was."""
    return len(head) + len("Current date: ")


def session(n: int, day: str, head: str = HEAD) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system(day, head)},
        {"role": "user", "content": f"task {n}"},
    ]


def test_a_date_is_presumed_to_start_what_changes_on_its_line_or_inside_a_sentence() -> None:
    for head in (HEAD, PARAGRAPH):
        text = system("01", head)
        assert presumed_cut(text) == unchanged(head)
        assert text[unchanged(head) :].startswith("2026-12-01")
    assert presumed_cut("Short.\nCurrent date: 2026-12-01\n" + "x" * 5000) is None
    assert presumed_cut("no date at all " * 400) is None
    # A date too early to pay for a stem does not hide a later one.
    early = "Policy of 2024-01-01. " + system("01", PARAGRAPH)
    assert presumed_cut(early) == len("Policy of 2024-01-01. ") + unchanged(PARAGRAPH)


def test_a_stem_is_probed_with_its_word_changed_as_another_day_changes_it() -> None:
    """The two renders part exactly at the cut, with a word of the same shape after it."""
    assert moved_on("2026-12-03. The crews") == "3137-23-14. The crews"
    assert moved_on("Friday, Zulu 9") == "Gsjebz, Zulu 9"
    text = system("03", PARAGRAPH)
    cut = unchanged(PARAGRAPH)
    probes = [m[0]["content"] for m in stem_probes(session(1, "03", PARAGRAPH), cut)]
    assert [p[:cut] for p in probes] == [text[:cut]] * 2
    assert probes[0][cut:].startswith("2026-12-03. The crews")
    assert probes[1][cut:].startswith("3137-23-14. The crews")


def test_partings_inside_a_long_system_message_are_learnt_at_their_line() -> None:
    cuts = Cuts()
    messages = [{"role": "system", "content": "a line\n" * 600 + "Session: 7f3k\n" + "b" * 500}]
    offset = len("a line\n" * 600) + len("Session: 7f")
    cuts.learn("ns", messages, 0, offset)
    at_word = len("a line\n" * 600) + len("Session: ")  # where the id starts
    assert cuts.of("ns", messages) == [at_word]
    cuts.learn("ns", messages, 1, offset)  # not the system message: nothing learnt
    cuts.learn("ns", messages, 0, 10)  # too short a head to pay for a save
    assert cuts.of("ns", messages) == [at_word]
    assert cuts.of("other", messages) == []
    assert MIN_STEM_CHARS <= len("a line\n" * 600)


async def crowd(proxy: RunningProxy, n: int) -> None:
    for other in ("X", "Y"):
        await chat(proxy, [{"role": "system", "content": f"Other {other}{n}. " + "pad " * 300}])
    await settle(proxy)


@pytest.mark.parametrize("head", [HEAD, PARAGRAPH], ids=["date-line", "date-in-a-sentence"])
@pytest.mark.parametrize(
    ("reuse", "model_class", "n_swa"),
    [("window", "swa", 1024), ("extend", "recurrent", 0), ("full", "dense", 0)],
)
async def test_after_a_date_change_a_new_session_restores_the_head(
    make: Maker, reuse: str, model_class: ModelClass, n_swa: int, head: str
) -> None:
    fake, proxy = await make({"reuse": reuse, "window": n_swa // 2 or 512, "n_ctx": 16384})
    as_class(proxy, model_class, n_swa)
    status, _, h = await chat(proxy, session(1, "01", head))
    assert status == 200
    # The head was evaluated and saved on the way (the server counts it in cache_n).
    assert int(h.get("X-KVProxy-Evaluated-Tokens", 0)) >= unchanged(head)
    await settle(proxy)
    await crowd(proxy, 1)

    status, body, h = await chat(proxy, session(2, "02", head))  # midnight has passed
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    restored = int(h["X-KVProxy-Restored-Tokens"])
    # The text before the date and the template's markup (one token a byte on the fake).
    assert unchanged(head) <= restored < unchanged(head) + 40
    assert body["timings"]["cache_n"] >= 0.9 * unchanged(head)


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
