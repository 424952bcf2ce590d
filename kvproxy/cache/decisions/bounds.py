"""Bounds on what clients can make kvproxy keep per namespace (habits, openings).

A namespace is cheap to invent: any `chat_template_kwargs`, `tools` or other field that
shapes the prompt makes a new one. So every per-namespace memory is an LRU here, bounded per
tenant and in total: a tenant past its own cap loses its least recently used namespace; past
the total, the tenant holding the most loses its least recently used one (on a tie, the
tenant adding). One tenant's flood
of invented namespaces so never removes another tenant's state while that tenant is within
its share. Evictions are counted (`kvproxy_namespace_evictions_total`).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

# Namespaces one tenant keeps, and all tenants together.
PER_TENANT = 64
TOTAL = 1024
# The tenant of namespaces read from a file that did not name one (an older kvproxy's).
UNKNOWN_TENANT = ""


class NamespaceLRU:
    """Which namespaces are kept, whose, and in what order of use (oldest first)."""

    def __init__(self, per_tenant: int = PER_TENANT, total: int = TOTAL) -> None:
        self.per_tenant = max(1, per_tenant)
        self.total = max(1, total)
        self._owner: OrderedDict[str, str] = OrderedDict()  # namespace -> tenant, LRU first
        self._count: defaultdict[str, int] = defaultdict(int)
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, namespace: object) -> bool:
        return namespace in self._owner

    def owners(self) -> dict[str, str]:
        """namespace -> tenant, least recently used first."""
        return dict(self._owner)

    def tenant_of(self, namespace: str) -> str | None:
        return self._owner.get(namespace)

    def touch(self, namespace: str) -> None:
        """A kept namespace was used: it is the most recent."""
        if namespace in self._owner:
            self._owner.move_to_end(namespace)

    def add(self, namespace: str, tenant: str | None) -> list[str]:
        """Keep `namespace` as the most recent (its tenant is the first one seen); returns the
        namespaces evicted to make room, which the caller forgets."""
        if namespace in self._owner:
            self._owner.move_to_end(namespace)
            return []
        owner = tenant or UNKNOWN_TENANT
        self._owner[namespace] = owner
        self._count[owner] += 1
        out: list[str] = []
        if self._count[owner] > self.per_tenant:
            out.append(self._evict_oldest_of(owner))
        while len(self._owner) > self.total:
            # The tenant holding the most pays; on a tie, the one adding (it never evicts a
            # tenant holding as many as it does).
            most = max(self._count.values())
            payer = owner if self._count[owner] == most else None
            if payer is None:
                payer = next(t for t, n in self._count.items() if n == most)
            out.append(self._evict_oldest_of(payer))
        return out

    def remove(self, namespace: str) -> None:
        owner = self._owner.pop(namespace, None)
        if owner is not None:
            self._drop_count(owner)

    def _evict_oldest_of(self, tenant: str) -> str:
        namespace = next(ns for ns, t in self._owner.items() if t == tenant)
        del self._owner[namespace]
        self._drop_count(tenant)
        self.evicted += 1
        return namespace

    def _drop_count(self, tenant: str) -> None:
        self._count[tenant] -= 1
        if self._count[tenant] <= 0:
            del self._count[tenant]
