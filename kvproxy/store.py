"""The disk store: saved slot states in the cache dir shared with llama-server.

An entry is `<key>.kv` (written by llama-server's slot save), any checkpoint sidecar a server
build writes beside it (`<key>.kv.<anything>`), optionally `<key>.msgs` (the conversation as
the client will echo it, JSON, for explaining misses), and `<key>.idx`, the JSON index
record. The `.idx` is written last (temp file, fsync, rename) and deleted first, so it is the
commit marker: a file without one is never used and is swept at start-up.

All file I/O here is synchronous; callers run it in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import orjson

from .keys import is_key

log = logging.getLogger("kvproxy.store")

TMP_MARK = ".tmp"
STATE_MAGIC = 0x67677371
MSGS_SUFFIX = ".msgs"
# Index records are small; a conversation's text can be large. Beyond this its text is not
# kept (misses against that entry just go unexplained).
MAX_IDX_BYTES = 1 << 20
MAX_MSGS_BYTES = 16 << 20


@dataclass
class Entry:
    key: str
    namespace: str
    n_tokens: int
    bytes: int
    n_messages: int
    created: float
    last_used: float
    hits: int = 0  # restores of this entry
    chain: list[str] = field(default_factory=list)  # prefix keys of the saved conversation
    msgs_bytes: int = 0  # size of `<key>.msgs`; 0 when the conversation's text is not kept
    # The conversation as the client will echo it, handed to `commit`, which writes it to
    # `<key>.msgs` and drops it from memory: read it back with `Store.read_messages`.
    messages: list[Any] | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> bytes:
        return orjson.dumps({f: getattr(self, f) for f in _RECORD_FIELDS})

    @classmethod
    def from_json(cls, raw: bytes) -> Entry:
        data = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("index record is not an object")
        # Fields a newer kvproxy added are ignored, so a downgrade keeps the cache.
        entry = cls(**{k: v for k, v in data.items() if k in _RECORD_FIELDS})
        if not is_key(entry.key) or not all(is_key(k) for k in entry.chain):
            raise ValueError("malformed key in index record")
        if entry.chain and entry.chain[-1] != entry.key:
            raise ValueError("index record's chain does not end with its key")
        return entry


_RECORD_FIELDS = tuple(f.name for f in fields(Entry) if f.name != "messages")


class Store:
    def __init__(self, root: Path, ttl: float, max_bytes: int) -> None:
        self.root = root
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.entries: dict[str, Entry] = {}
        self._by_prefix: dict[str, set[str]] = {}
        self._pinned: dict[str, int] = {}
        self.problems: list[tuple[str, str]] = []  # (key, reason) skipped by the last load

    # --- names

    def state_name(self, key: str) -> str:
        return f"{key}.kv"

    def temp_name(self, key: str) -> str:
        """Where llama-server writes a save before it is committed under its key."""
        return f"{key}.{secrets.token_hex(4)}{TMP_MARK}"

    def _idx_path(self, key: str) -> Path:
        return self.root / f"{key}.idx"

    def _msgs_path(self, key: str) -> Path:
        return self.root / f"{key}{MSGS_SUFFIX}"

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
        self._load(sweep=True)
        log.info("cache dir %s: %d entries, %s", self.root, len(self.entries), self.total_bytes)

    def open_readonly(self) -> list[tuple[str, str]]:
        """Load the index without changing anything on disk, for `kvproxy ls|rm|gc` while a
        proxy may be using the directory (a sweep could delete its save in flight). Returns
        the (key, reason) of records skipped; FileNotFoundError when there is no cache dir."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"no cache dir at {self.root}")
        return self._load(sweep=False)

    def _load(self, sweep: bool) -> list[tuple[str, str]]:
        problems: list[tuple[str, str]] = []
        names: list[str] = []
        with os.scandir(self.root) as it:
            for de in it:
                names.append(de.name)
        records: dict[str, Entry] = {}
        for name in names:
            if name.endswith(".idx") and TMP_MARK not in name and is_key(name[:-4]):
                try:
                    entry = Entry.from_json(self._read_regular(self.root / name, MAX_IDX_BYTES))
                    if entry.key != name[:-4]:
                        raise ValueError("record names another key")
                    records[entry.key] = entry
                except (OSError, ValueError, TypeError) as exc:
                    problems.append((name[:-4], f"unreadable index record: {exc}"))
                    if sweep:
                        log.warning("dropping unreadable index record %s: %s", name, exc)
                        self._unlink(self.root / name)
        # One pass over the names instead of a directory scan per entry: a big cache has
        # thousands of entries.
        files: dict[str, list[Path]] = {}
        with_text: set[str] = set()
        for name in names:
            path = self.root / name
            key = name.split(".", 1)[0]
            committed = is_key(key) and key in records
            if TMP_MARK in name:
                if sweep:
                    self._unlink(path)
            elif name.endswith(".idx"):
                continue
            elif committed and name.startswith(f"{key}.kv"):
                files.setdefault(key, []).append(path)
            elif committed and name == f"{key}{MSGS_SUFFIX}":
                with_text.add(key)
            elif sweep and is_key(key):  # only ever delete files that look like ours
                log.info("sweeping uncommitted file %s", name)
                self._unlink(path)
        for key, entry in records.items():
            problem = self._check_files(entry, files.get(key, []))
            if problem is not None:
                problems.append((key, problem))
                if sweep:
                    log.warning("dropping entry %s: %s", key[:12], problem)
                    self._delete_files(key)
                continue
            # What is on disk counts against the budget, whatever the record says.
            entry.msgs_bytes = self._msgs_size(key) if key in with_text else 0
            self._add(entry)
        self.problems = problems
        return problems

    def _msgs_size(self, key: str) -> int:
        """The size of `<key>.msgs`, 0 if it is missing or not a regular file."""
        try:
            return self._regular_size(self._msgs_path(key))
        except (OSError, ValueError):
            return 0

    @staticmethod
    def _read_regular(path: Path, limit: int) -> bytes:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(limit)
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
        """Bytes on disk: state files, their sidecars and the conversations' text."""
        return sum(e.bytes + e.msgs_bytes for e in self.entries.values())

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

    def expired(self, entry: Entry, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.ttl > 0 and now - entry.last_used > self.ttl

    def select_victims(self, now: float | None = None, incoming: int = 0) -> list[Entry]:
        """TTL first, then least recently used until the budget (plus `incoming`) fits.

        Victims leave the in-memory index at once; the caller deletes their files.
        """
        now = time.time() if now is None else now
        victims: list[Entry] = []
        if self.ttl > 0:
            for entry in list(self.entries.values()):
                if self.expired(entry, now) and entry.key not in self._pinned:
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
                    total -= entry.bytes + entry.msgs_bytes
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
        self._unlink(self._msgs_path(key))
        size = 0
        for src, dst in moved:
            size += self._regular_size(src)
            with contextlib.suppress(OSError):
                os.chmod(src, 0o600)
            _fsync_file(src)
            os.replace(src, dst)
        entry.bytes = size
        entry.msgs_bytes = self._write_messages(key, entry.messages) if entry.messages else 0
        entry.messages = None  # on disk now; kept out of memory and out of the index record
        self._write_idx(entry)
        _fsync_dir(self.root)
        self._add(entry)
        return entry

    def _write_messages(self, key: str, messages: list[Any]) -> int:
        """Write `<key>.msgs` (before the commit marker); its size, or 0 if not kept."""
        try:
            data = orjson.dumps(messages)
        except TypeError as exc:  # not JSON after all: the entry is still worth keeping
            log.debug("not keeping the text of %s: %s", key[:12], exc)
            return 0
        if len(data) > MAX_MSGS_BYTES:
            return 0
        self._write_atomic(self._msgs_path(key), key, data)
        return len(data)

    def recent_with_text(self, namespace: str, limit: int = 8) -> list[str]:
        """Keys of the most recently used entries of `namespace` whose text was kept: the
        conversations a miss is compared with (reading every entry's text would not scale)."""
        found = [e for e in self.entries.values() if e.namespace == namespace and e.msgs_bytes]
        found.sort(key=lambda e: e.last_used, reverse=True)
        return [e.key for e in found[:limit]]

    def read_many_messages(self, keys: list[str]) -> list[tuple[str, list[Any]]]:
        """(key, conversation) of those of `keys` whose text is readable (run in a thread)."""
        out = []
        for key in keys:
            messages = self.read_messages(key)
            if messages is not None:
                out.append((key, messages))
        return out

    def read_messages(self, key: str) -> list[Any] | None:
        """The stored conversation's text, if it was kept (run in a thread)."""
        entry = self.entries.get(key)
        if entry is None or not entry.msgs_bytes:
            return None
        try:
            data = orjson.loads(self._read_regular(self._msgs_path(key), MAX_MSGS_BYTES))
        except (OSError, ValueError) as exc:
            log.debug("cannot read the text of %s: %s", key[:12], exc)
            return None
        return data if isinstance(data, list) else None

    def _write_idx(self, entry: Entry) -> None:
        self._write_atomic(self._idx_path(entry.key), entry.key, entry.to_json())

    def _write_atomic(self, path: Path, key: str, data: bytes) -> None:
        """Temp file (swept at start-up if we die), fsync, rename: readers see all or nothing."""
        tmp = self.root / f"{key}.{secrets.token_hex(4)}{TMP_MARK}{path.suffix}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            self._unlink(tmp)
            raise
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

    def remove_damaged(self, key: str) -> None:
        """Delete the files of a key that has no loadable entry (see `open_readonly`)."""
        if is_key(key) and key not in self.entries:
            self._delete_files(key)

    def remove(self, key: str) -> None:
        """Drop an entry: the commit marker goes first."""
        self._forget(key)
        self._delete_files(key)

    def forget_removed(self) -> list[str]:
        """Forget entries whose commit marker someone else deleted (`kvproxy rm`, `gc`), so
        the budget and gauges stay true. Runs in a thread: it reads the directory."""
        try:
            with os.scandir(self.root) as it:
                present = {de.name[:-4] for de in it if de.name.endswith(".idx")}
        except OSError:
            return []
        gone = []
        for key in list(self.entries):
            # Checked again one by one: a commit may have landed since the listing.
            if key not in present and key not in self._pinned and not self._idx_path(key).exists():
                self._forget(key)
                gone.append(key)
        return gone

    def delete_files(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._delete_files(entry.key)

    def _delete_files(self, key: str) -> None:
        self._unlink(self._idx_path(key))
        with contextlib.suppress(OSError):
            for path in self._entry_files(key):
                self._unlink(path)
        with contextlib.suppress(OSError):
            self._unlink(self._msgs_path(key))

    def check_state_file(self, entry: Entry) -> str | None:
        """Cheap checks before asking the server to load a file; the reason it is bad, if so."""
        try:
            files = self._entry_files(entry.key)
        except OSError as exc:
            return str(exc)
        return self._check_files(entry, files)

    def _check_files(self, entry: Entry, files: list[Path]) -> str | None:
        path = self.root / self.state_name(entry.key)
        try:
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
