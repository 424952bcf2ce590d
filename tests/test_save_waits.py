"""How long a returning turn waits for its own state's save still under way: at least the
floor, and as long as prefilling that state would take (a big state's commit can outlast the
floor; giving up means that prefill)."""

from __future__ import annotations

import asyncio

import pytest

from kvproxy.cache.decisions.payoff import SAVE_WAIT_CEILING_S, SAVE_WAIT_FLOOR_S, save_wait_s
from kvproxy.cache.disk.saving import SavesUnderWay


def test_a_state_whose_prefill_takes_longer_than_the_floor_is_waited_for_that_long() -> None:
    # 8,192 tokens at 25 ms a token: 204.8 s of prefill.
    assert save_wait_s(8192, 25.0) == pytest.approx(204.8)
    assert save_wait_s(1000, 1.0) == SAVE_WAIT_FLOOR_S  # a second of prefill: the floor
    assert save_wait_s(None, 25.0) == SAVE_WAIT_FLOOR_S  # size not known
    assert save_wait_s(8192, None) == SAVE_WAIT_FLOOR_S  # nothing measured yet
    assert save_wait_s(10**9, 25.0) == SAVE_WAIT_CEILING_S  # a disk that hangs holds no turn


def _commit_taking(seconds: float) -> asyncio.Future[None]:
    return asyncio.ensure_future(asyncio.sleep(seconds))


def test_a_big_states_commit_is_waited_for_past_the_floor() -> None:
    async def run() -> tuple[bool, bool]:
        under_way = SavesUnderWay()
        big, small = _commit_taking(0.3), _commit_taking(0.3)
        under_way.committing("big", big, tokens=1000)  # 1 ms a token: 1 s of prefill
        under_way.committing("small", small)  # its size not known: the floor
        await under_way.done(["small"], prefill_ms_per_token=1.0, floor=0.05)
        small_done = small.done()
        await under_way.done(["big"], prefill_ms_per_token=1.0, floor=0.05)
        return small_done, big.done()

    small_done, big_done = asyncio.run(run())
    assert not small_done  # gave up at the floor
    assert big_done  # waited for the commit, past the floor
