"""`Entry`, one saved slot state as the index knows it, and its index record.

The record is what `<key>.idx` holds (see `kvproxy.store.files` for the files on disk): every
field but `messages`, as JSON. Reading one checks the keys it names, so a damaged or foreign
record is refused rather than indexed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from kvproxy.keys import is_key

TURN = "turn"
SHARED = "shared"


@dataclass
class Entry:
    key: str
    namespace: str
    n_tokens: int
    state_bytes: int  # the state file and its sidecars (`bytes` in the record)
    n_messages: int
    created: float
    last_used: float
    hits: int = 0  # restores of this entry
    chain: list[str] = field(default_factory=list)  # prefix keys of the saved conversation
    msgs_bytes: int = 0  # size of `<key>.msgs`; 0 when the conversation's text is not kept
    # xxh3-128 of the state file and its sidecars as committed ("" in records written before
    # kvproxy kept one: those are checked by size and header only).
    checksum: str = ""
    # The conversation as the client will echo it, handed to `commit`, which writes it to
    # `<key>.msgs` and drops it from the committed entry: read it back with `read_messages`.
    messages: list[Any] | None = field(default=None, repr=False, compare=False)
    # The model the state came from, as `kvproxy ls` names it: a router's model name, else
    # the GGUF file's ("" in entries saved before kvproxy recorded it).
    model: str = ""
    # What it is kept for: TURN, a conversation's state after a reply (a newer state of the
    # same conversation that extends it may supersede it: cache/disk/lineage.py), or SHARED, a
    # start cut for other sessions (an opening, a stem: kept). "" in entries saved before
    # kvproxy recorded it: kept as SHARED are.
    kind: str = ""
    # Suffixes after `<key>.kv` of the state's other files (checkpoint sidecars some server
    # builds write): their names are derived from these, never searched for.
    sidecars: tuple[str, ...] = ()
    # The index row (kvproxy.store.db): tells a re-commit of the same key apart. 0 until
    # committed.
    row_id: int = field(default=0, compare=False)

    @property
    def on_disk(self) -> int:
        """Every byte the entry costs in the cache dir."""
        return self.state_bytes + self.msgs_bytes

    def to_json(self) -> bytes:
        record = {_RECORD_NAMES.get(f, f): getattr(self, f) for f in _RECORD_FIELDS}
        return orjson.dumps(record)

    @classmethod
    def from_json(cls, raw: bytes) -> Entry:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("index record is not an object")
        # Fields a newer kvproxy added are ignored, so a downgrade keeps the cache.
        named = {_FIELD_NAMES.get(k, k): v for k, v in data.items()}
        entry = cls(**{k: v for k, v in named.items() if k in _RECORD_FIELDS})
        if not is_key(entry.key) or not all(is_key(k) for k in entry.chain):
            raise ValueError("malformed key in index record")
        if entry.chain and entry.chain[-1] != entry.key:
            raise ValueError("index record's chain does not end with its key")
        return entry


# The `.idx` record of kvproxy before the SQLite index: read when importing an old cache dir.
_RECORD_FIELDS = tuple(
    f.name for f in fields(Entry) if f.name not in ("messages", "sidecars", "row_id")
)
# Attribute -> name in the JSON record, where they differ (records written before stay valid).
_RECORD_NAMES = {"state_bytes": "bytes"}
_FIELD_NAMES = {v: k for k, v in _RECORD_NAMES.items()}
