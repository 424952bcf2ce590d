"""The disk store: saved slot states in the cache dir shared with llama-server.

An entry is `<key>.kv` (written by llama-server's slot save), any checkpoint sidecar a server
build writes beside it (`<key>.kv.<anything>`), optionally `<key>.msgs` (the conversation as
the client will echo it, JSON, for explaining misses), and `<key>.idx`, the JSON index
record. The `.idx` is written last (temp file, fsync, rename) and deleted first, so it is the
commit marker: a file without one is never used and is swept at start-up. Files are read with
O_NOFOLLOW and must be regular files.

Who touches what. The in-memory index (`Store.entries`, the prefix map `lookup` uses, the pins
and `problems`) belongs to one thread: the event loop's in the proxy, the only thread in
`kvproxy ls|rm|gc`. Every change to it happens there (a change from another thread raises), so
the loop iterates it (lookups, eviction, `total_bytes`, the /metrics scrape) with no lock and
no copy. File I/O lives in `StoreFiles`, which keeps no index: its methods take plain data
(keys, serialised records, entries nobody changes meanwhile) and return plain data (what was
loaded, which records are gone, the committed entry), so any thread may run them. The proxy
calls the `*_async` methods of `Store`: each does its index work on the loop, runs the file I/O
in a thread and applies the result on the loop when the thread is done. The synchronous
methods (`open`, `commit`, `remove`, ...) do both in the calling thread, for a process with no
event loop; never hand them to `asyncio.to_thread`.

Order on disk. The `*_async` operations that change a key's files (commit, record rewrite,
delete) run one at a time per key, in the order the loop issued them, and their index effects
are applied even if the request that asked for them is cancelled: a record rewrite after a
restore cannot bring back an `.idx` that a later eviction deleted, and the index never falls
behind the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

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

T = TypeVar("T")
R = TypeVar("R")


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
    # `<key>.msgs` and drops it from the committed entry: read it back with `read_messages`.
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


@dataclass
class Loaded:
    """What a load of the cache dir found."""

    entries: list[Entry]
    problems: list[tuple[str, str]]  # (key, reason) of records skipped


class StoreFiles:
    """The cache dir's files: reads, commits and deletions, no index. Any thread may call
    these; keeping two operations on one key apart is the caller's job (see `Store`)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    # --- names

    @staticmethod
    def state_name(key: str) -> str:
        return f"{key}.kv"

    @staticmethod
    def temp_name(key: str) -> str:
        return f"{key}.{secrets.token_hex(4)}{TMP_MARK}"

    def _idx_path(self, key: str) -> Path:
        return self.root / f"{key}.idx"

    def _msgs_path(self, key: str) -> Path:
        return self.root / f"{key}{MSGS_SUFFIX}"

    def _entry_files(self, key: str) -> list[Path]:
        """The state file and its sidecars (not the .idx)."""
        return self._files_of({key}).get(key, [])

    def _files_of(self, keys: set[str]) -> dict[str, list[Path]]:
        """The state files and sidecars of `keys`, in one directory scan."""
        out: dict[str, list[Path]] = {}
        with os.scandir(self.root) as it:
            for de in it:
                key, _, rest = de.name.partition(".")
                if key in keys and (rest == "kv" or rest.startswith("kv.")):
                    out.setdefault(key, []).append(Path(de.path))
        return out

    # --- start-up

    def create(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.root, 0o700)

    def load(self, sweep: bool) -> Loaded:
        """The committed entries whose files check out. With `sweep`, also delete what no
        commit covers and the files of entries that do not check out."""
        problems: list[tuple[str, str]] = []
        with os.scandir(self.root) as it:
            names = [de.name for de in it]
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
                        _unlink(self.root / name)
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
                    _unlink(path)
            elif name.endswith(".idx"):
                continue
            elif committed and name.startswith(f"{key}.kv"):
                files.setdefault(key, []).append(path)
            elif committed and name == f"{key}{MSGS_SUFFIX}":
                with_text.add(key)
            elif sweep and is_key(key):  # only ever delete files that look like ours
                log.info("sweeping uncommitted file %s", name)
                _unlink(path)
        loaded = []
        for key, entry in records.items():
            problem = self._check_files(entry, files.get(key, []))
            if problem is not None:
                problems.append((key, problem))
                if sweep:
                    log.warning("dropping entry %s: %s", key[:12], problem)
                    self.delete([key])
                continue
            # What is on disk counts against the budget, whatever the record says.
            entry.msgs_bytes = self._msgs_size(key) if key in with_text else 0
            loaded.append(entry)
        return Loaded(loaded, problems)

    def _msgs_size(self, key: str) -> int:
        """The size of `<key>.msgs`, 0 if it is missing or not a regular file."""
        try:
            return _regular_size(self._msgs_path(key))
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

    # --- commits and records

    def commit(self, entry: Entry, temp: str) -> Entry | None:
        """Move a finished save from its temp name to `<key>.kv*`, then write the commit marker.

        Returns the committed entry (sizes filled in, text dropped; `entry` is left as it was),
        or None when llama-server wrote no file named `temp`: then nothing was changed.
        """
        key = entry.key
        state = self.state_name(key)
        moved: list[tuple[Path, Path]] = []
        present: list[Path] = []
        with os.scandir(self.root) as it:
            for de in it:
                if de.name == temp or de.name.startswith(temp + "."):
                    moved.append((Path(de.path), self.root / (state + de.name[len(temp) :])))
                elif de.name == state or de.name.startswith(state + "."):
                    present.append(Path(de.path))
        if not any(src.name == temp for src, _ in moved):
            return None
        # An entry already under this key stops being committed before its files change.
        _unlink(self._idx_path(key))
        for path in present:
            if all(path != dst for _, dst in moved):
                _unlink(path)
        _unlink(self._msgs_path(key))
        size = 0
        for src, dst in moved:
            size += _regular_size(src)
            with contextlib.suppress(OSError):
                os.chmod(src, 0o600)
            _fsync_file(src)
            os.replace(src, dst)
        msgs_bytes = self._write_messages(key, entry.messages) if entry.messages else 0
        # The text is on disk now: kept out of memory and out of the index record.
        committed = replace(entry, bytes=size, msgs_bytes=msgs_bytes, messages=None)
        self._write_atomic(self._idx_path(key), key, committed.to_json())
        _fsync_dir(self.root)
        return committed

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

    def rewrite_record(self, key: str, record: bytes) -> None:
        """Replace a committed entry's index record (a use was recorded). Best effort: the old
        record stays valid."""
        try:
            self._write_atomic(self._idx_path(key), key, record)
        except OSError as exc:
            log.debug("cannot rewrite the record of %s: %s", key[:12], exc)

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
            _unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, path)

    # --- reading entries

    def read_messages(self, key: str) -> list[Any] | None:
        """The stored conversation's text, if it was kept."""
        try:
            data = orjson.loads(self._read_regular(self._msgs_path(key), MAX_MSGS_BYTES))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.debug("cannot read the text of %s: %s", key[:12], exc)
            return None
        return data if isinstance(data, list) else None

    def read_many_messages(self, keys: list[str]) -> list[tuple[str, list[Any]]]:
        """(key, conversation) of those of `keys` whose text is readable."""
        out = []
        for key in keys:
            messages = self.read_messages(key)
            if messages is not None:
                out.append((key, messages))
        return out

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
            size = sum(_regular_size(p) for p in files)
            if size != entry.bytes:
                return f"size {size} != recorded {entry.bytes}"
            with open(path, "rb", opener=_nofollow_opener) as fh:
                head = fh.read(12)
        except (OSError, ValueError) as exc:
            return str(exc)
        if len(head) < 12 or int.from_bytes(head[:4], "little") != STATE_MAGIC:
            return "not a llama.cpp slot state file"
        return None

    def missing_records(self, keys: list[str]) -> list[str]:
        """Those of `keys` whose commit marker is gone (someone ran `kvproxy rm` or `gc`)."""
        try:
            with os.scandir(self.root) as it:
                present = {de.name[:-4] for de in it if de.name.endswith(".idx")}
        except OSError:
            return []
        # Checked again one by one: a directory listing may miss a name renamed over meanwhile.
        return [k for k in keys if k not in present and not self._idx_path(k).exists()]

    # --- deleting

    def delete(self, keys: Iterable[str]) -> None:
        """Delete entries' files, each one's commit marker first."""
        wanted = set(keys)
        for key in wanted:
            _unlink(self._idx_path(key))
        with contextlib.suppress(OSError):
            for paths in self._files_of(wanted).values():
                for path in paths:
                    _unlink(path)
        for key in wanted:
            with contextlib.suppress(OSError):
                _unlink(self._msgs_path(key))

    def discard_temp(self, temp: str) -> None:
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for de in it:
                if de.name == temp or de.name.startswith(temp + "."):
                    _unlink(Path(de.path))


class Store:
    """The index of the cache dir, and the operations that keep it and the files in step.

    Invariant: `entries`, the prefix map, the pins and `problems` change only on the thread
    that first changed them (the event loop in the proxy), and `entries` holds exactly the
    committed entries the proxy knows of; see the module docstring.
    """

    def __init__(self, root: Path, ttl: float, max_bytes: int) -> None:
        self.root = root
        self.files = StoreFiles(root)
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.entries: dict[str, Entry] = {}
        self._by_prefix: dict[str, set[str]] = {}
        self._pinned: dict[str, int] = {}
        self.problems: list[tuple[str, str]] = []  # (key, reason) skipped by the last load
        self._owner: int | None = None  # the thread the index belongs to
        self._last_op: dict[str, asyncio.Future[Any]] = {}  # per key, the latest file operation

    # --- names (any thread)

    def state_name(self, key: str) -> str:
        return self.files.state_name(key)

    def temp_name(self, key: str) -> str:
        """Where llama-server writes a save before it is committed under its key."""
        return self.files.temp_name(key)

    # --- the index: its own thread only, no I/O

    def _own(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError("the store index changed off its thread (use the *_async calls)")

    def _install(self, loaded: Loaded) -> None:
        self._own()
        self.entries.clear()
        self._by_prefix.clear()
        for entry in loaded.entries:
            self._add(entry)
        self.problems = loaded.problems

    def _add(self, entry: Entry) -> None:
        self._own()
        self.entries[entry.key] = entry
        for k in entry.chain or [entry.key]:
            self._by_prefix.setdefault(k, set()).add(entry.key)

    def _forget(self, key: str) -> Entry | None:
        self._own()
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

    def recent_with_text(self, namespace: str, limit: int = 8) -> list[str]:
        """Keys of the most recently used entries of `namespace` whose text was kept: the
        conversations a miss is compared with (reading every entry's text would not scale)."""
        found = [e for e in self.entries.values() if e.namespace == namespace and e.msgs_bytes]
        found.sort(key=lambda e: e.last_used, reverse=True)
        return [e.key for e in found[:limit]]

    def pin(self, key: str) -> None:
        self._own()
        self._pinned[key] = self._pinned.get(key, 0) + 1

    def unpin(self, key: str) -> None:
        self._own()
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

        Victims leave the in-memory index at once; the caller deletes their files
        (`delete_files_async`, or `delete_files` with no event loop).
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

    def _committed(self, temp: str, old: Entry | None, committed: Entry | None) -> Entry:
        """Index a commit that replaced `old` (already forgotten), or put `old` back."""
        if committed is None:  # nothing changed on disk: the old entry is still good
            if old is not None and old.key not in self.entries:
                self._add(old)
            raise FileNotFoundError(f"llama-server wrote no file named {temp}")
        self._add(committed)
        return committed

    def _record_use(self, key: str, hits: int) -> bytes | None:
        """Count a use of `key` (for LRU across restarts); its new record, None if unknown."""
        self._own()
        entry = self.entries.get(key)
        if entry is None:
            return None
        entry.last_used = time.time()
        entry.hits += hits
        return entry.to_json()

    def _forget_gone(self, known: dict[str, Entry], gone: list[str]) -> list[str]:
        """Forget those of `gone` (seen without a commit marker) still indexed as they were in
        `known`: an entry committed again since, or being restored, stays."""
        forgotten = []
        for key in gone:
            if self.entries.get(key) is known[key] and key not in self._pinned:
                self._forget(key)
                forgotten.append(key)
        return forgotten

    # --- the proxy: index work on the loop, file I/O in a thread

    async def open_async(self) -> None:
        """Create the directory, sweep what no commit covers, load the index."""
        await self._in_thread((), self._open_dir, self._install)
        self._log_opened()

    async def commit_async(self, entry: Entry, temp: str) -> Entry:
        """Commit a finished save (see `StoreFiles.commit`); the committed entry.
        FileNotFoundError if the server wrote nothing under `temp`."""
        old = self._forget(entry.key)  # its commit marker is the first thing to go on disk
        work = partial(self.files.commit, entry, temp)
        return await self._in_thread((entry.key,), work, partial(self._committed, temp, old))

    async def touch_async(self, key: str, hits: int = 1) -> None:
        """Record a use (for LRU across restarts)."""
        record = self._record_use(key, hits)
        if record is not None:
            await self._in_thread((key,), partial(self.files.rewrite_record, key, record))

    async def remove_async(self, entry: Entry) -> None:
        """Drop `entry`, if it is still the one indexed under its key (else whoever replaced or
        forgot it has its files in hand)."""
        if self.entries.get(entry.key) is entry:
            self._forget(entry.key)
            await self._in_thread((entry.key,), partial(self.files.delete, [entry.key]))

    async def delete_files_async(self, victims: list[Entry]) -> None:
        """Delete the files of entries `select_victims` took out of the index."""
        keys = [e.key for e in victims]
        await self._in_thread(keys, partial(self.files.delete, keys))

    async def forget_removed_async(self) -> list[str]:
        """Forget entries whose commit marker someone else deleted (`kvproxy rm`, `gc`), so the
        budget and gauges stay true; the keys forgotten."""
        known = dict(self.entries)
        work = partial(self.files.missing_records, list(known))
        return await self._in_thread((), work, partial(self._forget_gone, known))

    def _in_thread(
        self,
        keys: Iterable[str],
        work: Callable[[], T],
        then: Callable[[T], R] | None = None,
    ) -> asyncio.Future[Any]:
        """Run `work()` in a thread once the operations issued earlier on `keys` are done, then
        `then(result)` on the loop. A task of its own that the caller's cancellation does not
        reach: a request whose client hung up neither lets a later operation on these keys
        overtake this one nor leaves the index behind the disk."""
        keys = list(keys)
        earlier = {self._last_op[k] for k in keys if k in self._last_op}
        task = asyncio.ensure_future(_after(earlier, work, then))
        for k in keys:
            self._last_op[k] = task
        task.add_done_callback(partial(self._op_done, keys))
        return asyncio.shield(task)

    def _op_done(self, keys: list[str], task: asyncio.Future[Any]) -> None:
        for k in keys:
            if self._last_op.get(k) is task:
                del self._last_op[k]

    # --- no event loop (kvproxy ls|rm|gc): index and files in the calling thread

    def open(self) -> None:
        """Create the directory, sweep what no commit covers, load the index."""
        self._install(self._open_dir())
        self._log_opened()

    def open_readonly(self) -> list[tuple[str, str]]:
        """Load the index without changing anything on disk, for `kvproxy ls|rm|gc` while a
        proxy may be using the directory (a sweep could delete its save in flight). Returns
        the (key, reason) of records skipped; FileNotFoundError when there is no cache dir."""
        if not self.root.is_dir():
            raise FileNotFoundError(f"no cache dir at {self.root}")
        self._install(self.files.load(sweep=False))
        return self.problems

    def commit(self, entry: Entry, temp: str) -> Entry:
        old = self._forget(entry.key)
        return self._committed(temp, old, self.files.commit(entry, temp))

    def remove(self, key: str) -> None:
        """Drop an entry: the commit marker goes first."""
        self._forget(key)
        self.files.delete([key])

    def remove_damaged(self, key: str) -> None:
        """Delete the files of a key that has no loadable entry (see `open_readonly`)."""
        if is_key(key) and key not in self.entries:
            self.files.delete([key])

    def delete_files(self, entries: list[Entry]) -> None:
        self.files.delete([e.key for e in entries])

    # --- reads and temp clean-up: no index, any thread

    def read_messages(self, key: str) -> list[Any] | None:
        return self.files.read_messages(key)

    def read_many_messages(self, keys: list[str]) -> list[tuple[str, list[Any]]]:
        return self.files.read_many_messages(keys)

    def check_state_file(self, entry: Entry) -> str | None:
        return self.files.check_state_file(entry)

    def discard_temp(self, temp: str) -> None:
        self.files.discard_temp(temp)

    def _open_dir(self) -> Loaded:
        self.files.create()
        return self.files.load(sweep=True)

    def _log_opened(self) -> None:
        log.info("cache dir %s: %d entries, %s", self.root, len(self.entries), self.total_bytes)


async def _after(
    earlier: set[asyncio.Future[Any]], work: Callable[[], T], then: Callable[[T], R] | None
) -> T | R:
    if earlier:
        await asyncio.wait(earlier)
    result = await asyncio.to_thread(work)
    return result if then is None else then(result)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _regular_size(path: Path) -> int:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return st.st_size


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
