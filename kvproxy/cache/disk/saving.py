"""Saves under way, by the key of the state being saved.

Another request took a conversation's slot and saves the conversation's state first; the
conversation's own next turn, on another slot, must find that state on disk, not an older
one (or only its opening): it waits for the save before it looks. A save whose commit goes
on in the background (the request that vacated the slot waited only for the server's write,
cache/slotio/slotwork.py) stays under way until that commit ends: the state is in the index only
then, so a returning turn that restores it waits for the commit, never restores a file whose
checksum is not yet known or that a crash could still take back.

Openings being made are kept the same way, apart (`Openings.making`): sessions of one agent
that start at once share a system prompt no slot holds yet; the first evaluates and saves
it, the others wait for that and restore it rather than evaluate it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

# How long a turn waits for its own state's save under way on another slot.
SAVE_WAIT_LIMIT = 30.0


class SavesUnderWay:
    def __init__(self) -> None:
        self._saving: dict[str, asyncio.Future[None]] = {}
        self._committing: dict[str, set[asyncio.Future[Any]]] = {}

    @contextlib.contextmanager
    def saving(self, key: str | None) -> Iterator[None]:
        if key is None or key in self._saving:
            yield
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._saving[key] = done
        try:
            yield
        finally:
            del self._saving[key]
            done.set_result(None)

    def committing(self, key: str, commit: asyncio.Future[Any]) -> None:
        """`key`'s state is written; it stays under way until `commit` (in the background)
        ends."""
        pending = self._committing.setdefault(key, set())
        pending.add(commit)

        def ended(_: asyncio.Future[Any]) -> None:
            pending.discard(commit)
            if not pending and self._committing.get(key) is pending:
                del self._committing[key]

        commit.add_done_callback(ended)

    def busy(self, key: str) -> bool:
        return key in self._saving or key in self._committing

    async def done(self, keys: list[str]) -> None:
        """Until no save or commit of `keys` is under way (at most SAVE_WAIT_LIMIT seconds):
        a save that ends while waited for may leave its commit under way, waited for too."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SAVE_WAIT_LIMIT
        while True:
            pending: list[asyncio.Future[Any]] = []
            for k in keys:
                if k in self._saving:
                    pending.append(self._saving[k])
                pending.extend(self._committing.get(k, ()))
            left = deadline - loop.time()
            if not pending or left <= 0:
                return
            await asyncio.wait([asyncio.shield(f) for f in pending], timeout=left)
