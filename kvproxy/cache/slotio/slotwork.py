"""The I/O a slot goes through: verify it, save it (canonical prefix first), restore into it.

Every method here needs the slot to be ours (taken from the pool, so nothing else touches
it): the server defers slot actions sent to a busy slot, and a deferred action can hang
later completions. What the slot holds changes only through cache/servers/slots.py's methods.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvproxy import keys
from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.policy import worth_saving
from kvproxy.cache.disk.commits import Commits, Written, known_tokens
from kvproxy.cache.disk.disktrouble import DiskTrouble
from kvproxy.cache.disk.refused import kept_for_its_layout
from kvproxy.cache.disk.saving import SavesUnderWay
from kvproxy.cache.reports.events import Count, SlotActionEvent
from kvproxy.cache.servers.slots import NOBODY, Holding, Slot
from kvproxy.cache.slotio.clearing import clear_slot
from kvproxy.http.session import UpstreamError
from kvproxy.server.api import Restored
from kvproxy.store import Entry
from kvproxy.store.entry import SHARED, TURN

log = logging.getLogger("kvproxy.cache")

# How long a slot kvproxy is about to act on may stay busy with work it did not send (a
# cancelled request winding down) before kvproxy gives up on it.
BUSY_WAIT_LIMIT = 120.0


@dataclass(frozen=True)
class RestoreOutcome:
    n_restored: int
    ms: float


class SlotWork:
    def __init__(self, ctx: CacheContext) -> None:
        self.backend = ctx.backend
        self.client = ctx.backend.client
        self.store = ctx.store
        self.settings = ctx.settings
        self.events = ctx.events
        self.habits = ctx.habits
        self.guard = ctx.guard
        self.background = ctx.background
        self.trouble = DiskTrouble(ctx.backend, ctx.settings.cache_dir)
        self.heads = canonical.Heads()  # what the last canonical prefixes tokenised
        self.under_way = SavesUnderWay()
        self.commits = Commits(ctx, self.trouble, self.under_way)

    def worth_saving(self, slot: Slot) -> bool:
        """Is the slot's content not on disk, and worth a file? (policy.worth_saving)"""
        held = slot.view()
        return worth_saving(
            held,
            disk_enabled=self.backend.disk_enabled,
            # Read under the server's current fingerprint (cache/servers/loras.py), and ever reused.
            restores_allowed=held is None
            or (
                self.backend.loras.current(held.namespace)
                and self.guard.allows_saves(self.backend.life, held.namespace)
            ),
            min_tokens=self.settings.min_tokens,
        )

    async def save_if_worth(
        self,
        slot: Slot,
        background: bool = False,
        give_way: Callable[[], bool] | None = None,
        commit_later: bool = False,
    ) -> bool:
        """`save` the slot (ours, verified) when what it holds is worth a file and not on
        disk yet: True when it was saved."""
        return self.worth_saving(slot) and await self.save(slot, background, give_way, commit_later)

    async def saves_done(self, keys: list[str]) -> None:
        """Until no save or commit of `keys` is under way: a returning turn waits for its own
        state, as long as prefilling it instead would take (cache/disk/saving.py)."""
        await self.under_way.done(keys, self.events.rates.ms_per_token(self.backend.name))

    # --- knowing what the slot holds

    async def verify(self, slot: Slot) -> None:
        """Trust the slot only if the server still shows what our last use left there."""
        deadline = time.monotonic() + BUSY_WAIT_LIMIT
        while True:
            info = await self.client.slot(slot.id)
            if not info.is_processing:
                break
            # A cancelled request may still be winding down; a slot action now would be
            # deferred by the server, which can hang later requests.
            if time.monotonic() > deadline:
                raise UpstreamError(f"slot {slot.id} still busy after {BUSY_WAIT_LIMIT:.0f} s")
            await asyncio.sleep(0.02)
        pending = slot.pending is not None
        if slot.holding is not None and not slot.shows_ours(info):
            log.info(
                "slot %d changed behind kvproxy's back (%s -> %s): forgetting %s",
                slot.id,
                slot.snapshot,
                info.snapshot,
                slot.holding.key[:12],
            )
            self.events.count(Count.SLOT_RESET)
            slot.forget()
        if slot.shows_restart(info):
            await self.backend.restarted_unseen(f"slot {slot.id} shows an older task")
        slot.observe(info, count_tokens=pending)

    async def write_through(self, slot: Slot) -> None:
        """--write-through, after a reply: what the server shows (the holding's true size),
        then the save, the slot held until it is done. Runs detached (nobody else would see
        a failure): logged, the slot forgotten."""
        try:
            slot.observe(await self.client.slot(slot.id), count_tokens=True)
            await self.save_if_worth(slot)
        except Exception as exc:
            log.warning("after the reply on slot %d: %s", slot.id, exc)
            slot.forget()

    async def snapshot_later(self, slot: Slot, taken: int) -> None:
        """What the server shows of a slot already given back after a reply (`ours_ended`), so a
        client's next turn does not wait for it: its answer counts only if nobody took the
        slot meanwhile (then that use's own snapshot, or `verify`, settles it). `taken`: the
        slot's count when the use ended."""
        try:
            info = await self.client.slot(slot.id)
        except UpstreamError as exc:
            log.debug("GET /slots after the reply on slot %d: %s", slot.id, exc)
            return
        if slot.taken == taken and not slot.busy and not info.is_processing:
            slot.observe(info, count_tokens=True)

    # --- saving

    async def save(
        self,
        slot: Slot,
        background: bool = False,
        give_way: Callable[[], bool] | None = None,
        commit_later: bool = False,
        kind: str = TURN,
    ) -> bool:
        """Save what the slot holds under its key. The slot must be ours and verified.
        `background`: no request waits for it (counted apart); it stops before each of its
        steps on the server when its conversation's turn claims the slot, or when `give_way`
        says so (another slot's request came: cache/scheduling/background_saves.py).

        `commit_later`: return once the server's `action=save` answered (the state is in the
        page cache, the slot may be given away); the commit (rename, checksum, fsync, index
        row: `Store.commit_async`, on threads) follows in the background. Until it ends the
        key stays under way (cache/disk/saving.py), so the conversation's next turn waits for
        the commit before it looks the state up: it never restores an uncommitted file. A crash
        before the commit leaves only the temp file, swept at the next start. Without it the
        commit ends before this returns (a shutdown, an opening others wait for).

        `kind`: a conversation's TURN, or a start SHARED with other sessions (an opening, a
        stem): cache/disk/lineage.py supersedes only turns."""
        held = slot.holding
        key = held.key if held is not None else None
        with self.under_way.saving(key, known_tokens(held.n_tokens) if held is not None else None):
            return await self._save(slot, background, give_way, commit_later, kind)

    async def _save(
        self,
        slot: Slot,
        background: bool,
        give_way: Callable[[], bool] | None,
        commit_later: bool,
        kind: str,
    ) -> bool:

        def stop() -> bool:
            return background and (slot.claimed or (give_way is not None and give_way()))

        begun = time.perf_counter()
        holding = slot.holding
        if holding is not None and not holding.canonical and holding.messages and not stop():
            await self._make_canonical(slot)
        canonical_ms = (time.perf_counter() - begun) * 1000
        holding = slot.holding
        if holding is None:
            return False
        if stop():
            log.debug("slot %d: background save gives way to a request", slot.id)
            return False
        if not await self.commits.room_for(slot, holding):
            return False
        temp = self.store.temp_name(holding.key)
        started = time.perf_counter()
        try:
            with slot.acting("saving"):
                saved = await self.client.save(slot.id, temp)
        except UpstreamError as exc:
            await self.commits.failed(started, temp, exc if exc.status != 501 else None)
            if exc.status == 501:
                self.trouble.no_slot_actions()
            return False
        except (OSError, ValueError, KeyError, TypeError) as exc:  # a reply of another shape
            await self.commits.failed(started, temp, exc)
            return False
        if saved.n_saved == 0:
            # Wiped since we last looked (a unified KV cache clears idle slots when another
            # starts): an empty state would be restored as the conversation's.
            await self.commits.failed(started, temp)
            log.info("slot %d was empty when saved: forgetting %s", slot.id, holding.key[:12])
            self.events.count(Count.SLOT_RESET)
            slot.forget()
            return False
        now = time.time()
        entry = Entry(
            key=holding.key,
            namespace=holding.namespace,
            n_tokens=saved.n_saved,
            state_bytes=0,
            n_messages=holding.n_messages,
            created=now,
            last_used=now,
            chain=list(holding.chain),
            messages=list(holding.messages),
            model=self.backend.model_name,
            kind=kind,
        )
        written = Written(slot, holding, entry, temp, started, canonical_ms, background)
        if not commit_later:
            return await self.commits.commit(written)
        return await self.commits.later(written)

    async def _make_canonical(self, slot: Slot) -> None:
        """Make the slot hold exactly the prefix the conversation's next request starts with
        (see canonical/prefix.py), so the saved state is reused on every model class. Best effort:
        when it cannot be done the slot is saved as it is."""
        holding = slot.holding
        assert holding is not None
        started = time.perf_counter()
        ns = holding.namespace
        # As the client will send it next (habits.py): a client that rewrites earlier
        # messages gets a state its next request extends exactly.
        messages = self.habits.next_messages(ns, holding.messages)
        try:
            tokens = await canonical.prefix_tokens(
                self.client, holding.template, messages, self.habits.echo.get(ns), self.heads
            )
        except (UpstreamError, ValueError) as exc:
            log.debug("no canonical prefix for %s: %s", holding.key[:12], exc)
            return
        if not tokens:
            return
        timings = await self._evaluate(slot, tokens, "canonical prefix", ns)
        if timings is None:
            return
        rewritten = None
        if messages != holding.messages:
            chain = keys.chain(ns, messages)
            rewritten = Holding(ns, chain, len(tokens), len(messages), messages, holding.template)
        slot.evaluated(len(tokens), rewritten)
        slot.mark_canonical()
        log.debug(
            "slot %d: canonical prefix of %s is %d tokens (%s evaluated) in %.0f ms",
            slot.id,
            holding.key[:12],
            len(tokens),
            timings.get("prompt_n", "?"),
            (time.perf_counter() - started) * 1000,
        )

    async def save_cut(
        self, slot: Slot, tokens: list[int], holding: Holding, what: str
    ) -> int | None:
        """Make the slot hold exactly `tokens` (kvproxy's own evaluation, `n_predict: 0`), the
        state of `holding`, and save it as an entry of its own (an opening, a stem). The
        tokens the server evaluated for it, or None when it was not saved."""
        started = time.perf_counter()
        timings = await self._evaluate(slot, tokens, what, holding.namespace)
        if timings is None:
            return None
        slot.evaluated(len(tokens), holding)
        saved = await self.save(slot, kind=SHARED)
        log.info(
            "slot %d: %s %s (%d tokens) %s in %.0f ms",
            slot.id,
            what,
            holding.key[:12],
            len(tokens),
            "saved" if saved else "not saved",
            (time.perf_counter() - started) * 1000,
        )
        evaluated = timings.get("prompt_n")
        if not saved:
            return None
        return evaluated if isinstance(evaluated, int) and evaluated > 0 else 0

    async def _evaluate(
        self, slot: Slot, tokens: list[int], what: str, namespace: str
    ) -> dict[str, object] | None:
        """kvproxy's own evaluation, with the namespace's adapter scales (not done when they
        are not known: cache/servers/loras.py); its timings (a cold prefill) price cached tokens."""
        known, lora = self.backend.loras.body(namespace, len(self.backend.identity.lora_defaults))
        if not known:
            return None
        slot.mark_started()
        try:
            timings = await self.client.evaluate(slot.id, tokens, lora)
        except UpstreamError as exc:
            log.warning("evaluating the %s on slot %d failed: %s", what, slot.id, exc)
            slot.forget()  # kvproxy's own evaluation did not end: the slot holds part of it
            await self.verify(slot)
            return None
        self.events.prefilled(self.backend.name, timings)
        return timings

    async def _drop(self, entry: Entry) -> None:
        """Removes an entry found unusable; on a full disk its row stays (it is checked again,
        and dropped again, the next time it is found)."""
        try:
            await self.store.remove_async(entry)
        except OSError as exc:
            self.trouble.error(f"dropping cache entry {entry.key[:12]} failed: {exc}")

    # --- restoring

    async def restore(self, slot: Slot, entry: Entry) -> RestoreOutcome | None:
        """Load `entry` into the slot; None when it fails (the entry dropped, or kept when
        the server refused it for its layout: cache/disk/refused.py)."""
        self.store.pin(entry.key)
        try:
            problem = await asyncio.to_thread(self.store.files.check_state_file, entry)
            if problem is not None:
                log.warning("dropping cache entry %s: %s", entry.key[:12], problem)
                await self._drop(entry)
                return None
            started = time.perf_counter()
            # Hashing reads the file while the server reads it too: the check costs no time
            # unless it is slower than the restore, and nothing is forwarded before it passed.
            checked = asyncio.ensure_future(
                asyncio.to_thread(self.store.files.verify_checksum, entry)
            )
            # Retrieved whatever happens: a restore that fails leaves the check unawaited.
            checked.add_done_callback(lambda f: f.cancelled() or f.exception())
            try:
                with slot.acting("restoring"):
                    restored: Restored = await self.client.restore(
                        slot.id, self.store.state_name(entry.key)
                    )
                damaged = await asyncio.shield(checked)
            except UpstreamError as exc:
                slot.forget()  # a failed restore erases the slot on the server
                seconds = time.perf_counter() - started
                self.events.slot_action(SlotActionEvent("restore", False, seconds=seconds))
                if exc.status == 400:
                    damaged = await asyncio.shield(checked)
                    if not kept_for_its_layout(entry, damaged, exc, self.guard, self.backend.life):
                        await self._drop(entry)
                    return None
                raise
            if damaged is not None:
                # The slot holds a state that is not the one saved: it must serve nothing. (An
                # erase that fails means the server is gone, and so is the request.)
                await self.client.erase(slot.id)
                slot.forget()
                log.warning("dropping cache entry %s: %s", entry.key[:12], damaged)
                await self._drop(entry)
                return None
            seconds = time.perf_counter() - started
            n = restored.n_restored
            chain = list(entry.chain)
            held = Holding(entry.namespace, chain, n, entry.n_messages, restored_depth=len(chain))
            slot.restored(held)
            self.events.slot_action(SlotActionEvent("restore", True, n, entry.state_bytes, seconds))
            self.background.spawn(self.store.touch_async(entry.key))
            return RestoreOutcome(n, seconds * 1000)
        finally:
            self.store.unpin(entry.key)

    async def admit(self, slot: Slot, tenant: str | None) -> None:
        """Before `tenant`'s request runs on the slot (whatever was worth keeping is saved by
        now): if it may hold another tenant's tokens, clear it (clearing.py). Raises
        UpstreamError when that fails: the request must not go."""
        if slot.occupant not in (tenant, NOBODY):
            if not await clear_slot(self.client, slot, self.backend.slot_actions):
                self.trouble.no_slot_actions()
            slot.forget()
        slot.admit(tenant)

    # --- the budget

    async def evict(self) -> None:
        """TTL first, then the byte budget (cache/disk/commits.py)."""
        await self.commits.evict()
