"""The cache's decisions on plain data (cache/decisions/policy.py): no server, no HTTP."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from kvproxy.cache.decisions.policy import (
    INEFFECTIVE_LIMIT,
    HeldView,
    Move,
    RestoreGuard,
    RestoreVerdict,
    choose,
    judge_restore,
    worth_saving,
)
from kvproxy.handlers.plan import Facts
from kvproxy.handlers.plan import decide as plan_decide
from kvproxy.wire import CHAT_TAIL, Tail
from kvproxy.wire.prompts import EXACT, NEAR_END

CHAIN = ["k0", "k1", "k2", "k3"]


def held(n_tokens: int = 1000, saved: bool = False, chain: list[str] = CHAIN) -> HeldView:
    return HeldView("ns", chain, n_tokens, saved)


def test_a_longer_stored_prefix_is_restored_a_resident_one_is_used() -> None:
    assert choose(resident_depth=2, stored_depth=4, restores_allowed=True) is Move.RESTORE
    assert choose(resident_depth=4, stored_depth=4, restores_allowed=True) is Move.USE_RESIDENT
    assert choose(resident_depth=3, stored_depth=2, restores_allowed=True) is Move.USE_RESIDENT
    assert choose(resident_depth=0, stored_depth=None, restores_allowed=True) is Move.START_COLD
    assert choose(resident_depth=0, stored_depth=3, restores_allowed=False) is Move.START_COLD
    assert choose(resident_depth=1, stored_depth=3, restores_allowed=False) is Move.USE_RESIDENT


@given(st.integers(0, 50), st.one_of(st.none(), st.integers(1, 50)), st.booleans())
def test_a_restore_never_replaces_at_least_as_much_in_the_slot(
    resident: int, stored: int | None, allowed: bool
) -> None:
    move = choose(resident, stored, allowed)
    if move is Move.RESTORE:
        assert allowed and stored is not None and stored > resident
    else:
        assert (move is Move.USE_RESIDENT) == (resident > 0)


def decide(h: HeldView | None, **kw: object) -> bool:
    opts: dict[str, Any] = {"disk_enabled": True, "restores_allowed": True, "min_tokens": 256, **kw}
    return worth_saving(h, **opts)


def test_what_is_worth_a_save() -> None:
    assert decide(held())
    assert not decide(None)
    assert not decide(held(saved=True)), "already on disk"
    assert not decide(held(n_tokens=100)), "below --min-tokens"
    assert not decide(held(), disk_enabled=False)
    assert not decide(held(), restores_allowed=False), "it would never be restored"


def plan_saves(held_depth: int, shared: int, tail: Tail, resident: int | None = None) -> bool:
    """Whether a request sharing `shared` of the slot's `held_depth` boundaries (the server
    reusing `resident` of them) saves what the slot holds first, for a slot worth saving."""
    facts = Facts(
        resident=shared if resident is None else resident,
        held_depth=held_depth,
        stored=None,
        restores_allowed=True,
        worth_saving=True,
        held_opening=False,
        shared=shared,
        may_drop=tail.of(held_depth),
    )
    return plan_decide(facts).save


def test_no_save_when_the_incoming_request_continues_or_regenerates_the_conversation() -> None:
    assert not plan_saves(4, 4, CHAT_TAIL), "continues it"
    assert not plan_saves(4, 3, CHAT_TAIL), "regenerated reply"
    assert plan_saves(4, 2, CHAT_TAIL), "a branch loses the last turns"
    assert plan_saves(4, 0, CHAT_TAIL)
    assert not plan_saves(4, 3, CHAT_TAIL, resident=0), "restored, not served: still goes on"


def test_a_text_completion_goes_on_from_a_state_it_edits_near_its_end() -> None:
    # An editor's next completion keeps all but the last tenth of the blocks (one at least).
    assert not plan_saves(40, 36, NEAR_END)
    assert plan_saves(40, 35, NEAR_END)
    assert not plan_saves(5, 4, NEAR_END)
    assert plan_saves(5, 0, NEAR_END), "shares nothing: replaces it"
    # An infill goes on only from exactly what the slot holds.
    assert not plan_saves(5, 5, EXACT)
    assert plan_saves(5, 4, EXACT)


def test_a_restore_counts_as_reused_when_half_of_what_could_be_was() -> None:
    assert judge_restore(1000, cache_n=990, prompt_n=40) is RestoreVerdict.REUSED
    assert judge_restore(1000, cache_n=0, prompt_n=1030) is RestoreVerdict.WASTED
    # A prompt shorter than the restored state: only the prompt less one token can be reused.
    assert judge_restore(1000, cache_n=150, prompt_n=151) is RestoreVerdict.REUSED
    assert judge_restore(1000, cache_n=None, prompt_n=None) is RestoreVerdict.UNKNOWN


def test_the_guard_turns_restores_off_after_wasted_ones_in_a_row() -> None:
    guard = RestoreGuard()
    wasted = RestoreVerdict.WASTED
    turned_off = [guard.record("L", "a", f"k{i}", False, wasted) for i in range(INEFFECTIVE_LIMIT)]
    assert turned_off == [False] * (INEFFECTIVE_LIMIT - 1) + [True]
    # This server reuses none of its own restores: the namespace's restores and saves stop.
    assert not guard.allows("L", "a", "new", False) and not guard.allows("L", "a", "old", True)
    assert not guard.allows_saves("L", "a")
    assert guard.allows("L", "b", "b0", False) and guard.allows_saves("L", "b")
    # Another start of the server (another life) has proved nothing yet.
    assert guard.allows("M", "a", "k0", False) and guard.allows_saves("M", "a")
    assert not guard.record("L", "a", "k9", False, wasted), "said once"

    other = RestoreGuard()
    for i in range(INEFFECTIVE_LIMIT - 1):
        other.record("L", "a", f"k{i}", False, wasted)
    other.record("L", "a", "x", False, RestoreVerdict.REUSED)  # breaks the streak
    other.record("L", "a", "y", False, RestoreVerdict.UNKNOWN)  # says nothing
    assert not other.record("L", "a", "z", False, wasted) and other.allows("L", "a", "n", False)
    assert not other.allows("L", "a", "z", False), "an entry not reused is set aside"
    assert other.allows("M", "a", "z", False), "for that life only"


def test_wasted_restores_of_older_entries_stop_only_those() -> None:
    """States saved before the server's start that it does not reuse (its template changed)
    prove nothing about the states it saves itself: new conversations are still cached."""
    guard = RestoreGuard()
    for i in range(INEFFECTIVE_LIMIT):
        guard.record("L", "a", f"old{i}", True, RestoreVerdict.WASTED)
    assert not guard.allows("L", "a", "another-old", True)
    assert guard.allows("L", "a", "new", False)
    assert guard.allows_saves("L", "a")


def test_an_entry_set_aside_is_not_restored_in_that_life() -> None:
    guard = RestoreGuard()
    guard.set_aside("L", "k")
    assert not guard.allows("L", "a", "k", False)
    assert guard.allows("L", "a", "j", False) and guard.allows("M", "a", "k", False)
