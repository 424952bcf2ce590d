"""Work that must finish although the request that started it is gone.

A client may hang up at any moment, cancelling its handler. Slot work already started
(a save, a restore, the bookkeeping after a reply) must still run to its end and only then
give the slots back, or what kvproxy knows about a slot would no longer be true.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from functools import partial
from typing import Any, TypeVar

from kvproxy.cache.reports.faults import Faults
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import Slot

_T = TypeVar("_T")


class Background:
    """Detached tasks, kept referenced until done and awaited at shutdown. Their owner: what
    one raises is reported to `faults` under its kind (the coroutine's name), never left to
    asyncio's "Task exception was never retrieved"."""

    def __init__(self, faults: Faults | None = None) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()
        self.faults = faults if faults is not None else Faults()

    def spawn(self, coro: Coroutine[Any, Any, Any], kind: str | None = None) -> None:
        self.track(asyncio.ensure_future(coro), kind or _kind_of(coro))

    def track(self, task: asyncio.Future[Any], kind: str | None = None) -> None:
        if kind is None:
            coro = task.get_coro() if isinstance(task, asyncio.Task) else None
            kind = _kind_of(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(partial(self._settled, kind))

    def _settled(self, kind: str, task: asyncio.Future[Any]) -> None:
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: asyncio will not complain of it
        if exc is None:
            self.faults.succeeded(kind)
        else:
            self.faults.failed(kind, exc)

    def __len__(self) -> int:
        return len(self._tasks)

    async def wait(self, timeout: float | None = None) -> bool:
        """Until every task is done, or `timeout` seconds passed: the tasks go on then (a
        wait_for around a gather would cancel them, and with them what kvproxy knows of the
        slots they hold). True when all are done."""
        if not self._tasks:
            return True
        _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
        return not pending


def _kind_of(coro: object) -> str:
    name = getattr(coro, "__qualname__", None)
    return name if isinstance(name, str) else "background task"


class Lease:
    """The slots one request holds; released when the request ends, or when the slot work
    it handed off or was cancelled in ends, whichever is later."""

    def __init__(self, pool: SlotPool, slots: list[Slot], background: Background) -> None:
        self.pool = pool
        self.slots = slots
        self.background = background
        self.released = False

    async def guarded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._release_after(task)
            raise

    def hand_off(self, coro: Coroutine[Any, Any, Any]) -> None:
        """The reply is delivered; `coro`, kvproxy's own work after it, keeps the slots."""
        for slot in self.slots:
            slot.hand_off()
        self._release_after(asyncio.ensure_future(coro))

    def _release_after(self, task: asyncio.Future[Any]) -> None:
        if self.released:
            return
        self.released = True
        self.background.track(task)
        task.add_done_callback(lambda _t: self._free())

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._free()

    def _free(self) -> None:
        for slot in self.slots:
            self.pool.release(slot)
