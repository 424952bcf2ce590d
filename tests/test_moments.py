"""When a save may start on a server (kvproxy/cache/decisions/moments.py), on plain data: one at a time,
a big one only in a moment when no other slot generates, a request's own at most `max_wait`
later, an optional one never while a request could come soon."""

from __future__ import annotations

from kvproxy.cache.decisions.moments import ServerNow, may_start

BIG = 2.0  # seconds a save of a 2 GiB state takes at ~1 GB/s
GAP = 0.05  # the server's token gap


def start(now: ServerNow, optional: bool, waited: float = 0.0, save_s: float | None = BIG) -> bool:
    moment = may_start(
        now, save_s=save_s, token_gap_s=GAP, optional=optional, waited=waited, max_wait=10.0
    )
    return moment.go


def test_never_two_saves_at_once_on_a_server() -> None:
    busy = ServerNow(saving=True)
    assert not start(busy, optional=False)
    assert not start(busy, optional=False, waited=60.0)  # not even once its wait is up
    assert not start(busy, optional=True, save_s=0.001)  # nor a small one
    assert not may_start(busy, save_s=BIG, token_gap_s=GAP, optional=False, waited=0, max_wait=0).go


def test_a_save_a_request_needs_waits_for_a_moment_no_other_slot_generates() -> None:
    streaming = ServerNow(working=1)
    moment = may_start(
        streaming, save_s=BIG, token_gap_s=GAP, optional=False, waited=3.0, max_wait=10.0
    )
    assert not moment.go and moment.retry_in == 7.0  # looked at again when its wait is up
    assert start(ServerNow(), optional=False)  # the stream ended
    assert start(streaming, optional=False, waited=10.0)  # at most max_wait, then anyway


def test_a_save_not_longer_than_a_token_goes_at_any_time() -> None:
    streaming = ServerNow(working=2)
    assert start(streaming, optional=False, save_s=GAP)
    assert start(streaming, optional=True, save_s=GAP / 2)
    assert not start(streaming, optional=False, save_s=GAP * 3)
    assert not start(streaming, optional=False, save_s=None)  # its size not known: big


def test_an_optional_save_never_pauses_a_stream_however_long_it_was_due() -> None:
    assert not start(ServerNow(working=1), optional=True)
    assert not start(ServerNow(working=1), optional=True, waited=3600.0)


def test_an_optional_save_never_starts_while_a_request_waits_for_a_slot() -> None:
    assert not start(ServerNow(waiting=1), optional=True)
    assert not start(ServerNow(waiting=1), optional=True, waited=3600.0)
    assert start(ServerNow(waiting=1), optional=False)  # a request's own: the queue is its


def test_an_optional_save_waits_while_a_tool_result_is_due_unless_overdue() -> None:
    due = ServerNow(tool_wait=4.0)
    moment = may_start(due, save_s=BIG, token_gap_s=GAP, optional=True, waited=1.0, max_wait=10)
    assert not moment.go and moment.retry_in == 4.0  # when the result stops being expected
    assert start(due, optional=False)  # a request's own save does not wait for it
    # An idle checkpoint due for max_wait already (a shutdown relies on it) goes.
    assert start(due, optional=True, waited=10.0)


def test_an_idle_server_takes_any_save() -> None:
    assert start(ServerNow(), optional=True)
    assert start(ServerNow(), optional=True, save_s=None)


def test_max_wait_zero_saves_at_once() -> None:
    for now in (ServerNow(working=3), ServerNow(tool_wait=5.0), ServerNow(waiting=2)):
        assert may_start(now, save_s=BIG, token_gap_s=GAP, optional=True, waited=0, max_wait=0).go
