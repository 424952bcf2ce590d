"""Sessions that share an opening (one system prompt), at once, against a fake server that
keeps a ledger of every state it holds (tests/ledger.py): kvproxy never replaces a state it
could still save without saving it first, and its `X-KVProxy-Cache` label tells the truth."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from .conftest import RunningProxy, start_proxy
from .ledger import LedgerServer
from .test_cache import chat, settle, then

SYSTEM = "You are a careful coding agent. Follow the rules below.\n" + "rule: be exact. " * 60


# Tokens a next turn adds (the fake counts a byte a token): the reply's end of turn, the new
# user message and the template around it; far below the ~1,300 of the conversation itself.
NEW_TURN = 120


def session(name: str, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": f"task of session {name}: " + "details " * 20},
    ]


async def started(
    tmp_path: Path, n_slots: int = 2, **server: Any
) -> tuple[LedgerServer, RunningProxy]:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700, exist_ok=True)
    fake = LedgerServer(slot_save_path=cache, n_slots=n_slots, **server)
    await fake.start()
    proxy = await start_proxy(fake.url, cache, live_window=0)
    return fake, proxy


@pytest.fixture
async def pair(tmp_path: Path) -> Any:
    fake, proxy = await started(tmp_path)
    try:
        yield fake, proxy
    finally:
        await proxy.stop()
        await fake.stop()


def cache_n(body: dict[str, Any]) -> int:
    return int(body["timings"]["cache_n"])


async def test_a_new_session_never_replaces_an_unsaved_session_sharing_its_opening(
    pair: tuple[LedgerServer, RunningProxy],
) -> None:
    fake, proxy = pair
    a, b = session("A"), session("B")
    (_, ra, _), (_, rb, _) = await asyncio.gather(chat(proxy, a), chat(proxy, b))
    await settle(proxy)
    # A third session with the same system prompt: both slots hold a session's only state.
    status, _, headers = await chat(proxy, session("C"))
    await settle(proxy)
    assert status == 200
    assert fake.lost == [], "\n".join(map(str, fake.lost))
    # Both sessions come back whole: resident, or restored with everything they had.
    for msgs, reply in ((a, ra), (b, rb)):
        nxt = then(msgs, reply)
        status, body, headers = await chat(proxy, nxt)
        assert status == 200
        assert headers["X-KVProxy-Cache"] in ("resident", "restored")
        # Everything but the new user message reused.
        assert body["timings"]["prompt_n"] <= NEW_TURN, body["timings"]
    assert fake.lost == [], "\n".join(map(str, fake.lost))


async def test_replies_ending_together_keep_each_session_on_its_own_state(
    pair: tuple[LedgerServer, RunningProxy],
) -> None:
    fake, proxy = pair
    convs = [session("A"), session("B")]
    for turn in range(3):
        replies = await asyncio.gather(*(chat(proxy, c) for c in convs))
        for i, (status, body, headers) in enumerate(replies):
            assert status == 200
            if turn:
                # Its own state, resident or restored: all but the new message reused.
                assert headers["X-KVProxy-Cache"] in ("resident", "restored"), (turn, i)
                assert body["timings"]["prompt_n"] <= NEW_TURN, (turn, i, body["timings"])
        convs = [then(c, r[1], f"turn {turn} next") for c, r in zip(convs, replies, strict=True)]
    assert fake.lost == [], "\n".join(map(str, fake.lost))


async def test_resident_is_claimed_only_for_what_the_server_reuses(
    pair: tuple[LedgerServer, RunningProxy],
) -> None:
    fake, proxy = pair
    a, b = session("A"), session("B")
    _, ra, _ = await chat(proxy, a)
    _, rb, _ = await chat(proxy, b)
    a2 = then(a, ra)
    _, ra2, _ = await chat(proxy, a2)
    # Sub-agents of both sessions take both slots (same system prompt).
    await asyncio.gather(chat(proxy, session("sub1")), chat(proxy, session("sub2")))
    await settle(proxy)
    # A's next turn: its own saved state serves far more than the shared opening a slot holds.
    status, body, headers = await chat(proxy, then(a2, ra2))
    assert status == 200
    assert headers["X-KVProxy-Cache"] == "restored", headers
    assert body["timings"]["prompt_n"] <= NEW_TURN, body["timings"]
    assert fake.lost == [], "\n".join(map(str, fake.lost))
