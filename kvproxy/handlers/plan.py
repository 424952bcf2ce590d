"""What `prepare` will do for a keyed request, decided on plain data: no I/O, no clock.

`Facts` are what the request's slot, the store and the policy say once the slot is known
(prepare.py gathers them); `decide` turns them into a `Plan`. Every plan but "use what the
slot holds" first vacates the slot, in one order: save what would be lost, leave the opening
it passes through on disk, admit the request's tenant (erasing another tenant's tokens).

The invariant every plan keeps: nothing runs on a slot holding a state kvproxy could still
save unless it is saved first, or the request goes on from it (`goes_on`). A request that
shares only part of what the slot holds (another session of the same opening, a branch)
replaces the rest, so it saves first too. What a request may drop of the slot's tail and
still go on from it is a fact of its kind (`Conversation.tail`): a chat its last message (a
regenerated reply), an editor's text completion the last tenth, an infill nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvproxy.cache.decisions.policy import Move, choose


@dataclass(frozen=True)
class Facts:
    resident: int  # boundaries of the request the slot serves (0: none)
    held_depth: int  # boundaries the slot holds (0: nothing known)
    stored: int | None  # boundaries the best stored entry shares (None: none found)
    restores_allowed: bool
    worth_saving: bool  # what the slot holds is not on disk, and is worth a file
    held_opening: bool  # what the slot holds passes through a wanted opening with no entry
    # The store holds the stem of the request's system message (cache/prefixes/stems.py): it
    # shares no whole message, but the request extends it exactly.
    stem: bool = False
    # Boundaries the request shares with what the slot holds, whatever the server reuses of
    # them, and how many at the end of what it holds the request may drop and still go on
    # from it.
    shared: int = 0
    may_drop: int = 0

    @property
    def goes_on(self) -> bool:
        """The request goes on from what the slot holds (nothing worth a file is lost)."""
        return self.shared > 0 and self.held_depth - self.shared <= self.may_drop


@dataclass(frozen=True)
class Plan:
    move: Move
    save: bool  # save what the slot holds first
    leave_opening: bool  # leave its opening on disk (and in the slot) before it changes hands
    admit: bool  # admit the request's tenant to the slot

    @property
    def acts_on_slot(self) -> bool:
        """Slot actions follow: the slot must be idle and verified first."""
        return self.move is Move.RESTORE or self.save or self.leave_opening


def decide(facts: Facts) -> Plan:
    move = choose(facts.resident, facts.stored, facts.restores_allowed)
    if move is Move.START_COLD and facts.stem and facts.restores_allowed:
        move = Move.RESTORE
    save = facts.worth_saving and not facts.goes_on
    if move is Move.USE_RESIDENT:
        # A new session or a branch that parts from the slot's conversation replaces what
        # the slot holds past the part they share: that conversation is saved first (it
        # would be lost), and the opening they share is left on disk and in the slot.
        branch = facts.resident < facts.held_depth
        return Plan(
            move,
            save=branch and save,
            leave_opening=branch and facts.held_opening,
            admit=False,
        )
    return Plan(move, save=save, leave_opening=facts.held_opening, admit=True)
