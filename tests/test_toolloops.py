"""Conversations waiting for a tool's result (kvproxy/cache/decisions/toolloops.py), on plain data, and
the slot a newcomer gets beside one (kvproxy/cache/decisions/slotchoice.py)."""

from __future__ import annotations

from kvproxy.cache.decisions.slotchoice import choose
from kvproxy.cache.decisions.toolloops import ToolLoops, window_for
from kvproxy.cache.servers.slots import Holding, Slot

A = ["sys", "a1", "a-call"]  # a conversation whose last reply is a tool call


def test_a_tool_call_is_waited_for_until_its_result_comes() -> None:
    loops = ToolLoops(window=30.0)
    loops.replied("ns", A, now=0.0)
    assert [a.chain for a in loops.waiting(now=1.0)] == [tuple(A)]
    assert loops.due_in(now=1.0) == 29.0
    loops.returned([*A, "a-result"])  # the request carrying the call and its result
    assert loops.waiting(now=2.0) == [] and loops.due_in(now=2.0) == 0.0


def test_a_tool_call_stops_being_waited_for_after_the_window() -> None:
    loops = ToolLoops(window=30.0)
    loops.replied("ns", A, now=0.0)
    loops.replied("ns", ["sys", "b1", "b-call"], now=20.0)
    assert len(loops.waiting(now=29.0)) == 2
    assert [a.key for a in loops.waiting(now=31.0)] == ["b-call"]
    assert loops.due_in(now=31.0, but="b-call") == 0.0


def test_another_request_of_the_same_opening_does_not_end_the_wait() -> None:
    loops = ToolLoops(window=30.0)
    loops.replied("ns", A, now=0.0)
    loops.returned(["sys", "c1"])
    assert len(loops.waiting(now=1.0)) == 1


def test_a_slot_holds_the_waiting_conversation_only_when_it_holds_it_whole() -> None:
    loops = ToolLoops(window=30.0)
    loops.replied("ns", A, now=0.0)
    assert loops.holds_awaited(A, "ns", now=1.0)
    assert not loops.holds_awaited(A, "other-tenant", now=1.0)
    assert not loops.holds_awaited(A[:2], "ns", now=1.0)
    assert not loops.holds_awaited(A, "ns", now=31.0)


def test_the_wait_is_bounded_in_memory_and_by_the_idle_checkpoint() -> None:
    loops = ToolLoops(window=30.0, limit=3)
    for i in range(10):
        loops.replied("ns", [f"k{i}"], now=float(i))
    assert len(loops.waiting(now=10.0)) == 3
    assert window_for(10.0) == 10.0 and window_for(3600.0) == 30.0
    off = ToolLoops(window=0.0)
    off.replied("ns", A, now=0.0)
    assert off.waiting(now=0.0) == []


def slot(i: int, chain: list[str] | None, saved: bool, last_used: float) -> Slot:
    held = Holding("ns", chain, 100 * len(chain), len(chain)) if chain else None
    return Slot(i, held, saved=saved, last_used=last_used)


def test_a_newcomer_takes_another_slot_even_one_that_must_be_saved_first() -> None:
    loops = ToolLoops(window=30.0)
    loops.replied("ns", A, now=0.0)
    tool_loop = slot(0, A, saved=False, last_used=1.0)  # the least recently used
    other = slot(1, ["sys", "b1", "b2"], saved=False, last_used=5.0)

    def awaited(s: Slot) -> bool:
        held = s.holding
        return held is not None and loops.holds_awaited(held.chain, held.namespace, now=2.0)

    got, depth = choose([tool_loop, other], ["x1"], "ns", awaited=awaited)
    assert got is other and depth == 0
    assert choose([tool_loop, other], ["x1"], "ns")[0] is tool_loop  # without the rule: LRU
    # A new session of the same opening would go on from the tool loop's slot's opening.
    assert choose([tool_loop, other], ["sys", "c1"], "ns", awaited=awaited)[0] is other
    # The tool loop's own result takes its slot.
    got, depth = choose([tool_loop, other], [*A, "a-result"], "ns", awaited=awaited)
    assert got is tool_loop and depth == 3
    # With no other idle slot, the newcomer takes it (saved first, on its path).
    assert choose([tool_loop], ["x1"], "ns", awaited=awaited)[0] is tool_loop
