"""The slot pool: who may touch each llama-server slot now, and the wait for one.

Every request the proxy forwards, and every save or restore, holds its slot exclusively:
the server defers slot actions sent to a busy slot, and a deferred action can leave later
completions hanging, so the proxy owns the order of everything that touches a slot. Which
slot a request gets is cache/decisions/slotchoice.py's, on plain data.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from kvproxy.cache.decisions.slotchoice import Serves, choose, finishing_best, home_of
from kvproxy.cache.servers.slots import Slot
from kvproxy.server.api import SlotInfo


class QueueFull(Exception):
    """Every slot is busy and the wait queue is full, or the wait timed out."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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
        # Whether a slot holds a conversation waiting for a tool's result
        # (cache/decisions/toolloops.py): a newcomer takes another slot when there is one.
        self.awaited: Callable[[Slot], bool] = lambda _slot: False

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
            slot.started_again()

    def seen_empty(self, infos: Sequence[SlotInfo]) -> None:
        """Idle slots GET /slots shows holding no tokens belong to no tenant. Only an explicit
        0 says so: the server leaves `n_prompt_tokens` out until a task has run on the slot
        (server-context.cpp `to_json`), and a restore before any task fills it unseen."""
        for info in infos:
            if 0 <= info.id < len(self.slots) and info.n_prompt_tokens == 0:
                slot = self.slots[info.id]
                if not slot.busy and not info.is_processing:
                    slot.seen_empty()

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
        serves: Serves[Slot] | None = None,
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
                if home.busy and (home.saving or home.prefetching):
                    home.claim()
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
                slot, depth = choose(self.idle(), keys or [], namespace, serves, self.awaited)
            slot.take(keys)
            slot.mark_started()
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
        slot.give_back(used)
        if self.waiting:  # else nobody waits on the condition: no task to wake them
            task = asyncio.get_running_loop().create_task(self._notify())
            self._notifying.add(task)
            task.add_done_callback(self._notifying.discard)
        if self.on_release is not None:
            self.on_release()

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()
