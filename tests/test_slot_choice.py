"""Which slot a new conversation gets (slots.SlotPool), on plain data: the least recently used
one whose content is on disk, and one that is busy only with a background save, when every
idle slot would need a save on the request's path first."""

from __future__ import annotations

import asyncio

from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import UNKNOWN_REPLY_TOKENS, Holding
from kvproxy.server.api import SlotInfo


def pool_with_two_conversations() -> SlotPool:
    pool = SlotPool(2, max_queue=8, queue_timeout=5)
    for slot, name in zip(pool.slots, ("older", "newer"), strict=True):
        slot.hold(Holding("ns", [name], 1500, 3), saved=False)
    pool.slots[0].last_used, pool.slots[1].last_used = 1.0, 2.0
    return pool


async def test_a_new_conversation_waits_for_a_slot_being_saved_rather_than_evict_another() -> None:
    pool = pool_with_two_conversations()
    saving = pool.slots[0]
    assert pool.try_take(saving)
    saving.saving = True
    request = asyncio.ensure_future(pool.acquire(["new"], "ns"))
    await asyncio.sleep(0.05)
    assert not request.done(), "it waits for the save, not for the unsaved newer slot"
    saving.saved = True  # the background save committed it
    pool.release(saving, used=False)
    slot, depth = await asyncio.wait_for(request, 5)
    assert slot is saving and depth == 0
    assert not pool.slots[1].busy


async def test_an_idle_slot_on_disk_is_taken_at_once() -> None:
    pool = pool_with_two_conversations()
    pool.slots[1].saved = True
    assert pool.try_take(pool.slots[0])
    pool.slots[0].saving = True
    slot, _ = await asyncio.wait_for(pool.acquire(["new"], "ns"), 5)
    assert slot is pool.slots[1]


async def test_a_busy_request_is_not_waited_for() -> None:
    pool = pool_with_two_conversations()
    assert pool.try_take(pool.slots[0])  # a request's, not a save
    slot, _ = await asyncio.wait_for(pool.acquire(["new"], "ns"), 5)
    assert slot is pool.slots[1]


async def test_a_slot_another_conversation_took_is_not_waited_for() -> None:
    """Conversation "older" is on disk; a new conversation's request took its slot (a long
    stream, say). "older"'s next turn takes the idle slot and restores, not waiting for the
    stream to end in a slot whose content is being replaced."""
    pool = pool_with_two_conversations()
    pool.slots[0].saved = True
    taken, _ = await asyncio.wait_for(pool.acquire(["stream"], "ns"), 5)
    assert taken is pool.slots[0] and taken.holding is not None  # still shows "older"
    slot, depth = await asyncio.wait_for(pool.acquire(["older", "reply", "next"], "ns"), 5)
    assert slot is pool.slots[1] and depth == 0


async def test_the_slot_finishing_this_conversations_last_reply_is_waited_for() -> None:
    pool = pool_with_two_conversations()
    taken, depth = await asyncio.wait_for(pool.acquire(["older", "reply", "next"], "ns"), 5)
    assert taken is pool.slots[0] and depth == 1
    request = asyncio.ensure_future(pool.acquire(["older", "reply", "next", "r2", "n2"], "ns"))
    await asyncio.sleep(0.05)
    assert not request.done()
    pool.release(taken)
    slot, _ = await asyncio.wait_for(request, 5)
    assert slot is taken


def test_before_its_slot_check_answers_a_reply_is_known_by_its_token_count() -> None:
    slot = SlotPool(1, max_queue=1, queue_timeout=1).slots[0]
    slot.hold(Holding("ns", ["a"], 1537, 2), saved=False)
    slot.snapshot = (16, 900)  # the task before ours
    after = SlotInfo(0, False, 17, 1548, 4096)  # the prompt and 11 generated tokens
    slot.ours_ended(1537, 11)
    assert slot.shows_ours(after)
    slot.ours_ended(1537, UNKNOWN_REPLY_TOKENS)  # a reply that gives usage only
    assert slot.shows_ours(after)
    slot.ours_ended(1537, 0)
    assert not slot.shows_ours(after), "more tokens than ours left"
    slot.ours_ended(1537, 11)
    assert not slot.shows_ours(SlotInfo(0, False, 16, 1548, 4096)), "no task of ours ran"
