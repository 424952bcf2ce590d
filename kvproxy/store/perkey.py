"""`PerKey`: operations on the same keys run one at a time, in the order they were issued.

The `Store`'s file operations (commit, delete) go through it, so a later operation on a key
never overtakes an earlier one, and none is cut short by the cancellation of the request
that asked for it. Loop-owned: use it on the event loop only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from functools import partial
from typing import Any, TypeVar

T = TypeVar("T")


class PerKey:
    def __init__(self, orphaned: Callable[[BaseException], None] | None = None) -> None:
        self._last_op: dict[str, asyncio.Future[Any]] = {}  # per key, the latest operation
        # Told what an operation raised once its caller was gone (cancelled): the task is
        # still owned, never left to "Task exception was never retrieved".
        self.orphaned = orphaned

    def run(self, keys: Iterable[str], work: Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """Run `work()` once the operations issued earlier on `keys` are done. A task of its
        own that the caller's cancellation does not reach: a request whose client hung up
        neither lets a later operation on these keys overtake this one nor leaves the index
        behind the disk."""
        keys = list(keys)
        earlier = {self._last_op[k] for k in keys if k in self._last_op}
        task = asyncio.ensure_future(_after(earlier, work))
        for k in keys:
            self._last_op[k] = task
        shielded = asyncio.shield(task)
        task.add_done_callback(partial(self._done, keys, shielded=shielded))
        return shielded

    def _done(
        self, keys: list[str], task: asyncio.Future[Any], shielded: asyncio.Future[Any]
    ) -> None:
        for k in keys:
            if self._last_op.get(k) is task:
                del self._last_op[k]
        if task.cancelled():
            return
        exc = task.exception()  # retrieved: the caller, if still there, gets it too
        if exc is not None and shielded.cancelled() and self.orphaned is not None:
            self.orphaned(exc)


async def _after(earlier: set[asyncio.Future[Any]], work: Callable[[], Awaitable[T]]) -> T:
    if earlier:
        await asyncio.wait(earlier)
    return await work()
