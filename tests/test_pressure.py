"""The background-save policy (kvproxy/cache/pressure.py) on plain data."""

from __future__ import annotations

from kvproxy.cache.pressure import (
    IdleView,
    LiveConversations,
    SaveDecision,
    gives_way,
    next_background_save,
)


def view(
    i: int, idle_for: float, busy: bool = False, worth: bool = True, serving: bool = False
) -> IdleView:
    return IdleView(i, busy or serving, worth, idle_for, serving)


def save_now(slot: int) -> SaveDecision:
    return SaveDecision(slot=slot)


NOTHING = SaveDecision()


def test_under_pressure_the_least_recently_used_idle_slot_goes_first() -> None:
    slots = [view(0, 1.0), view(1, 5.0), view(2, 3.0, busy=True)]
    assert next_background_save(slots, live=4, waiting=0, idle_save_after=30) == save_now(1)


def test_without_pressure_only_the_idle_save_applies() -> None:
    slots = [view(0, 10.0), view(1, 31.0)]
    assert next_background_save(slots, live=2, waiting=0, idle_save_after=30) == save_now(1)
    assert next_background_save(slots[:1], live=1, waiting=0, idle_save_after=30) == NOTHING


def test_busy_saved_and_unworthy_slots_are_never_chosen() -> None:
    slots = [view(0, 100.0, busy=True), view(1, 100.0, worth=False)]
    assert next_background_save(slots, live=9, waiting=0, idle_save_after=30) == NOTHING


def test_nothing_is_saved_while_a_request_waits_for_a_slot() -> None:
    slots = [view(0, 100.0), view(1, 100.0)]
    assert next_background_save(slots, live=9, waiting=1, idle_save_after=30) == NOTHING


def free(i: int) -> IdleView:
    """An idle slot a new conversation can take without a save (empty, or on disk)."""
    return view(i, 50.0, worth=False)


def test_a_save_waits_while_another_slot_serves_a_request() -> None:
    # Slot 1 streams a reply: the save of slot 0 (due for 2 s) would pause that stream, and a
    # new conversation would take slot 2.
    slots = [view(0, 2.0), view(1, 0.0, serving=True), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == SaveDecision(retry_in=8.0)


def test_a_save_the_next_request_would_need_goes_at_once() -> None:
    # No other idle slot is free: the next new conversation would save slot 0 on its path.
    slots = [view(0, 2.0), view(1, 0.0, serving=True)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)
    slots = [view(0, 2.0), view(1, 0.0, serving=True), view(2, 1.0, busy=True)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_a_held_back_save_goes_when_the_request_ends() -> None:
    slots = [view(0, 2.0), view(1, 0.0), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_a_save_is_never_held_back_beyond_max_wait() -> None:
    slots = [view(0, 10.0), view(1, 0.0, serving=True), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_max_wait_zero_saves_at_once_as_before() -> None:
    slots = [view(0, 0.5), view(1, 0.0, serving=True), free(2)]
    assert next_background_save(slots, live=4, waiting=0, idle_save_after=30) == save_now(0)


def test_without_pressure_the_wait_counts_from_when_the_idle_save_is_due() -> None:
    slots = [view(0, 33.0), view(1, 0.0, serving=True), free(2)]
    decision = next_background_save(slots, live=2, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == SaveDecision(retry_in=7.0)


def test_a_slot_taken_by_a_background_save_holds_nothing_back() -> None:
    slots = [view(0, 2.0), view(1, 1.0, busy=True), free(2)]  # busy, but not with a request
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_a_save_under_way_gives_way_to_another_slots_request_unless_urgent() -> None:
    saving = view(0, 3.0, busy=True)
    streaming = view(1, 0.0, serving=True)

    def gives(slots: list[IdleView], max_wait: float = 10.0) -> bool:
        return gives_way(slots, 0, live=4, idle_save_after=30.0, max_wait=max_wait)

    assert gives([saving, streaming, free(2)])
    assert not gives([saving, view(1, 0.0), free(2)])  # nothing served
    assert not gives([saving, streaming])  # the next request needs slot 0
    assert not gives([view(0, 12.0, busy=True), streaming, free(2)])  # overdue
    assert not gives([saving, streaming, free(2)], max_wait=0)


def test_a_conversation_counts_once_however_many_turns_it_had() -> None:
    live = LiveConversations(window=600)
    assert live.seen(["a1", "a2"], now=0)
    assert not live.seen(["a1", "a2", "a3", "a4"], now=1)  # turn 2 contains turn 1's last key
    assert live.seen(["b1"], now=2)
    assert not live.seen(["b1"], now=3)  # the same request again (a regenerated reply)
    assert live.count(now=3) == 2


def test_a_branch_is_a_conversation_of_its_own() -> None:
    live = LiveConversations(window=600)
    live.seen(["a1", "a2", "a3", "a4"], now=0)
    assert live.seen(["a1", "a2", "x3", "x4"], now=1)  # parts from it before its last key
    assert live.count(now=1) == 2


def test_conversations_stop_being_live_after_the_window() -> None:
    live = LiveConversations(window=10)
    live.seen(["a1"], now=0)
    live.seen(["b1"], now=5)
    assert live.count(now=9) == 2
    assert live.count(now=12) == 1
    live.seen(["b1", "b2", "b3"], now=14)  # seen again: its clock starts again
    assert live.count(now=20) == 1


def test_memory_is_bounded_however_many_conversations_come() -> None:
    live = LiveConversations(window=600, limit=3)
    for i in range(10):
        live.seen([f"k{i}"], now=i)
    assert live.count(now=10) == 3


def test_conversations_known_from_before_a_restart_stay_live_within_the_window() -> None:
    live = LiveConversations(window=600)
    live.seen(["new1"], now=1000)
    live.recall([("old1", 900.0), ("old2", 100.0)], now=1000)  # old2: beyond the window
    assert live.count(now=1000) == 2
    assert not live.seen(["old1", "old1-reply", "old1-next"], now=1001)  # it came back
    assert live.count(now=1001) == 2
