"""The disk store: saved slot states in the cache dir shared with llama-server.

An entry is `<key>.kv` (written by llama-server's slot save), any checkpoint sidecar a server
build writes beside it (`<key>.kv.<anything>`), and `<key>.idx`, the JSON index record. The
`.idx` is written last (temp file, fsync, rename) and deleted first, so it is the commit
marker: a state file without one is never used and is swept at start-up.

All file I/O here is synchronous; callers run it in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from .keys import is_key

log = logging.getLogger("kvproxy.store")

TMP_MARK = ".tmp"
STATE_MAGIC = 0x67677371


@dataclass
class Entry:
    key: str
    namespace: str
    n_tokens: int
    bytes: int
    n_messages: int
    created: float
    last_used: float
    hits: int = 0
    chain: list[str] = field(default_factory=list)  # prefix keys of the saved conversation

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> Entry:
        data = orjson.loads(raw)
        entry = cls(**data)
        if not is_key(entry.key) or not all(is_key(k) for k in entry.chain):
            raise ValueError("malformed key in index record")
        if entry.chain and entry.chain[-1] != entry.key:
            raise ValueError("index record's chain does not end with its key")
        return entry


class Store:
    def __init__(self, root: Path, ttl: float, max_bytes: int) -> None:
        self.root = root
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.entries: dict[str, Entry] = {}
        self._by_prefix: dict[str, set[str]] = {}
        self._pinned: dict[str, int] = {}

    # --- names

    def state_name(self, key: str) -> str:
        return f"{key}.kv"

    def temp_name(self, key: str) -> str:
        """Where llama-server writes a save before it is committed under its key."""
        return f"{key}.{secrets.token_hex(4)}{TMP_MARK}"

    def _idx_path(self, key: str) -> Path:
        return self.root / f"{key}.idx"

    def _entry_files(self, key: str) -> list[Path]:
        """The state file and its sidecars (not the .idx)."""
        state = self.state_name(key)
        out = []
        with os.scandir(self.root) as it:
            for de in it:
                if de.name == state or de.name.startswith(state + "."):
                    out.append(Path(de.path))
        return out

    # --- start-up

    def open(self) -> None:
        """Create the directory, sweep what no commit covers, load the index."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.root, 0o700)
        records: dict[str, Entry] = {}
        names: list[str] = []
        with os.scandir(self.root) as it:
            for de in it:
                names.append(de.name)
        for name in names:
            if name.endswith(".idx") and TMP_MARK not in name and is_key(name[:-4]):
                try:
                    entry = Entry.from_json(self._read_regular(self.root / name))
                    if entry.key != name[:-4]:
                        raise ValueError("record names another key")
                    records[entry.key] = entry
                except (OSError, ValueError, TypeError) as exc:
                    log.warning("dropping unreadable index record %s: %s", name, exc)
                    self._unlink(self.root / name)
        for name in names:
            path = self.root / name
            key = name.split(".", 1)[0]
            if TMP_MARK in name:
                self._unlink(path)
            elif name.endswith(".idx"):
                continue
            elif not (is_key(key) and key in records and name.startswith(f"{key}.kv")):
                if is_key(key):  # only ever delete files that look like ours
                    log.info("sweeping uncommitted file %s", name)
                    self._unlink(path)
        for key, entry in records.items():
            problem = self.check_state_file(entry)
            if problem is not None:
                log.warning("dropping entry %s: %s", key[:12], problem)
                self._delete_files(key)
                continue
            self._add(entry)
        log.info("cache dir %s: %d entries, %s", self.root, len(self.entries), self.total_bytes)

    @staticmethod
    def _read_regular(path: Path) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(1 << 20)
        finally:
            os.close(fd)

    @staticmethod
    def _regular_size(path: Path) -> int:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path.name} is not a regular file")
        return st.st_size

    # --- the in-memory index

    def _add(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        for k in entry.chain or [entry.key]:
            self._by_prefix.setdefault(k, set()).add(entry.key)

    def _forget(self, key: str) -> Entry | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            for k in entry.chain or [entry.key]:
                holders = self._by_prefix.get(k)
                if holders is not None:
                    holders.discard(key)
                    if not holders:
                        del self._by_prefix[k]
        return entry

    @property
    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values())

    def lookup(self, keys: list[str], namespace: str) -> tuple[Entry, int] | None:
        """The stored entry sharing the longest prefix with `keys`, and that prefix's length."""
        for depth in range(len(keys), 0, -1):
            holders = self._by_prefix.get(keys[depth - 1])
            if not holders:
                continue
            # Prefer the entry that ends closest to this point: least to load, least to drop.
            candidates = [
                self.entries[k] for k in holders if self.entries[k].namespace == namespace
            ]
            if candidates:
                best = min(candidates, key=lambda e: (len(e.chain), -e.last_used))
                return best, depth
        return None

    def pin(self, key: str) -> None:
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        left = self._pinned.get(key, 0) - 1
        if left > 0:
            self._pinned[key] = left
        else:
            self._pinned.pop(key, None)

    def select_victims(self, now: float | None = None, incoming: int = 0) -> list[Entry]:
        """TTL first, then least recently used until the budget (plus `incoming`) fits.

        Victims leave the in-memory index at once; the caller deletes their files.
        """
        now = time.time() if now is None else now
        victims: list[Entry] = []
        if self.ttl > 0:
            for entry in list(self.entries.values()):
                if now - entry.last_used > self.ttl and entry.key not in self._pinned:
                    victims.append(entry)
                    self._forget(entry.key)
        if self.max_bytes > 0:
            total = self.total_bytes + incoming
            if total > self.max_bytes:
                for entry in sorted(self.entries.values(), key=lambda e: e.last_used):
                    if total <= self.max_bytes:
                        break
                    if entry.key in self._pinned:
                        continue
                    victims.append(entry)
                    self._forget(entry.key)
                    total -= entry.bytes
        return victims

    # --- file operations (run these in a thread)

    def commit(self, entry: Entry, temp: str) -> Entry:
        """Move a finished save from its temp name to `<key>.kv*`, then write the commit marker."""
        key = entry.key
        moved: list[tuple[Path, Path]] = []
        with os.scandir(self.root) as it:
            for de in it:
                if de.name == temp or de.name.startswith(temp + "."):
                    src = Path(de.path)
                    dst = self.root / (self.state_name(key) + de.name[len(temp) :])
                    moved.append((src, dst))
        if not any(src.name == temp for src, _ in moved):
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        # The old entry under this key (if any) stops being committed before its files change.
        self._unlink(self._idx_path(key))
        old = self._forget(key)
        if old is not None:
            for path in self._entry_files(key):
                if all(path != dst for _, dst in moved):
                    self._unlink(path)
        size = 0
        for src, dst in moved:
            size += self._regular_size(src)
            with contextlib.suppress(OSError):
                os.chmod(src, 0o600)
            _fsync_file(src)
            os.replace(src, dst)
        entry.bytes = size
        self._write_idx(entry)
        _fsync_dir(self.root)
        self._add(entry)
        return entry

    def _write_idx(self, entry: Entry) -> None:
        path = self._idx_path(entry.key)
        tmp = self.root / f"{entry.key}.{secrets.token_hex(4)}{TMP_MARK}.idx"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, entry.to_json())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def touch(self, key: str, hits: int = 1) -> None:
        """Record a use (for LRU across restarts)."""
        entry = self.entries.get(key)
        if entry is None:
            return
        entry.last_used = time.time()
        entry.hits += hits
        with contextlib.suppress(OSError):
            self._write_idx(entry)

    def discard_temp(self, temp: str) -> None:
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for de in it:
                if de.name == temp or de.name.startswith(temp + "."):
                    self._unlink(Path(de.path))

    def remove(self, key: str) -> None:
        """Drop an entry: the commit marker goes first."""
        self._forget(key)
        self._delete_files(key)

    def delete_files(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._delete_files(entry.key)

    def _delete_files(self, key: str) -> None:
        self._unlink(self._idx_path(key))
        with contextlib.suppress(OSError):
            for path in self._entry_files(key):
                self._unlink(path)

    def check_state_file(self, entry: Entry) -> str | None:
        """Cheap checks before asking the server to load a file; the reason it is bad, if so."""
        path = self.root / self.state_name(entry.key)
        try:
            files = self._entry_files(entry.key)
            size = sum(self._regular_size(p) for p in files)
            if size != entry.bytes:
                return f"size {size} != recorded {entry.bytes}"
            with open(path, "rb", opener=_nofollow_opener) as fh:
                head = fh.read(12)
        except (OSError, ValueError) as exc:
            return str(exc)
        if len(head) < 12 or int.from_bytes(head[:4], "little") != STATE_MAGIC:
            return "not a llama.cpp slot state file"
        return None

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _nofollow_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _fsync_file(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_NOFOLLOW)


def _fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
