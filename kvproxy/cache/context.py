"""What every part of the cache is given: built once, by `ConversationCache` (lanes/cache.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvproxy import keys
from kvproxy.cache.decisions.policy import RestoreGuard
from kvproxy.cache.habits import Habits
from kvproxy.cache.reports.events import Events
from kvproxy.cache.servers.backend import Backend
from kvproxy.cache.servers.leases import Background
from kvproxy.config import Settings
from kvproxy.store import Store


@dataclass(frozen=True)
class CacheContext:
    settings: Settings
    backend: Backend  # the llama-server: its client, slot pool and model identity
    store: Store  # the cache dir's index and files
    events: Events  # what the cache reports (metrics, the request log)
    habits: Habits  # what each namespace's client does between turns
    guard: RestoreGuard  # whether restoring still pays, per namespace
    background: Background  # detached work that outlives the request that started it

    def tenant_of(self, headers: Mapping[str, str]) -> str | None:
        """Who asks (keys.tenant_of), salted with the cache dir's secret once it is open."""
        return keys.tenant_of(headers, self.settings.tenant_header, self.store.tenant_salt)
