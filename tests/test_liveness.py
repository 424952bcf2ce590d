"""A request waiting on a server that is found hung gives up its wait (Hung) when another
server could take it, and only then; a client hanging up still cancels it."""

from __future__ import annotations

import asyncio

import pytest

from kvproxy.cache.servers.liveness import Hung, Liveness


async def never() -> int:
    await asyncio.Event().wait()
    return 0


async def soon(value: int) -> int:
    await asyncio.sleep(0)
    return value


async def test_a_lone_servers_requests_just_wait_for_their_work() -> None:
    live = Liveness()
    live.found_hung()
    assert await live.unless_hung(soon(7)) == 7


async def test_found_hung_with_another_server_up_the_wait_is_given_up() -> None:
    live = Liveness()
    others_up = [True]
    live.elsewhere = lambda: others_up[0]
    assert await live.unless_hung(soon(3)) == 3
    cleaned = asyncio.Event()

    async def held() -> int:
        try:
            return await never()
        finally:
            cleaned.set()  # the work sees the cancellation, as on a client's hang-up

    waiting = asyncio.create_task(live.unless_hung(held()))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    live.found_hung()
    with pytest.raises(Hung):
        await waiting
    assert cleaned.is_set()


async def test_with_nowhere_else_to_go_it_waits_on_until_somewhere_is() -> None:
    live = Liveness()
    others_up = [False]
    live.elsewhere = lambda: others_up[0]
    live.found_hung()
    waiting = asyncio.create_task(live.unless_hung(never()))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    others_up[0] = True  # another server came back into rotation
    with pytest.raises(Hung):
        await asyncio.wait_for(waiting, 10)


async def test_a_server_that_answers_again_is_no_longer_hung() -> None:
    live = Liveness()
    live.elsewhere = lambda: True
    live.found_hung()
    live.answered()
    assert not live.hung
    assert await live.unless_hung(soon(5)) == 5


async def test_a_client_hanging_up_cancels_as_before() -> None:
    live = Liveness()
    live.elsewhere = lambda: True
    waiting = asyncio.create_task(live.unless_hung(never()))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_request_goes_on_after_giving_up() -> None:
    """After Hung, the caller's task awaits again normally (no cancellation left over)."""
    live = Liveness()
    live.elsewhere = lambda: True

    async def request() -> str:
        try:
            await live.unless_hung(never())
        except Hung:
            pass
        await asyncio.sleep(0.01)  # would raise CancelledError if one were left pending
        return "served elsewhere"

    task = asyncio.create_task(request())
    await asyncio.sleep(0.01)
    live.found_hung()
    assert await task == "served elsewhere"
