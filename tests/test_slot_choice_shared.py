"""The invariant and the slot choice for sessions that share an opening, on plain data
(plan.decide, slotchoice): a plan replaces what a slot holds only after saving it, and a
conversation goes to the slot that serves it most, waiting only for its own."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvproxy.cache.decisions.policy import Move
from kvproxy.cache.decisions.slotchoice import choose, finishing_best, home_of
from kvproxy.cache.servers.slots import Holding, Slot
from kvproxy.handlers.plan import Facts, decide

OPENING = ["sys"]


def holding(*chain: str) -> Holding:
    return Holding("ns", list(chain), 100 * len(chain), len(chain))


facts = st.builds(
    Facts,
    resident=st.integers(0, 6),
    held_depth=st.integers(0, 6),
    stored=st.none() | st.integers(0, 6),
    restores_allowed=st.booleans(),
    worth_saving=st.booleans(),
    held_opening=st.booleans(),
    stem=st.booleans(),
)


@given(facts)
def test_no_plan_replaces_a_state_it_could_save_without_saving_it(f: Facts) -> None:
    plan = decide(f)
    replaces = plan.move is not Move.USE_RESIDENT or f.resident < f.held_depth
    if replaces and f.worth_saving:
        assert plan.save, plan
    if not f.worth_saving:
        assert not plan.save, plan


def test_a_new_session_on_a_slot_holding_another_saves_it_first() -> None:
    """Session B shares only the opening with session A's unsaved state in the slot."""
    plan = decide(Facts(1, 3, None, True, worth_saving=True, held_opening=False))
    assert plan.move is Move.USE_RESIDENT and plan.save and not plan.leave_opening


def test_the_slot_holding_the_conversation_whole_wins_over_one_sharing_its_opening() -> None:
    a = Slot(0, holding("sys", "a1"), saved=False)
    b = Slot(1, holding("sys", "b1", "b2"), saved=False)
    slot, depth = choose([a, b], ["sys", "b1", "b2", "b3"], "ns")
    assert slot is b and depth == 3
    # A new session of the same opening: either serves the opening; the one on disk wins.
    a.saved = True
    slot, depth = choose([a, b], ["sys", "c1"], "ns")
    assert slot is a and depth == 1


def test_what_the_server_reuses_decides_not_the_keys_alone() -> None:
    """A restored state the model cannot cut back serves nothing of a branch."""
    a = Slot(0, holding("sys", "a1", "a2"), saved=True)
    b = Slot(1, holding("sys"), saved=True)
    serves = {0: 0, 1: 1}
    slot, depth = choose([a, b], ["sys", "c1"], "ns", serves=lambda s: serves[s.id])
    assert slot is b and depth == 1


def test_a_slot_sharing_only_an_opening_is_no_conversations_home() -> None:
    a = Slot(0, holding("sys", "a1", "a2"), busy=True)
    a.serving = ["sys", "a1", "a2", "a3"]
    assert home_of([a], ["sys", "c1"], "ns") is None
    assert home_of([a], ["sys", "a1", "a2", "a3", "a4"], "ns") is a
    idle = Slot(1, holding("sys", "b1", "b2"))
    assert home_of([idle], ["sys", "b1"], "ns") is idle, "it rewrites its last message"
    assert home_of([idle], ["sys", "b9"], "ns") is None
    assert home_of([idle], ["sys", "b1", "b2", "b3"], "other-tenant") is None


def test_a_returning_session_restores_on_a_free_slot_rather_than_push_another_out() -> None:
    """Session A's state is on disk; its old slot now holds session B, unsaved, of the same
    opening. A's next turn takes the empty slot (restoring its own state there), not B's."""
    b = Slot(0, holding("sys", "b1", "b2"), saved=False)
    empty = Slot(1)
    slot, depth = choose([b, empty], ["sys", "a1", "a2", "a3"], "ns")
    assert slot is empty and depth == 0
    # A new session of the opening still starts from the slot holding it.
    slot, depth = choose([b, empty], ["sys", "c1"], "ns")
    assert slot is b and depth == 1


def _finishing(slot_id: int, *chain: str) -> Slot:
    slot = Slot(slot_id, holding(*chain), busy=True)
    slot.finishing = True
    return slot


def test_a_slot_finishing_kvproxys_work_after_its_reply_is_waited_for_when_it_serves_most() -> None:
    """The server alone would find that slot idle (no save, no GET /slots after a reply)
    and choose it by its common prefix: the next completion waits for it."""
    done = _finishing(0, "file", "line", "cursor 1")
    other = Slot(1, holding("other file"), saved=True)
    assert finishing_best([done, other], ["file", "line", "cursor 2"], "ns") is done


def test_a_finishing_slot_is_not_waited_for_when_an_idle_one_serves_as_much() -> None:
    done = _finishing(0, "file", "line", "cursor 1")
    same = Slot(1, holding("file", "line", "cursor 0"), saved=True)
    assert finishing_best([done, same], ["file", "line", "cursor 2"], "ns") is None


def test_a_slot_busy_with_another_request_is_not_waited_for() -> None:
    """Generating, it is what the server alone would pass over too."""
    busy = Slot(0, holding("file", "line", "cursor 1"), busy=True)
    idle = Slot(1, None)
    assert finishing_best([busy, idle], ["file", "line", "cursor 2"], "ns") is None
