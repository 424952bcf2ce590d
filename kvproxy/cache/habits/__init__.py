"""What each namespace's client does to a conversation between turns: how it echoes the
reply (echo.EchoStyles) and what it rewrites before it (rewrites.Rewrites). Learnt from
the request that continues a conversation kvproxy recorded, applied when a slot is saved, so
the saved state is the prefix the client's next request really starts with.

Kept per namespace in an LRU bounded per tenant and in total (cache/decisions/bounds.py), and
written out (habits.json) within BYTE_BUDGET, so the file always stays readable by the next
start."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvproxy.cache.decisions.bounds import UNKNOWN_TENANT, NamespaceLRU
from kvproxy.cache.habits.echo import EchoStyles
from kvproxy.cache.habits.rewrites import Rewrites, rewrite

# Agents rewrite the messages of their last turn (a reminder, a per-turn context message):
# a request that parts from a recorded conversation further back is a branch, not a rewrite.
NEAR_END = 3
# The most habits.json may take (below dirfiles.MAX_BYTES, which an older kvproxy reads).
BYTE_BUDGET = 960 * 1024


@dataclass
class Habits:
    echo: EchoStyles = field(default_factory=EchoStyles)
    rewrites: Rewrites = field(default_factory=Rewrites)
    kept: NamespaceLRU = field(default_factory=NamespaceLRU)

    def learn(
        self,
        namespace: str,
        ours: Sequence[Any],
        theirs: Sequence[Any],
        shared: int,
        tenant: str | None = None,
    ) -> bool:
        """Learn from `theirs`, the request after `ours` (the recorded conversation, its reply
        last), whose key chains share `shared` messages. True when it showed a rewrite."""
        before = self.changes
        try:
            n = len(ours)
            if shared >= n:
                self.echo.learn(namespace, ours, theirs)
                return False
            if not worth_comparing(n, len(theirs), shared):
                return False
            return self.rewrites.learn(namespace, ours, theirs, shared) is not None
        finally:
            if self.changes != before:
                self._keep(namespace, tenant)

    def _keep(self, namespace: str, tenant: str | None) -> None:
        for gone in self.kept.add(namespace, tenant):
            self._forget(gone)

    def _forget(self, namespace: str) -> None:
        self.echo.forget(namespace)
        self.rewrites.forget(namespace)

    @property
    def changes(self) -> int:
        """Grows whenever something was learnt: the cue to write them out (store/dirfiles.py)."""
        return self.echo.changes + self.rewrites.changes

    @property
    def evicted(self) -> int:
        """Namespaces whose habits were dropped to keep within the bounds."""
        return self.kept.evicted

    def to_json(self) -> dict[str, Any]:
        """Oldest used first; past BYTE_BUDGET, the tenant taking the most bytes loses its
        least recently used namespaces (dropped here too, so memory and file agree)."""
        for ns in [*self.echo.to_json(), *self.rewrites.to_json()]:
            if ns not in self.kept:  # learnt around Habits.learn: kept, with no tenant
                self._keep(ns, None)
        self._fit(BYTE_BUDGET)
        owners = self.kept.owners()
        echo, rewrites = self.echo.to_json(), self.rewrites.to_json()
        return {
            "version": 1,
            "echo": {ns: echo[ns] for ns in owners if ns in echo},
            "rewrites": {ns: rewrites[ns] for ns in owners if ns in rewrites},
            "owners": owners,
        }

    def _fit(self, budget: int) -> None:
        echo, rewrites = self.echo.to_json(), self.rewrites.to_json()
        size = {
            ns: 8 + len(orjson.dumps([ns, tenant, echo.get(ns), rewrites.get(ns)]))
            for ns, tenant in self.kept.owners().items()
        }
        total = sum(size.values())
        while total > budget and size:
            by_tenant: dict[str, int] = {}
            for ns, n in size.items():
                owner = self.kept.tenant_of(ns) or UNKNOWN_TENANT
                by_tenant[owner] = by_tenant.get(owner, 0) + n
            biggest = max(by_tenant, key=lambda t: by_tenant[t])
            gone = next(ns for ns in size if (self.kept.tenant_of(ns) or UNKNOWN_TENANT) == biggest)
            total -= size.pop(gone)
            self.kept.remove(gone)
            self.kept.evicted += 1
            self._forget(gone)

    def load(self, data: Any) -> bool:
        """What `to_json` wrote, from an earlier run (anything else is skipped), within the
        bounds: past them the least recently used namespaces are dropped. True if any was."""
        if not (isinstance(data, dict) and data.get("version") == 1):
            return False
        self.echo.load(data.get("echo"))
        self.rewrites.load(data.get("rewrites"))
        owners = data.get("owners")
        owners = owners if isinstance(owners, dict) else {}
        known = dict.fromkeys([*self.echo.to_json(), *self.rewrites.to_json()])
        # Oldest first: namespaces an older file names without an owner, then by use.
        order = [ns for ns in known if ns not in owners]
        order += [ns for ns in owners if ns in known]
        evicted = self.kept.evicted
        for ns in order:
            tenant = owners.get(ns)
            self._keep(ns, tenant if isinstance(tenant, str) else None)
        self._fit(BYTE_BUDGET)
        return self.kept.evicted != evicted

    def next_messages(self, namespace: str, messages: Sequence[Any]) -> list[Any]:
        """The conversation as its client will send it in its next request."""
        self.kept.touch(namespace)
        rules = self.rewrites.get(namespace)
        return rewrite(rules, messages) if rules else list(messages)


def worth_comparing(n_ours: int, n_theirs: int, shared: int) -> bool:
    """Could the request show a rewrite of the recorded conversation? (Cheap: no text read.)"""
    return 0 < shared < n_ours - 1 and shared >= n_ours - 1 - NEAR_END and n_theirs >= n_ours
