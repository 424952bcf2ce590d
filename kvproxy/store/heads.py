"""`Heads`: what the index holds at the first two boundaries of every entry, kept on the event
loop, so the lookups that decide the most requests need no hop to the index thread.

A new session either shares nothing stored (nothing to restore) or only its opening (a
system prompt other sessions share): keys are chained, so an entry holding a request's
second key holds its first too, and "no entry holds `keys[:2]`" bounds the answer at depth
one. `Heads` keeps, per namespace, how many entries hold each first and second key (a
60-bit prefix of the key: a collision can only send a lookup to the index, never answer
wrongly) and, for a bounded number of first keys, the entry the index puts first at that
depth (ending closest to it, then most recently used). From that, `answer` gives the index's
own answer (`kvproxy.store.lookup.candidates`) when it is settled at depth 0 or 1, and None
otherwise: the index answers then.

Memory: two dictionary items at most per entry (about 170 bytes per entry at 100k entries,
measured), and `ROWS_KEPT` rows.

It changes only on the loop, from what the index thread's jobs return, applied in the order
those jobs ran (`Store` applies each right after its job): `seq` numbers them, and a change
from a job that ran before the snapshot `load` was built from is in it already.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from kvproxy.store.entry import Entry
from kvproxy.store.schema import KEY_BYTES

DEPTH = 2  # boundaries kept per entry
ROWS_KEPT = 1024  # first keys whose leading entry is remembered
_HEX = 15  # hex digits of a key kept: 60 bits


def _short(key: str) -> int:
    return int(key[:_HEX], 16)


def _shorts(head: bytes | str) -> list[int]:
    """The short keys of a chain's first bytes as stored (`_short` of each key), or of a key."""
    if isinstance(head, str):
        return [_short(head)]
    step = KEY_BYTES
    return [
        int.from_bytes(head[i : i + 8], "big") >> (64 - 4 * _HEX)
        for i in range(0, min(len(head), DEPTH * step), step)
    ]


def _order(entry: Entry) -> tuple[int, float, int]:
    """The index's order among entries holding a prefix (`prefixes`' primary key)."""
    return (len(entry.chain) or 1, -entry.last_used, entry.row_id)


class Heads:
    def __init__(self) -> None:
        self._held: dict[str, dict[int, int]] = {}  # namespace -> {short key: entries}
        self._rows: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # least recent first
        self.ready = False  # loaded, and no write since that it did not see
        self._built_at = -1

    # --- building and keeping it in step

    def load(
        self, read: tuple[dict[int, str], Iterable[tuple[int, bytes | str]]], seq: int
    ) -> None:
        """What the index held after job `seq` (`IndexDB.heads`)."""
        names, heads = read
        self._held, self._rows = {}, OrderedDict()
        by_id: dict[int, dict[int, int]] = {}
        for ns, head in heads:
            held = by_id.setdefault(ns, {})
            for short in _shorts(head):
                held[short] = held.get(short, 0) + 1
        self._held = {names[ns]: held for ns, held in by_id.items() if ns in names}
        self._built_at = seq
        self.ready = True

    def stale(self) -> None:
        """Someone else wrote to the index: answer nothing until loaded again."""
        self.ready = False
        self._rows.clear()

    def added(self, entry: Entry, seq: int) -> None:
        if seq <= self._built_at:
            return
        self._count(entry.namespace, entry.chain or [entry.key], 1)
        self._maybe_first(entry)

    def removed(self, entry: Entry, seq: int) -> None:
        if seq <= self._built_at:
            return
        chain = entry.chain or [entry.key]
        self._count(entry.namespace, chain, -1)
        at = (entry.namespace, chain[0])
        kept = self._rows.get(at)
        if kept is not None and kept.row_id == entry.row_id:
            del self._rows[at]  # which entry comes next is the index's to say

    def touched(self, entry: Entry, seq: int) -> None:
        """`entry` as its use left it (a later `last_used`: it may now come first)."""
        if seq > self._built_at:
            self._maybe_first(entry)

    def remember(self, keys: list[str], namespace: str, found: list[tuple[Entry, int]]) -> None:
        """The index's answer for `keys`: when it is at depth one, its entry leads that key."""
        if self.ready and found and found[0][1] == 1 and len(found) == 1:
            entry = found[0][0]
            at = (namespace, keys[0])
            self._rows[at] = entry
            self._rows.move_to_end(at)
            while len(self._rows) > ROWS_KEPT:
                self._rows.popitem(last=False)

    def _count(self, namespace: str, chain: list[str], step: int) -> None:
        held = self._held.setdefault(namespace, {})
        for short in map(_short, chain[:DEPTH]):
            left = held.get(short, 0) + step
            if left > 0:
                held[short] = left
            else:
                held.pop(short, None)
        if not held:
            del self._held[namespace]

    def _maybe_first(self, entry: Entry) -> None:
        chain = entry.chain or [entry.key]
        at = (entry.namespace, chain[0])
        kept = self._rows.get(at)
        if kept is not None and (kept.row_id == entry.row_id or _order(entry) < _order(kept)):
            self._rows[at] = entry

    # --- answering

    def answer(self, keys: list[str], namespace: str) -> list[tuple[Entry, int]] | None:
        """`candidates(keys)` as the index would answer it, or None when only it can."""
        if not self.ready:
            return None
        held = self._held.get(namespace)
        if not keys or held is None or _short(keys[0]) not in held:
            return []  # no entry holds even the first key
        if len(keys) > 1 and _short(keys[1]) in held:
            return None  # deeper than kept here
        at = (namespace, keys[0])
        entry = self._rows.get(at)
        if entry is None:
            return None
        self._rows.move_to_end(at)
        # Only entries ending before depth one extend it: none. The one found comes alone.
        return [(entry, 1)]

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())
