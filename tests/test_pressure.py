"""The background-save policy (kvproxy/cache/decisions/pressure.py) on plain data."""

from __future__ import annotations

from kvproxy.cache.decisions.pressure import (
    IdleView,
    LiveConversations,
    SaveDecision,
    ServerView,
    gives_way,
    next_background_save,
)


def view(
    i: int,
    idle_for: float,
    busy: bool = False,
    worth: bool = True,
    serving: bool = False,
    awaited: bool = False,
    save_s: float | None = None,
) -> IdleView:
    return IdleView(i, busy or serving, worth, idle_for, serving, awaited, save_s)


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
    # Slot 1 streams a reply: the save of slot 0 would pause that stream. A slot freed looks
    # again (no timer).
    slots = [view(0, 2.0), view(1, 0.0, serving=True), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == NOTHING


def test_a_save_the_next_request_would_need_waits_for_the_stream_too() -> None:
    # No other idle slot is free: the next new conversation saves slot 0 on its own path,
    # and that save too waits for a moment no stream is paused (cache/scheduling/savegate.py).
    slots = [view(0, 2.0), view(1, 0.0, serving=True)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == NOTHING


def test_a_held_back_save_goes_when_the_request_ends() -> None:
    slots = [view(0, 2.0), view(1, 0.0), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_a_background_save_never_pauses_a_stream_however_long_it_was_due() -> None:
    slots = [view(0, 3600.0), view(1, 0.0, serving=True), free(2)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == NOTHING


def test_max_wait_zero_saves_at_once_as_before() -> None:
    slots = [view(0, 0.5), view(1, 0.0, serving=True), free(2)]
    assert next_background_save(slots, live=4, waiting=0, idle_save_after=30) == save_now(0)


def test_a_save_small_against_the_servers_token_gap_goes_during_a_stream() -> None:
    slots = [view(0, 2.0, save_s=0.01), view(1, 0.0, serving=True), free(2)]
    server = ServerView(token_gap_s=0.05)
    decision = next_background_save(
        slots, live=4, waiting=0, idle_save_after=30, max_wait=10, server=server
    )
    assert decision == save_now(0)


def test_no_save_starts_beside_another_save_under_way() -> None:
    slots = [view(0, 2.0), free(1)]
    decision = next_background_save(
        slots, live=4, waiting=0, idle_save_after=30, max_wait=10, server=ServerView(saving=True)
    )
    assert decision == NOTHING


def test_a_slot_whose_conversation_waits_for_a_tool_result_is_not_saved() -> None:
    slots = [view(0, 20.0, awaited=True), view(1, 5.0)]
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(1)
    assert next_background_save(slots[:1], live=4, waiting=0, idle_save_after=30) == NOTHING


def test_no_save_starts_while_a_tool_result_is_due_until_it_stops_being_due() -> None:
    """Conversation 0 just got a tool call back: its result's request would wait for the write
    on the server's loop. Slot 1 is due under pressure: it goes once the result came or is no
    longer expected."""
    slots = [view(0, 1.0, awaited=True), view(1, 5.0)]
    due = ServerView(tool_wait=3.0)
    decision = next_background_save(
        slots, live=4, waiting=0, idle_save_after=30, max_wait=10, server=due
    )
    assert decision == SaveDecision(retry_in=3.0)
    assert next_background_save(slots, live=4, waiting=0, idle_save_after=30) == save_now(1)


def test_an_idle_checkpoint_due_for_max_wait_no_longer_waits_for_tool_results() -> None:
    """An idle slot's save after --idle-save-after is what a shutdown relies on."""
    due = ServerView(tool_wait=3.0)
    slots = [view(0, 41.0), view(1, 0.5, awaited=True)]
    decision = next_background_save(
        slots, live=1, waiting=0, idle_save_after=30, max_wait=10, server=due
    )
    assert decision == save_now(0)
    # Under pressure, a save due for longer only spares a later request its save: it waits.
    slots = [view(0, 15.0), view(1, 0.5, awaited=True)]
    decision = next_background_save(
        slots, live=4, waiting=0, idle_save_after=30, max_wait=10, server=due
    )
    assert decision == SaveDecision(retry_in=3.0)


def test_a_slot_taken_by_a_background_save_holds_nothing_back() -> None:
    slots = [view(0, 2.0), view(1, 1.0, busy=True), free(2)]  # busy, but not with a request
    decision = next_background_save(slots, live=4, waiting=0, idle_save_after=30, max_wait=10)
    assert decision == save_now(0)


def test_a_save_under_way_gives_way_when_the_server_is_no_longer_idle() -> None:
    saving = view(0, 3.0, busy=True)
    streaming = view(1, 0.0, serving=True)

    def gives(
        slots: list[IdleView], max_wait: float = 10.0, waiting: int = 0, tool_wait: float = 0.0
    ) -> bool:
        server = ServerView(waiting=waiting, tool_wait=tool_wait)
        return gives_way(slots, 0, idle_save_after=30.0, max_wait=max_wait, server=server)

    assert gives([saving, streaming, free(2)])
    assert gives([saving, streaming])  # the next request's own save would wait for it too
    assert not gives([saving, view(1, 0.0), free(2)])  # nothing served
    assert gives([saving, view(1, 0.0)], waiting=1)  # a request waits for a slot
    assert gives([saving, view(1, 0.0)], tool_wait=2.0)  # a tool result came due
    assert not gives([view(0, 45.0, busy=True), view(1, 0.0)], tool_wait=2.0)  # overdue
    assert gives([view(0, 45.0, busy=True), streaming])  # overdue, but never during a stream
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
