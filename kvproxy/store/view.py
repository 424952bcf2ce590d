"""`EntriesView`: `Store.entries`, the committed rows as a read-only mapping, each access a
query in the calling thread (`kvproxy ls|rm|gc` and tests; never the proxy's request paths)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kvproxy.store.db import IndexDB
from kvproxy.store.entry import Entry

Run = Callable[[Callable[[IndexDB], Any]], Any]  # `Store._sync`: work on this thread's connection


class EntriesView(Mapping[str, Entry]):
    def __init__(self, run: Run) -> None:
        self._run = run

    def __getitem__(self, key: str) -> Entry:
        found: Entry | None = self._run(lambda db: db.get(key))
        if found is None:
            raise KeyError(key)
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and bool(self._run(lambda db: db.contains(key)))

    def __len__(self) -> int:
        return int(self._run(lambda db: db.totals().entries))

    def __iter__(self) -> Iterator[str]:
        return iter([e.key for e in self._all()])

    def _all(self) -> list[Entry]:
        rows: list[Entry] = self._run(lambda db: list(db.oldest()))
        return rows

    def values(self) -> list[Entry]:  # type: ignore[override]
        return self._all()

    def items(self) -> list[tuple[str, Entry]]:  # type: ignore[override]
        return [(e.key, e) for e in self._all()]
