"""Where the clients' habits (habits/__init__.py) are learnt from: the request that continues a
conversation kvproxy recorded, compared with the conversation its slot holds, else, off the
request path, with the stored one it shares most with (its text read from disk)."""

from __future__ import annotations

import asyncio

from kvproxy.cache.habits import Habits, worth_comparing
from kvproxy.cache.servers.backend import Backend
from kvproxy.cache.servers.leases import Background
from kvproxy.cache.servers.slots import Slot
from kvproxy.store import Entry, Store
from kvproxy.wire import Conversation


class HabitLearning:
    def __init__(
        self, habits: Habits, backend: Backend, store: Store, background: Background
    ) -> None:
        self.habits = habits
        self.backend = backend
        self.store = store
        self.background = background

    def from_slot(self, slot: Slot, conv: Conversation) -> bool:
        """Learn from the conversation the slot holds, else (in the background) from the
        stored one. True when the slot's conversation showed a rewrite."""
        if not conv.messages:
            return False  # a prompt: no messages to rewrite
        held = slot.holding
        if held is not None and held.messages and held.namespace == conv.namespace:
            shared = slot.shared_depth(conv.keys, conv.namespace)
            if shared >= len(held.messages) or worth_comparing(
                len(held.messages), len(conv.messages), shared
            ):
                return self.habits.learn(
                    conv.namespace, held.messages, conv.messages, shared, conv.tenant
                )
        if self.backend.disk_enabled:
            self.background.spawn(self._from_stored(conv))
        return False

    async def _from_stored(self, conv: Conversation) -> None:
        # Off the request path: one more index query, and maybe a read of stored text.
        stored = await self.store.lookup_async(conv.keys, conv.namespace)
        if stored is not None:
            entry, shared = stored
            if worth_comparing(entry.n_messages, len(conv.messages), shared):
                await self.from_disk(entry, shared, conv)

    async def from_disk(self, entry: Entry, shared: int, conv: Conversation) -> None:
        """Learn from `entry`'s stored text, which the request shares `shared` messages with."""
        if not 0 < shared <= min(len(entry.chain), len(conv.keys)):
            return
        if entry.chain[shared - 1] != conv.keys[shared - 1]:
            return
        messages = await asyncio.to_thread(self.store.files.read_messages, entry.key)
        if messages and len(messages) == len(entry.chain):
            self.habits.learn(conv.namespace, messages, conv.messages, shared, conv.tenant)
