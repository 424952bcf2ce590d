"""Saves under way, by the key of the state being saved.

Another request took a conversation's slot and saves the conversation's state first; the
conversation's own next turn, on another slot, must find that state on disk, not an older
one (or only its opening): it waits for the save before it looks.

Openings being made are kept the same way, apart (`Openings.making`): sessions of one agent
that start at once share a system prompt no slot holds yet; the first evaluates and saves
it, the others wait for that and restore it rather than evaluate it again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

# How long a turn waits for its own state's save under way on another slot.
SAVE_WAIT_LIMIT = 30.0


class SavesUnderWay:
    def __init__(self) -> None:
        self._saving: dict[str, asyncio.Future[None]] = {}

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

    def busy(self, key: str) -> bool:
        return key in self._saving

    async def done(self, keys: list[str]) -> None:
        pending = [self._saving[k] for k in keys if k in self._saving]
        if pending:
            await asyncio.wait([asyncio.shield(f) for f in pending], timeout=SAVE_WAIT_LIMIT)
