"""The cache dir's files, shared with llama-server: `StoreFiles`, pure file I/O.

An entry is `<key>.kv` (written by llama-server's slot save), any checkpoint sidecar a server
build writes beside it (`<key>.kv.<anything>`), optionally `<key>.msgs` (the conversation as
the client will echo it, JSON, for explaining misses), and `<key>.idx`, the JSON index
record. The `.idx` is written last (temp file, fsync, rename) and deleted first, so it is the
commit marker: a file without one is never used and is swept at start-up. Files are opened
with O_NOFOLLOW and O_NONBLOCK (a FIFO never blocks) and must be regular files.

Who touches what. `StoreFiles` keeps no index: its methods take plain data (keys, serialised
records, entries nobody changes meanwhile) and return plain data (what was loaded, which
records are gone, the committed entry), so any thread may run them. Keeping two operations on
one key apart, and the in-memory index, are `Store`'s job (`kvproxy.store.index`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson
import xxhash

from ..keys import is_key
from .entry import Entry

log = logging.getLogger("kvproxy.store")

TMP_MARK = ".tmp"
STATE_MAGIC = 0x67677371
MSGS_SUFFIX = ".msgs"
# Index records are small; a conversation's text can be large. Beyond this its text is not
# kept (misses against that entry just go unexplained).
MAX_IDX_BYTES = 1 << 20
MAX_MSGS_BYTES = 16 << 20


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
        fd = _open_regular(path)
        try:
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
        digest = xxhash.xxh3_128()
        for src, dst in sorted(moved, key=lambda pair: pair[1].name):
            size += _regular_size(src)
            with contextlib.suppress(OSError):
                os.chmod(src, 0o600)
            _hash_into(digest, src, dst.name[len(state) :])
            _fsync_file(src)
            os.replace(src, dst)
        msgs_bytes = self._write_messages(key, entry.messages) if entry.messages else 0
        # The text is on disk now: kept out of memory and out of the index record.
        committed = replace(
            entry,
            state_bytes=size,
            msgs_bytes=msgs_bytes,
            checksum=digest.hexdigest(),
            messages=None,
        )
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
            if size != entry.state_bytes:
                return f"size {size} != recorded {entry.state_bytes}"
            fd = _open_regular(path)
            with os.fdopen(fd, "rb") as fh:
                head = fh.read(12)
        except (OSError, ValueError) as exc:
            return str(exc)
        if len(head) < 12 or int.from_bytes(head[:4], "little") != STATE_MAGIC:
            return "not a llama.cpp slot state file"
        return None

    def verify_checksum(self, entry: Entry) -> str | None:
        """Size and header survive a damaged tensor, and a damaged state answers garbage where
        the server alone answers right: the files must hash as they did at commit. Reads
        every byte, so the caller runs it beside the server's own read of the file."""
        if not entry.checksum:
            return None  # a record from before checksums: size and header only
        digest = xxhash.xxh3_128()
        state = self.state_name(entry.key)
        try:
            for p in sorted(self._entry_files(entry.key), key=lambda f: f.name):
                _hash_into(digest, p, p.name[len(state) :])
        except (OSError, ValueError) as exc:
            return str(exc)
        if digest.hexdigest() != entry.checksum:
            return "checksum mismatch: the state file changed since it was saved"
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


def _hash_into(digest: Any, path: Path, suffix: str) -> None:
    """Add one state file (its name's suffix after `<key>.kv`, then its bytes) to `digest`."""
    digest.update(suffix.encode() + b"\0")
    fd = _open_regular(path)
    with os.fdopen(fd, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _regular_size(path: Path) -> int:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return st.st_size


# Opening never blocks (a FIFO would block until a writer comes) and follows no symlink.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def _open_regular(path: Path) -> int:
    """A read-only fd of `path`, checked to be a regular file; ValueError if it is not."""
    fd = os.open(path, _READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_file(path: Path) -> None:
    _fsync(path, _READ_FLAGS)


def _fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
