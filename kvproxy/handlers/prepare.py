"""Getting a keyed request's state into its slot before it is forwarded: the facts gathered,
the plan decided (plan.py, on plain data), the plan carried out.

In order: what the slot holds is verified when it is not trusted (at most one GET /slots per
request before it is forwarded); the store is asked once (`Openings.find`), and the same
answer shows which boundaries are openings; the plan is decided (a restore only when reading
the state costs less than prefilling what it gives back: cache/decisions/payoff.py); the slot is
vacated (save, opening, admit: the one sequence every plan but "resident" runs); then the state
comes back (restored from disk) or the request starts cold, passing through a wanted opening
first.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvproxy import readable
from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.payoff import RestoreChoice, RestoreCost, choose_restore, tokens_back
from kvproxy.cache.decisions.policy import Decision, Move, expected_resident
from kvproxy.cache.decisions.slotchoice import Serves
from kvproxy.cache.habits.learning import HabitLearning
from kvproxy.cache.prefixes.openings import Openings
from kvproxy.cache.prefixes.reuse import NOTHING_FOUND, Found, Reuse
from kvproxy.cache.prefixes.stems import Stems
from kvproxy.cache.reports.events import Count
from kvproxy.cache.reports.labels import own_state
from kvproxy.cache.scheduling.savegate import SaveGate
from kvproxy.cache.servers.loras import before_restore
from kvproxy.cache.servers.slots import Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.handlers.plan import Facts, Plan, decide
from kvproxy.handlers.prepared import MISS, Prepared, next_turn_of
from kvproxy.http.session import UpstreamError
from kvproxy.wire import Conversation

log = logging.getLogger("kvproxy.cache")

# How long what GET /slots showed after our own last use is trusted for a "resident" claim
# while no other slot got work (see SlotPool.still_as_seen). A wrong claim costs one slower
# request, never a wrong answer (the server compares tokens); checking costs a round trip on
# every request. Slot actions always check first.
SNAPSHOT_TRUST = 1.0
# Entries tried for one request when the server refuses them (another KV layout saved them).
RESTORE_TRIES = 3


class Preparer:
    def __init__(
        self,
        ctx: CacheContext,
        work: SlotWork,
        reuse: Reuse,
        openings: Openings,
        learner: HabitLearning,
        gate: SaveGate,
    ) -> None:
        self.ctx = ctx
        self.backend = ctx.backend
        self.pool = ctx.backend.pool
        self.work = work
        self.reuse = reuse  # what the server reuses of a slot or a stored state
        self.openings = openings
        self.stems: Stems = reuse.stems
        self.learner = learner
        self.gate = gate  # one save at a time on the server, when it pauses nobody

    async def prepare_or_miss(self, slot: Slot, conv: Conversation) -> Prepared:
        try:
            return await self.prepare(slot, conv)
        except UpstreamError as exc:
            # The cache could not do its part; the request still goes through, uncached, once
            # the slot holds nothing of another tenant's (else the UpstreamError is the answer).
            log.warning("cache preparation failed on slot %d: %s", slot.id, exc)
            slot.forget()
            await self.work.admit(slot, conv.tenant)
            return MISS

    def serves(self, conv: Conversation) -> Serves[Slot]:
        """How deep a slot serves `conv`: what the server will reuse of what it holds (a
        state restored from disk cannot be cut back on every model class)."""
        return lambda slot: self.reuse.resident_depth(slot, conv)

    def at_once(self, slot: Slot, conv: Conversation) -> Prepared | None:
        """The steady state of an agent loop, decided with no I/O (and so with no task): the
        slot, trusted as last seen, holds everything the request goes on from, and the
        request adds a turn. None: `prepare_or_miss` decides (it may ask the index and the
        server). The same decision `prepare` takes in that case, in the same order of
        effects: what the slot holds is learnt from, no index query, the resident plan."""
        if slot.holding is None or not self.pool.still_as_seen(slot, SNAPSHOT_TRUST):
            return None
        resident = self.reuse.resident_depth(slot, conv)
        if not next_turn_of(slot, conv, resident):
            return None
        plan = decide(self._facts_but_opening(slot, conv, NOTHING_FOUND, resident))
        if plan.move is not Move.USE_RESIDENT or plan.acts_on_slot or plan.admit:
            return None
        self.learner.from_slot(slot, conv)
        return self._resident(slot, conv, plan, resident)

    async def prepare(self, slot: Slot, conv: Conversation) -> Prepared:
        """Get the conversation's state into the slot (ours), as far as kvproxy can."""
        learnt = self.learner.from_slot(slot, conv)
        verified = slot.holding is not None and not self.pool.still_as_seen(slot, SNAPSHOT_TRUST)
        if verified:
            await self.work.verify(slot)
        found = await self._find(slot, conv, observe=not learnt)
        plan = decide(await self._facts(slot, conv, found))
        if plan.move is Move.RESTORE and not self._pays(slot, conv, found):
            found = replace(found, best=None, stem=False)
            plan = decide(await self._facts(slot, conv, found))
        if plan.acts_on_slot and not verified:
            await self.work.verify(slot)  # the slot must be idle, and hold what we think
            verified = True
            plan = decide(await self._facts(slot, conv, found))
        await self._vacate(slot, conv, plan)
        if plan.move is Move.RESTORE:
            return await self._restore(slot, conv, found, verified)
        if plan.move is Move.USE_RESIDENT:
            return self._resident(slot, conv, plan, self.reuse.resident_depth(slot, conv))
        return await self._start_cold(slot, conv, verified)

    def _pays(self, slot: Slot, conv: Conversation, found: Found) -> bool:
        """Whether reading the entry found costs less than prefilling what it gives back, at
        this server's measured rates (cache/decisions/payoff.py); logged, and counted when it
        does not."""
        assert found.best is not None
        entry, shared = found.best
        depth = len(entry.chain)
        per_token_ms = self.ctx.events.rates.ms_per_token(self.backend.name)
        cost = RestoreCost(
            entry.state_bytes,
            # A stem is extended exactly by the request, which shares no whole message of it.
            tokens_back(
                entry.n_tokens, depth if found.stem else shared, depth, conv.messages, conv.template
            ),
            self.gate.pace.read_bytes_per_s,
            1000 / per_token_ms if per_token_ms else None,
        )
        choice = choose_restore(cost)
        read_s, prefill_s = cost.read_s, cost.prefill_s
        line = "slot %d: %s of %s (%s, %d tokens back): read ~%s, prefill ~%s"
        args = (
            slot.id,
            "prefilling instead of a restore" if choice is RestoreChoice.PREFILL else "restore",
            entry.key[:12],
            readable.size(entry.state_bytes),
            cost.tokens_back,
            readable.duration(read_s) if read_s is not None else "not measured",
            readable.duration(prefill_s) if prefill_s is not None else "not measured",
        )
        if choice is RestoreChoice.PREFILL:
            log.info(line, *args)
            self.ctx.events.count(Count.PREFILL_OVER_RESTORE)
            return False
        log.debug(line, *args)
        return True

    async def _find(self, slot: Slot, conv: Conversation, observe: bool) -> Found:
        resident = self.reuse.resident_depth(slot, conv)
        # The next turn of what the slot holds (the steady state of every agent loop): no
        # stored entry could serve more, nor show a new opening. No index query then.
        if next_turn_of(slot, conv, resident):
            return NOTHING_FOUND
        found = await self.reuse.find(conv) if self.backend.disk_enabled else NOTHING_FOUND
        if observe and conv.messages:
            # A rewrite is a habit of the client, not a branch whose opening is worth keeping.
            self.openings.observe(conv, self.pool, found.longest)
        return found

    async def _facts(self, slot: Slot, conv: Conversation, found: Found) -> Facts:
        resident = self.reuse.resident_depth(slot, conv)
        facts = self._facts_but_opening(slot, conv, found, resident)
        held = slot.holding
        if held is None or (
            resident == facts.held_depth and decide(facts).move is Move.USE_RESIDENT
        ):
            return facts  # nothing the request does not extend: no opening to leave
        return replace(facts, held_opening=bool(await self.openings.wanted(held)))

    def _facts_but_opening(
        self, slot: Slot, conv: Conversation, found: Found, resident: int
    ) -> Facts:
        """The facts with no I/O: whether the slot's conversation passes through a wanted
        opening (an index query) is left False."""
        held = slot.holding
        held_depth = len(held.chain) if held is not None else 0
        return Facts(
            resident=resident,
            held_depth=held_depth,
            stored=found.best[1] if found.best is not None else None,
            restores_allowed=found.best is None or self.reuse.restorable(found.best[0]),
            worth_saving=self.work.worth_saving(slot),
            held_opening=False,
            stem=found.stem,
            shared=slot.shared_depth(conv.keys, conv.namespace),
            may_drop=conv.tail.of(held_depth),
        )

    async def _vacate(self, slot: Slot, conv: Conversation, plan: Plan) -> None:
        """Before the slot changes hands: what it holds is saved if it would be lost, its
        opening is left on disk (both in a moment when they pause no other slot's stream,
        cache/scheduling/savegate.py), and the request's tenant is admitted."""
        if plan.save or plan.leave_opening:
            async with self.gate.turn(slot):
                if plan.save:
                    # The request waits for the write only; the commit follows
                    # (cache/disk/commits.py).
                    await self.work.save(slot, commit_later=True)
                if plan.leave_opening:
                    await self.openings.before_reassign(slot, conv)
        if plan.admit:
            await self.work.admit(slot, conv.tenant)

    async def _restore(
        self, slot: Slot, conv: Conversation, found: Found, verified: bool
    ) -> Prepared:
        for _ in range(RESTORE_TRIES):
            if not self.backend.disk_enabled:
                return MISS  # the server was found started again: nothing restored before
            assert found.best is not None
            entry, shared = found.best
            await before_restore(self.work.client, slot, conv)
            outcome = await self.work.restore(slot, entry)
            if outcome is not None:
                break
            # Refused (kept for the layout that saved it: cache/disk/refused.py) or dropped: the
            # slot is empty now, and the next best entry may be one this server takes.
            found = await self.reuse.find(conv)
            if found.best is None or found.stem:
                return MISS
        else:
            return MISS
        if not self.ctx.habits.echo.known(conv.namespace):
            self.ctx.background.spawn(self.learner.from_disk(entry, shared, conv))
        # A new session restored from a shorter opening than the one it shares (seen since):
        # that one is saved on the way, for the sessions after it.
        evaluated = await self._prefill(slot, conv, shared, verified)
        # A request that parts from the entry before its end (a near-end divergence, or any
        # prefix on a dense model) reuses an unknown part of it: not judged.
        expected = outcome.n_restored if shared >= len(entry.chain) or found.stem else None
        return Prepared(
            Decision.RESTORED,
            outcome.n_restored,
            outcome.ms,
            expected_n=expected,
            evaluated=evaluated,
            restored_from=(entry.key, self.reuse.older(entry)),
        )

    def _resident(self, slot: Slot, conv: Conversation, plan: Plan, resident: int) -> Prepared:
        held = slot.holding
        if plan.leave_opening and resident == 0:
            return MISS  # the slot could not be cut back to what the request shares
        if not own_state(conv.messages, resident, len(held.chain) if held is not None else 0):
            return MISS  # only an opening it shares with the slot's: cache_n shows the reuse
        expected = (
            None if held is None else expected_resident(resident, len(held.chain), held.n_tokens)
        )
        return Prepared(Decision.RESIDENT, expected_n=expected)

    async def _start_cold(self, slot: Slot, conv: Conversation, verified: bool) -> Prepared:
        evaluated = 0
        stem = await self.stems.wanted(conv)
        if stem is not None:
            # The head of its system message before what changes between sessions, first.
            if not verified:
                await self.work.verify(slot)
                verified = True
            evaluated = await self.stems.make(slot, conv, *stem)
            depth = await self.openings.prefill_depth(conv)
        else:
            depth = await self.openings.prefill_depth(conv)
            if depth and self.openings.making.busy(conv.keys[depth - 1]):
                made = await self._made_meanwhile(slot, conv, conv.keys[depth - 1], verified)
                if made is not None:
                    return made
                depth = await self.openings.prefill_depth(conv)
        # No await between the check above and the claim in _prefill: of the sessions that
        # start at once, exactly one evaluates the opening.
        evaluated += await self._prefill(slot, conv, 0, verified, depth)
        return Prepared(Decision.MISS, evaluated=evaluated) if evaluated else MISS

    async def _made_meanwhile(
        self, slot: Slot, conv: Conversation, opening: str, verified: bool
    ) -> Prepared | None:
        """Another request is evaluating the opening this one passes through (sessions of one
        agent starting at once): once it is saved, restore it here rather than evaluate it
        again. None: it was not made; the request starts cold as it would have."""
        await self.openings.making.done([opening])
        found = await self.reuse.find(conv)
        plan = decide(await self._facts(slot, conv, found))
        if plan.move is not Move.RESTORE:
            return None
        if not verified:
            await self.work.verify(slot)
            verified = True
        await self._vacate(slot, conv, plan)
        return await self._restore(slot, conv, found, verified)

    async def _prefill(
        self, slot: Slot, conv: Conversation, start: int, verified: bool, depth: int | None = None
    ) -> int:
        """Pass through a wanted opening deeper than `start` first (at `depth`, when known):
        the tokens evaluated."""
        if depth is None:
            depth = await self.openings.prefill_depth(conv, start)
        if depth == 0:
            return 0
        with self.openings.making.saving(conv.keys[depth - 1]):
            if not verified:
                await self.work.verify(slot)  # slot actions follow: the slot must be idle
            return await self.openings.prefill(slot, conv, depth, start)
