"""The slot pool: what each llama-server slot holds, and who may touch it now.

Every request the proxy forwards, and every save or restore, holds its slot exclusively:
the server defers slot actions sent to a busy slot, and a deferred action can leave later
completions hanging, so the proxy owns the order of everything that touches a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproxy.cache.policy import HeldView
from kvproxy.cache.slotchoice import Serves, choose, finishing_best, home_of
from kvproxy.keys import shared_chain
from kvproxy.server.api import SlotInfo


class QueueFull(Exception):
    """Every slot is busy and the wait queue is full, or the wait timed out."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class Holding:
    """A conversation as it sits in a slot."""

    namespace: str
    chain: list[str]  # prefix keys; chain[-1] is the key of everything the slot holds
    n_tokens: int
    n_messages: int
    messages: list[Any] = field(default_factory=list)  # as the client will echo them
    template: dict[str, Any] = field(default_factory=dict)  # request fields the template reads
    canonical: bool = False  # the slot holds exactly the next request's canonical prefix
    # Boundaries of `chain` that came from a restore (0: all computed on the slot). A restored
    # state cannot be cut back like a live one (policy.resident_serves).
    restored_depth: int = 0

    @property
    def key(self) -> str:
        return self.chain[-1]


# A slot's occupant when kvproxy cannot tell whose tokens it holds (a server that ran before
# this proxy started may hold any tenant's), and when the server showed it empty. Tenants are
# hashes (keys.tenant_of) or None.
ANYONE = "anyone"
NOBODY = "nobody"


@dataclass
class Slot:
    id: int
    holding: Holding | None = None
    saved: bool = True  # nothing in the slot that is not also on disk (or worth keeping)
    busy: bool = False
    last_used: float = 0.0
    changed_at: float = 0.0
    # (id_task, n_prompt_tokens) as GET /slots showed them right after our last use: if the
    # server shows anything else later, someone else used or wiped the slot.
    snapshot: tuple[Any, Any] | None = None
    seen_at: float = 0.0  # time.monotonic() when GET /slots last confirmed the snapshot
    # When kvproxy last gave the slot work: a server with idle-slot wiping may wipe every
    # other idle slot then.
    started_at: float = 0.0
    # The tenant whose tokens the server's slot may hold, whatever kvproxy knows of them
    # (`forget` keeps it): another tenant's request may only run there once it is erased.
    occupant: str | None = ANYONE
    # Taken for a background save (background_saves.py): soon idle, its content then on disk.
    saving: bool = False
    # Its own conversation's next turn waits for it during a background save: the save gives
    # way unless its state write is already sent (the turn finds its state resident anyway,
    # and every step of a save waits for the server's loop, behind other slots' prefills).
    claimed: bool = False
    # How many times the slot was taken: a GET /slots sent after our use counts only if the
    # slot was not taken again before it answered.
    taken: int = 0
    # Our last use ended and its GET /slots has not answered yet (see `ours_ended`): the
    # range of tokens the server should show (the prompt, up to the prompt and the reply).
    pending: tuple[int, int] | None = None
    # The newest task GET /slots showed since the server started (`forget` keeps it).
    last_task: int | None = None
    # "saving" or "restoring" while kvproxy's save or restore of the slot is under way.
    action: str | None = None
    # The keys of the conversation a request taking the slot is for, until it is given back.
    serving: list[str] | None = None
    # Its request's reply is delivered and kvproxy's own work after it (a GET /slots, a
    # --write-through save) holds the slot: the server alone would find it idle.
    finishing: bool = False

    def shared_depth(self, keys: Sequence[str], namespace: str) -> int:
        holding = self.holding
        if holding is None or holding.namespace != namespace:
            return 0
        return shared_chain(holding.chain, keys)

    def view(self) -> HeldView | None:
        """What the slot holds, for the policy."""
        h = self.holding
        return None if h is None else HeldView(h.namespace, h.chain, h.n_tokens, self.saved)

    def forget(self) -> None:
        self.holding = None
        self.saved = True
        self.snapshot = None
        self.pending = None

    def hold(self, holding: Holding | None, saved: bool) -> None:
        old = self.holding
        if (
            holding is not None
            and old is not None
            and old.restored_depth
            and not (holding.restored_depth)
        ):
            # The slot went on from a restored state: that part is still the restored one.
            if old.namespace == holding.namespace:
                kept = min(old.restored_depth, shared_chain(old.chain, holding.chain))
                holding.restored_depth = kept
        self.holding = holding
        self.saved = saved
        self.changed_at = time.monotonic()

    def mark_saved(self) -> None:
        self.saved = True

    def mark_canonical(self) -> None:
        """The slot now holds exactly its conversation's canonical prefix (canonical/prefix.py)."""
        if self.holding is not None:
            self.holding.canonical = True

    def take(self) -> None:
        self.busy = True
        self.taken += 1

    def ours_ended(self, prompt: int, generated: int) -> None:
        """Our request on the slot ended: trust what it left (as GET /slots right after it
        would) until that GET answers, sent without holding the slot."""
        self.seen_at = time.monotonic()
        self.pending = (prompt, prompt + generated)

    def shows_ours(self, info: SlotInfo) -> bool:
        """Does the server show the slot as our last use left it? Before the GET /slots after
        that use answered, the snapshot is not known: the slot must show a task other than
        the one last seen, and the tokens that use left."""
        if self.pending is None:
            return info.snapshot == self.snapshot
        low, high = self.pending
        n = info.n_prompt_tokens
        last_task = self.snapshot[0] if self.snapshot else None
        if n is None or not low <= n <= high:
            return False
        return last_task is None or info.id_task != last_task

    def shows_restart(self, info: SlotInfo) -> bool:
        """An older task than the newest one seen there (task ids only grow while a server
        runs), or none: the server started again since."""
        last, now = self.last_task, info.id_task
        return last is not None and (now is None or (isinstance(now, int) and now < last))

    def observe(self, info: SlotInfo, count_tokens: bool = False) -> None:
        """What GET /slots shows now is what our own last use left: later differences mean
        someone else used or wiped the slot. `count_tokens`: the holding's size is what the
        server reports (after our own request)."""
        self.snapshot = info.snapshot
        if isinstance(info.id_task, int) and info.id_task > (self.last_task or -1):
            self.last_task = info.id_task
        self.pending = None
        self.seen_at = time.monotonic()
        if count_tokens and self.holding is not None and info.n_prompt_tokens is not None:
            self.holding.n_tokens = info.n_prompt_tokens

    def evaluated(self, n_tokens: int) -> None:
        """kvproxy's own evaluation (`n_predict: 0`) of `n_tokens` on the slot ended: it holds
        them under a task kvproxy has not seen, as after a request of ours (`ours_ended`), so
        no GET /slots is needed on the request's path to trust it."""
        if self.holding is not None:
            self.holding.n_tokens = n_tokens
        self.ours_ended(n_tokens, 1)

    def restored(self, holding: Holding) -> None:
        """The slot now holds a restored state, also on disk. A restore leaves the slot's
        last task as it was; only the token count moves."""
        self.hold(holding, saved=True)
        if self.pending is not None:
            # The last task (kvproxy's own evaluation) is still not seen: a newer one than
            # the snapshot's, now showing the restored tokens.
            self.pending = (holding.n_tokens, holding.n_tokens)
            return
        prev_task = self.snapshot[0] if self.snapshot else None
        self.snapshot = (prev_task, holding.n_tokens if prev_task is not None else None)

    def admit(self, tenant: str | None) -> None:
        """The server's slot may hold `tenant`'s tokens from now on (see SlotWork.admit)."""
        self.occupant = tenant

    @contextlib.contextmanager
    def acting(self, action: str) -> Iterator[None]:
        """A save or restore of the slot is under way (the status page shows it)."""
        self.action = action
        try:
            yield
        finally:
            self.action = None

    def begin_background_save(self) -> None:
        """Taken for a background save: a request may wait for it rather than evict another."""
        self.saving = True

    def mark_started(self) -> None:
        """kvproxy gives the slot a task of its own (a server that wipes idle slots may wipe
        every other idle slot now)."""
        self.started_at = time.monotonic()


class SlotPool:
    def __init__(self, n_slots: int, max_queue: int, queue_timeout: float) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self._cond = asyncio.Condition()
        self.waiting = 0
        self._notifying: set[asyncio.Task[None]] = set()
        # Requests are numbered as they come. While a request waits for every slot, the ones
        # that came after it wait too: else a steady load always takes a slot first and the
        # wait for all of them never ends.
        self._arrivals = 0
        self._draining: list[int] = []  # numbers of the requests waiting for every slot
        # Called (on the loop) whenever a slot becomes idle: background saves look for work.
        self.on_release: Callable[[], None] | None = None

    def resize(self, n_slots: int) -> None:
        if n_slots != len(self.slots):
            self.slots = [Slot(i) for i in range(n_slots)]

    def still_as_seen(self, slot: Slot, within: float) -> bool:
        """Can what GET /slots last showed for `slot` be trusted without asking again? Only
        shortly after, and if no other slot was given work since (which can wipe it)."""
        if time.monotonic() - slot.seen_at >= within:
            return False
        return all(o.started_at <= slot.seen_at for o in self.slots if o is not slot)

    def forget_all(self) -> None:
        for slot in self.slots:
            slot.forget()

    def started_again(self) -> None:
        """The server was seen to start again: its task ids begin anew."""
        for slot in self.slots:
            slot.last_task = None

    def seen_empty(self, infos: Sequence[SlotInfo]) -> None:
        """Idle slots GET /slots shows holding no tokens belong to no tenant. Only an explicit
        0 says so: the server leaves `n_prompt_tokens` out until a task has run on the slot
        (server-context.cpp `to_json`), and a restore before any task fills it unseen."""
        for info in infos:
            if 0 <= info.id < len(self.slots) and info.n_prompt_tokens == 0:
                slot = self.slots[info.id]
                if not slot.busy and not info.is_processing:
                    slot.occupant = NOBODY

    def idle(self) -> list[Slot]:
        return [s for s in self.slots if not s.busy]

    def try_take(self, slot: Slot) -> bool:
        """Take an idle slot without waiting (background work); False when it is busy."""
        if slot.busy:
            return False
        slot.take()
        return True

    def holding_namespace(self, namespace: str) -> list[Slot]:
        """Slots whose conversation is of `namespace` (so never another tenant's)."""
        return [s for s in self.slots if s.holding is not None and s.holding.namespace == namespace]

    async def acquire(
        self,
        keys: list[str] | None = None,
        namespace: str = "",
        wanted: int | None = None,
        serves: Serves | None = None,
    ) -> tuple[Slot, int]:
        """Wait (bounded) for an idle slot and mark it busy. `wanted` asks for one slot id;
        `serves`, how deep a slot serves the conversation `keys` (see `choose`)."""

        if wanted is None and keys:
            # The slot holding this conversation may be busy only finishing its last reply
            # (the client already has it and sent the next turn): wait for that slot rather
            # than prefill elsewhere. Not for a slot that only shares an opening with it, nor
            # one another conversation's request took (its content is being replaced).
            home = home_of(self.slots, keys, namespace)
            if home is not None:
                wanted = home.id
                if home.busy and home.saving:
                    home.claimed = True
            else:
                soon = finishing_best(self.slots, keys, namespace, serves) or self._saved_soon()
                wanted = soon.id if soon is not None else None

        self._arrivals += 1
        arrival = self._arrivals

        def ready() -> bool:
            if self._draining and self._draining[0] < arrival:
                return False
            if wanted is not None:
                return not self.slots[wanted].busy
            return any(not s.busy for s in self.slots)

        async with self._cond:
            if not ready():
                if self.waiting >= self.max_queue:
                    raise QueueFull("all slots are busy and the queue is full", 1)
                self.waiting += 1
                try:
                    await asyncio.wait_for(self._cond.wait_for(ready), self.queue_timeout)
                except TimeoutError:
                    raise QueueFull(
                        f"no slot became free within {self.queue_timeout:g}s", 5
                    ) from None
                finally:
                    self.waiting -= 1
            if wanted is not None and not keys:
                slot, depth = self.slots[wanted], 0
            else:
                slot, depth = choose(self.idle(), keys or [], namespace, serves)
            slot.take()
            slot.mark_started()
            slot.serving = list(keys) if keys else None
            return slot, depth

    async def acquire_all(self) -> list[Slot]:
        """Every slot, for requests whose slot the server chooses itself: taken together once
        all are idle, before anything that came later (earlier requests go first)."""
        self._arrivals += 1
        arrival = self._arrivals

        def ready() -> bool:
            if self._draining and self._draining[0] != arrival:
                return False
            return not any(s.busy for s in self.slots)

        async with self._cond:
            if not ready():
                if self.waiting >= self.max_queue:
                    raise QueueFull("all slots are busy and the queue is full", 1)
                self.waiting += 1
                self._draining.append(arrival)
                try:
                    await asyncio.wait_for(self._cond.wait_for(ready), self.queue_timeout)
                except TimeoutError:
                    raise QueueFull(
                        f"not every slot became free within {self.queue_timeout:g}s", 5
                    ) from None
                finally:
                    self.waiting -= 1
                    self._draining.remove(arrival)
                    self._cond.notify_all()  # those that came later may go now
            for slot in self.slots:
                slot.take()
                slot.mark_started()
            return list(self.slots)

    def _saved_soon(self) -> Slot | None:
        """A slot busy only with a background save, when every idle slot holds what is not
        on disk: its save ends soon, and then giving it to a new request costs nothing, where
        an idle one would put a save on the request's path (and evict a more recent one)."""
        idle = self.idle()
        if not idle or any(s.holding is None or s.saved for s in idle):
            return None
        saving = [s for s in self.slots if s.busy and s.saving]
        return min(saving, key=lambda s: s.last_used) if saving else None

    def release(self, slot: Slot, used: bool = True) -> None:
        """Sync, so it is safe in `finally` blocks of cancelled tasks. `used=False`: background
        work, which must not make the slot look recently used (LRU order is a request's)."""
        slot.busy = False
        slot.saving = False
        slot.claimed = False
        slot.serving = None
        slot.finishing = False
        if used:
            slot.last_used = time.monotonic()
        if self.waiting:  # else nobody waits on the condition: no task to wake them
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notifying.add(task)
            task.add_done_callback(self._notifying.discard)
        if self.on_release is not None:
            self.on_release()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
