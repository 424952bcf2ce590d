"""Background saves against the fake llama-server: under slot pressure an idle slot is saved
before a request needs it; a request for that slot waits only for its save and finds its
conversation resident; requests on other slots do not wait for it."""

from __future__ import annotations

import asyncio
from typing import Any

from .conftest import Maker, RunningProxy, committed, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import actions, chat, conv, settle, then


class Recorder:
    """A reply function that notes, for each reply, which slot actions had been answered."""

    def __init__(self) -> None:
        self.fake: FakeLlamaServer | None = None
        self.seen: dict[str, list[tuple[str, int, str | None, bool]]] = {}

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        if self.fake is None:
            return "Echo"  # kvproxy's own behavioural probe, as the proxy starts
        text = str([m for m in messages if m["role"] == "user"][-1]["content"])
        self.seen[text] = list(self.fake.actions)
        return "Echo: " + text[:40]


def slot_of(proxy: RunningProxy, n: int) -> int:
    """The slot holding conversation `n`."""
    for slot in proxy.cache.pool.slots:
        if slot.holding is not None and f"first question {n}" in str(slot.holding.messages):
            return slot.id
    raise AssertionError(f"conversation {n} is in no slot")


def save_posts(fake: FakeLlamaServer, slot: int) -> int:
    return sum(1 for m, p, _ in fake.requests if m == "POST" and p == f"/slots/{slot}?action=save")


def saves_answered(fake: FakeLlamaServer, slot: int) -> int:
    return sum(1 for a in actions(fake, "save") if a[1] == slot)


async def until(condition: Any) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


def on_path_saves(proxy: RunningProxy) -> int:
    stats = proxy.stats()
    return int(stats["saves"] - stats["background_saves"])


async def test_under_pressure_the_next_eviction_finds_its_slot_saved(make: Maker) -> None:
    fake, proxy = await make()
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2)}
    await settle(proxy)
    # Two conversations, two slots: nothing saved early (a slot's first use after a proxy
    # start may erase it: its tenant is unknown).
    assert [a for a in fake.actions if a[0] != "erase"] == []
    replies[3] = (await chat(proxy, conv(3)))[1]
    await settle(proxy)
    # 3 live conversations on 2 slots: 1 was saved on 3's path (the pressure began with 3),
    # then both slots' conversations in the background.
    assert on_path_saves(proxy) == 1 and proxy.stats()["background_saves"] == 2
    assert len(proxy.cache.store.entries) == 3
    assert all(s["saved"] for s in proxy.stats()["slots"])
    for c in (1, 2, 3):  # every turn 2 now evicts a conversation already on disk
        status, body, h = await chat(proxy, then(conv(c), replies[c]))
        assert status == 200 and h["X-KVProxy-Cache"] in ("restored", "resident")
        assert body["choices"][0]["message"]["content"] == "Echo: next question"
        await settle(proxy)
    assert on_path_saves(proxy) == 1
    assert fake.deferred_actions == 0


async def test_a_request_for_a_slot_being_saved_waits_for_that_save_and_stays_resident(
    make: Maker,
) -> None:
    recorder = Recorder()
    fake, proxy = await make(server={"action_delay": 0.5, "reply": recorder})
    recorder.fake = fake
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    home = slot_of(proxy, 3)
    # Conversation 3's slot is saved in the background once it is idle; its next turn comes
    # while that save runs (the server answers saves late).
    await until(lambda: save_posts(fake, home) > saves_answered(fake, home))
    in_flight_since = saves_answered(fake, home)
    status, body, h = await chat(proxy, then(conv(3), replies[3], "third next"))
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    assert body["choices"][0]["message"]["content"] == "Echo: third next"
    assert body["timings"]["prompt_n"] <= 100  # only the new turn: the slot kept its state
    # The request reached the server only after the save it waited for was answered.
    answered = [a for a in recorder.seen["third next"] if a[0] == "save" and a[1] == home]
    assert len(answered) == in_flight_since + 1
    assert fake.deferred_actions == 0


async def test_a_background_save_does_not_hold_up_requests_on_other_slots(make: Maker) -> None:
    recorder = Recorder()
    fake, proxy = await make(server={"action_delay": 1.0, "reply": recorder})
    recorder.fake = fake
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    home, other = slot_of(proxy, 3), slot_of(proxy, 2)
    await until(lambda: save_posts(fake, home) > saves_answered(fake, home))
    await until(lambda: not proxy.cache.pool.slots[other].busy)  # 2's own save is done
    pending = saves_answered(fake, home)
    status, body, h = await chat(proxy, then(conv(2), replies[2], "second next"))
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    # Conversation 2 was answered while the save on 3's slot was still unanswered.
    answered = [a for a in recorder.seen["second next"] if a[0] == "save" and a[1] == home]
    assert len(answered) == pending
    await settle(proxy)
    assert saves_answered(fake, home) == pending + 1


async def test_after_a_restart_the_first_eviction_is_free_too(make: Maker) -> None:
    """The conversations on disk used within the live window are live after a restart: once
    one comes back, the slot it leaves idle is saved before a third needs it."""
    fake, proxy = await make()
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await proxy.stop()  # graceful: everything still in a slot is saved
    assert fake.slot_save_path is not None
    assert len(committed(fake.slot_save_path)) == 3
    for slot in fake.slots:  # the server restarted too: its slots are empty
        slot.tokens.clear()
    again = await start_proxy(fake.url, fake.slot_save_path, min_tokens=0, idle_save_after=3600)
    try:
        assert again.stats()["live_conversations"] == 3
        for c in (1, 2, 3):
            status, body, h = await chat(again, then(conv(c), replies[c]))
            assert status == 200 and h["X-KVProxy-Cache"] == "restored"
            assert body["choices"][0]["message"]["content"] == "Echo: next question"
            await settle(again)
        # 3 took a slot whose turn 2 was saved in the background: no save on any path.
        assert on_path_saves(again) == 0 and again.stats()["background_saves"] >= 1
    finally:
        await again.stop()


async def test_a_background_save_gives_way_to_its_own_conversations_next_turn(
    make: Maker,
) -> None:
    """A save's steps each wait for the server's loop (behind other slots' prefills, on a real
    server): when the conversation comes back before the state write is sent, the write is
    not sent at all. The turn finds its state resident; the slot is saved after it."""
    recorder = Recorder()
    fake, proxy = await make(server={"reply": recorder})
    recorder.fake = fake
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    home = slot_of(proxy, 3)
    fake.template_hold.gate = asyncio.Event()  # the canonical prefix's render takes its time
    status, body, _ = await chat(proxy, then(conv(3), replies[3], "third next"))
    assert status == 200
    history = then(conv(3), replies[3], "third next")
    await until(lambda: fake.template_hold.waiting >= 1)  # 3's slot: a background save under way
    posted = save_posts(fake, home)
    turn = asyncio.ensure_future(chat(proxy, then(history, body, "third again")))
    await until(lambda: proxy.cache.pool.waiting >= 1)
    fake.template_hold.gate.set()
    status, reply, h = await turn
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    assert reply["choices"][0]["message"]["content"] == "Echo: third again"
    assert reply["timings"]["prompt_n"] <= 100
    # No state write for 3's slot between its turn 2 and its turn 3.
    assert [a for a in recorder.seen["third again"] if a[0] == "save" and a[1] == home] == [
        a for a in recorder.seen["third next"] if a[0] == "save" and a[1] == home
    ]
    assert save_posts(fake, home) >= posted
    await settle(proxy)
    assert proxy.cache.pool.slots[home].saved  # saved after the turn, in the background


def long_for_stream(messages: list[dict[str, Any]]) -> str:
    """Conversation "stream" gets a long reply (a token every `token_delay`), others short."""
    text = str([m for m in messages if m["role"] == "user"][-1]["content"])
    return "word " * 150 if "stream" in text else "Echo: " + text[:40]


async def held_back_save(make: Maker, wait: float) -> tuple[bool, bool, bool]:
    """Three slots: conversation 4's turn 2 ends on one while another streams a long reply
    (the server's saves take 0.3 s: a big state against its 20 ms token gap): (a save of 4's
    slot was sent during the stream, the stream was still running when looked at, 4's slot
    ends up saved)."""
    fake, proxy = await make(
        server={"token_delay": 0.02, "reply": long_for_stream, "n_slots": 3, "action_delay": 0.3},
        save_wait=wait,
    )
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3, 4)}
    await settle(proxy)
    home = slot_of(proxy, 4)
    stream = [*conv(5)[:1], {"role": "user", "content": "stream a long reply"}]
    streaming = asyncio.ensure_future(chat(proxy, stream))
    await until(lambda: any(s.busy for s in proxy.cache.pool.slots if s.id != home))
    posted = save_posts(fake, home)
    status, _, h = await chat(proxy, then(conv(4), replies[4]))
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    await asyncio.sleep(0.8)  # well past what a save sent at once would have taken
    sent_during = save_posts(fake, home) > posted
    running = not streaming.done()
    status, _, _ = await streaming
    assert status == 200
    await settle(proxy)
    return sent_during, running, proxy.cache.pool.slots[home].saved


async def test_a_background_save_waits_while_another_slot_streams(make: Maker) -> None:
    """The server runs a save on its one loop: sent during the stream it would pause it. So
    the save is sent once the stream has ended, and the slot is saved then."""
    sent_during, running, saved = await held_back_save(make, wait=60)
    assert running and not sent_during and saved


async def test_a_background_save_never_pauses_a_stream_however_long_it_waits(
    make: Maker,
) -> None:
    sent_during, running, saved = await held_back_save(make, wait=0.2)
    assert running and not sent_during and saved


async def test_save_wait_zero_saves_at_once_during_a_stream(make: Maker) -> None:
    sent_during, running, saved = await held_back_save(make, wait=0)
    assert running and sent_during and saved
