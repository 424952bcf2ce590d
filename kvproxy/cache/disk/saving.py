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

from kvproxy.cache.decisions.payoff import SAVE_WAIT_FLOOR_S, save_wait_s


class SavesUnderWay:
    def __init__(self) -> None:
        self._saving: dict[str, asyncio.Future[None]] = {}
        self._committing: dict[str, set[asyncio.Future[Any]]] = {}
        self._tokens: dict[str, int] = {}  # the size of a state under way, when known

    @contextlib.contextmanager
    def saving(self, key: str | None, tokens: int | None = None) -> Iterator[None]:
        if key is None or key in self._saving:
            yield
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._saving[key] = done
        self._sized(key, tokens)
        try:
            yield
        finally:
            del self._saving[key]
            self._settled(key)
            done.set_result(None)

    def committing(self, key: str, commit: asyncio.Future[Any], tokens: int | None = None) -> None:
        """`key`'s state is written; it stays under way until `commit` (in the background)
        ends."""
        pending = self._committing.setdefault(key, set())
        pending.add(commit)
        self._sized(key, tokens)

        def ended(_: asyncio.Future[Any]) -> None:
            pending.discard(commit)
            if not pending and self._committing.get(key) is pending:
                del self._committing[key]
            self._settled(key)

        commit.add_done_callback(ended)

    def _sized(self, key: str, tokens: int | None) -> None:
        if tokens:
            self._tokens[key] = tokens

    def _settled(self, key: str) -> None:
        if not self.busy(key):
            self._tokens.pop(key, None)

    def busy(self, key: str) -> bool:
        return key in self._saving or key in self._committing

    async def done(
        self,
        keys: list[str],
        prefill_ms_per_token: float | None = None,
        floor: float = SAVE_WAIT_FLOOR_S,
    ) -> None:
        """Until no save or commit of `keys` is under way, at most `floor` seconds or, at the
        server's measured `prefill_ms_per_token`, as long as the biggest of those states would
        take to prefill (`save_wait_s`): a save that ends while waited for may leave its
        commit under way, waited for too."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            pending: list[asyncio.Future[Any]] = []
            for k in keys:
                if k in self._saving:
                    pending.append(self._saving[k])
                pending.extend(self._committing.get(k, ()))
            tokens = max((self._tokens.get(k, 0) for k in keys), default=0)
            limit = save_wait_s(tokens, prefill_ms_per_token, floor)
            left = started + limit - loop.time()
            if not pending or left <= 0:
                return
            await asyncio.wait([asyncio.shield(f) for f in pending], timeout=left)
