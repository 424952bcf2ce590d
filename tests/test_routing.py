"""Which server a request goes to with several behind kvproxy (lanes/routing.py), on plain
data, and the rule's promises over any mix of servers (hypothesis)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvproxy.lanes.routing import LaneView, choose_lane, least_loaded


def lane(
    *,
    up: bool = True,
    resident_idle: int = 0,
    resident_busy: int = 0,
    idle: int = 2,
    waiting: int = 0,
    slots: int = 2,
    empty: int = 0,
    saving: int = 0,
) -> LaneView:
    return LaneView(up, resident_idle, resident_busy, idle, waiting, slots, empty, saving)


def test_the_server_holding_the_conversation_gets_it() -> None:
    assert choose_lane([lane(), lane(resident_idle=3), lane()]) == 1


def test_the_longest_resident_prefix_wins() -> None:
    assert choose_lane([lane(resident_idle=2), lane(resident_idle=5)]) == 1


def test_a_new_conversation_goes_where_a_slot_is_idle_and_fewest_wait() -> None:
    assert choose_lane([lane(idle=0, waiting=0), lane(idle=1)]) == 1
    assert choose_lane([lane(idle=1, waiting=2), lane(idle=1, waiting=0)]) == 1
    assert choose_lane([lane(idle=1), lane(idle=2)]) == 1


def test_no_request_waits_on_a_busy_server_when_its_state_is_on_disk() -> None:
    # The conversation's slot is busy but what it holds is saved: the idle server restores it
    # from disk now rather than queueing behind (resident_busy counts unsaved holders only).
    views = [lane(resident_busy=0, idle=0, waiting=1), lane(idle=2)]
    assert choose_lane(views) == 1


def test_an_unsaved_conversation_waits_for_its_busy_slot() -> None:
    # An agent's next turn while its last reply's bookkeeping runs: only that slot holds it.
    assert choose_lane([lane(idle=2, empty=2), lane(resident_busy=3, idle=1)]) == 1
    # Held idle somewhere is better still.
    assert choose_lane([lane(resident_idle=2), lane(resident_busy=3, idle=1)]) == 0


def test_with_every_slot_busy_the_least_queued_per_slot() -> None:
    assert choose_lane([lane(idle=0, waiting=3), lane(idle=0, waiting=1)]) == 1
    assert choose_lane([lane(idle=0, waiting=4, slots=4), lane(idle=0, waiting=3, slots=2)]) == 0


def test_with_no_idle_slot_a_slot_finishing_a_background_save_beats_a_queue() -> None:
    # Seen on two servers: a request queued behind a whole prefill on one server while the
    # other's slot was free 30 ms later, when its background save ended.
    assert choose_lane([lane(idle=0), lane(idle=0, saving=1)]) == 1
    # A save already owed to a waiting request frees nothing for this one.
    assert choose_lane([lane(idle=0, waiting=0), lane(idle=0, saving=1, waiting=1)]) == 0
    # An idle slot now is better than one soon.
    assert choose_lane([lane(idle=0, saving=2), lane(idle=1)]) == 1


def test_a_server_out_of_rotation_gets_nothing_while_another_is_in_it() -> None:
    assert choose_lane([lane(up=False, resident_idle=9), lane(idle=0, waiting=5)]) == 1
    assert least_loaded([lane(up=False), lane(idle=0, waiting=5)]) == 1
    # With none in rotation, one is still chosen (its answer is the client's: a 502).
    assert choose_lane([lane(up=False), lane(up=False, idle=0)]) in (0, 1)


def test_a_new_conversation_goes_where_a_slot_holds_nothing_before_pushing_one_out() -> None:
    assert choose_lane([lane(idle=2, empty=0), lane(idle=1, empty=1)]) == 1


def test_unkeyed_requests_go_to_the_least_loaded() -> None:
    assert least_loaded([lane(idle=0, waiting=1), lane(idle=1)]) == 1
    assert least_loaded([lane(idle=1), lane(idle=2)]) == 1


views_st = st.lists(
    st.builds(
        LaneView,
        in_rotation=st.booleans(),
        resident_idle=st.integers(0, 6),
        resident_busy=st.integers(0, 6),
        idle_slots=st.integers(0, 4),
        waiting=st.integers(0, 8),
        slots=st.integers(1, 4),
        empty_slots=st.integers(0, 4),
    ),
    min_size=1,
    max_size=5,
)


@given(views_st)
def test_the_choice_is_always_a_server_in_rotation_when_there_is_one(
    views: list[LaneView],
) -> None:
    chosen = choose_lane(views)
    assert 0 <= chosen < len(views)
    if any(v.in_rotation for v in views):
        assert views[chosen].in_rotation
    assert views[least_loaded(views)].in_rotation or not any(v.in_rotation for v in views)


@given(views_st)
def test_an_idle_slot_anywhere_in_rotation_means_no_wait(views: list[LaneView]) -> None:
    chosen = choose_lane(views)
    usable = [v for v in views if v.in_rotation] or views
    if any(v.idle_slots > 0 for v in usable):
        held = views[chosen].resident_idle > 0 or views[chosen].resident_busy > 0
        assert views[chosen].idle_slots > 0 or held
