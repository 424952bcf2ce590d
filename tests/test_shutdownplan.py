"""What a shutdown saves in its budget (kvproxy/cache/decisions/shutdownplan.py), on plain data."""

from __future__ import annotations

from kvproxy.cache.decisions.shutdownplan import Candidate, ShutdownPlan, plan_shutdown

# Four slots of one server holding 8k-token states (1 GiB at 128 KiB a token): ~7.2 s each at
# an assumed 150 MB/s, the most recently used last.
FOUR = [Candidate(i, 8192, 7.2, last_used=float(i)) for i in range(4)]


def test_what_fits_is_saved_the_most_recently_used_first_and_the_rest_named() -> None:
    plan = plan_shutdown(FOUR, budget_s=18.0)
    assert plan == ShutdownPlan(save=(3, 2), skip=((1, 7.2), (0, 7.2)))


def test_everything_is_saved_when_it_fits() -> None:
    assert plan_shutdown(FOUR, budget_s=30.0).save == (3, 2, 1, 0)


def test_the_most_tokens_per_second_of_save_go_first() -> None:
    """A conversation that came back from a cheap prefill, or whose state is quantised, is
    worth more of the deadline than one whose save takes as long for fewer tokens."""
    dense = Candidate(0, 8192, 4.0, last_used=1.0)
    sparse = Candidate(1, 2048, 4.0, last_used=9.0)
    assert plan_shutdown([sparse, dense], budget_s=5.0) == ShutdownPlan((0,), ((1, 4.0),))


def test_a_save_that_does_not_fit_leaves_room_for_a_smaller_one_after_it() -> None:
    big = Candidate(0, 16384, 14.4, last_used=9.0)
    small = Candidate(1, 2048, 1.8, last_used=1.0)
    plan = plan_shutdown([big, small], budget_s=10.0)
    assert plan == ShutdownPlan(save=(1,), skip=((0, 14.4),))


def test_a_save_of_unknown_length_goes_last_while_time_is_left() -> None:
    unknown = Candidate(0, 4096, None, last_used=99.0)
    known = Candidate(1, 4096, 2.0, last_used=1.0)
    assert plan_shutdown([unknown, known], budget_s=3.0).save == (1, 0)
    assert plan_shutdown([unknown, known], budget_s=2.0) == ShutdownPlan((1,), ((0, None),))


def test_no_time_saves_nothing_and_names_everything() -> None:
    plan = plan_shutdown(FOUR, budget_s=0.0)
    assert plan.save == () and sorted(i for i, _ in plan.skip) == [0, 1, 2, 3]
