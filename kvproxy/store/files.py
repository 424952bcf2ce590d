"""The cache dir's files, shared with llama-server: `StoreFiles`, pure file I/O.

An entry is `<key>.kv` (written by llama-server's slot save), any checkpoint sidecar a server
build writes beside it (`<key>.kv<suffix>`, suffixes in `SIDECAR_SUFFIXES`), and optionally
`<key>.msgs` (the conversation as the client will echo it, JSON, for explaining misses). The
commit marker is the entry's row in the index (`kvproxy.store.db`), written after the files
are renamed into place and fsynced, and deleted before them: a file without a row is never
used and is swept at start-up. Every name is derived from the key and the row, never searched
for: no directory scan outside start-up. Files are opened with O_NOFOLLOW and O_NONBLOCK (a
FIFO never blocks) and must be regular files.

kvproxy before the SQLite index kept a `<key>.idx` JSON record per entry instead; `scan`
reads those once, at the first open, for the index to import.

Who touches what. `StoreFiles` keeps no index: its methods take plain data (keys, entries
nobody changes meanwhile) and return plain data, so any thread may run them. Keeping two
operations on one key apart, and the index, are `Store`'s job (`kvproxy.store.store`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import xxhash

from kvproxy.keys import is_key
from kvproxy.store import fileops
from kvproxy.store.entry import Entry
from kvproxy.store.owners import Owner, stale_temp
from kvproxy.store.verify import Verified, hash_file, identity

log = logging.getLogger("kvproxy.store")

TMP_MARK = ".tmp"
STATE_MAGIC = 0x67677371
MSGS_SUFFIX = ".msgs"
IDX_SUFFIX = ".idx"
# The sidecars a save may leave beside its state file (the checkpoint file of server builds
# that write one; llama-server's slot save itself writes the one file, server-context.cpp
# SERVER_TASK_TYPE_SLOT_SAVE): probed by name at commit.
SIDECAR_SUFFIXES = (".ckpt",)
# Index records are small; a conversation's text can be large. Beyond this its text is not
# kept (misses against that entry just go unexplained).
MAX_IDX_BYTES = 1 << 20
MAX_MSGS_BYTES = 16 << 20
Steps = Callable[[str, int, int], None]  # a long open's progress: (what, done, total)


@dataclass
class Scanned:
    """What the start-up scan of the cache dir found."""

    imported: list[Entry] = field(default_factory=list)  # from `.idx` records, files checked
    records: list[str] = field(default_factory=list)  # keys of `.idx` files seen
    missing: list[str] = field(default_factory=list)  # indexed keys whose state file is gone
    problems: list[tuple[str, str]] = field(default_factory=list)  # (key, reason) skipped


class StoreFiles:
    """The cache dir's files: reads, commits and deletions, no index. Any thread may call
    these; keeping two operations on one key apart is the caller's job (see `Store`)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.owner = Owner(root)  # taken by a proxy's open (owners.py)
        self.verified = Verified()  # files that hashed right since their last change

    # --- names

    @staticmethod
    def state_name(key: str) -> str:
        return f"{key}.kv"

    def temp_name(self, key: str) -> str:
        """Carries this process's owner token: no other kvproxy's sweep deletes it."""
        return f"{key}.{self.owner.token}-{secrets.token_hex(4)}{TMP_MARK}"

    def _idx_path(self, key: str) -> Path:
        return self.root / f"{key}{IDX_SUFFIX}"

    def _msgs_path(self, key: str) -> Path:
        return self.root / f"{key}{MSGS_SUFFIX}"

    def state_files(self, entry: Entry) -> list[Path]:
        """The state file and its sidecars, by name."""
        state = self.root / self.state_name(entry.key)
        return [state] + [Path(f"{state}{s}") for s in sorted(entry.sidecars)]

    # --- start-up

    def create(self) -> None:
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(self.root, 0o700)

    def scan(self, known: Collection[str], sweep: bool, progress: Steps | None = None) -> Scanned:
        """One pass over the cache dir at start-up: read the `.idx` records of keys the index
        does not know (checking their files), and note indexed keys whose state file is gone.
        With `sweep`, also delete what no row or record covers (only what is stale while
        another kvproxy uses the dir: owners.py): temp files, files of keys nobody
        committed, unreadable records and entries whose files do not check out."""
        out = Scanned()
        others = self.owner.others() if sweep else set()
        with os.scandir(self.root) as it:
            names = [de.name for de in it]
        by_key: dict[str, list[str]] = {}
        for name in names:
            key = name.split(".", 1)[0]
            if TMP_MARK in name:
                if sweep and is_key(key) and stale_temp(name, self.owner.token, others):
                    fileops.unlink(self.root / name)
            elif is_key(key):
                by_key.setdefault(key, []).append(name[len(key) :])
        if others:
            sweep = False  # a file no row covers may be another kvproxy's save, committing
        todo = sum(1 for k, s in by_key.items() if IDX_SUFFIX in s and k not in known)
        read = 0
        for key, suffixes in by_key.items():
            if IDX_SUFFIX in suffixes:
                out.records.append(key)
            if key in known:
                continue
            entry = self._import(key, suffixes, out.problems) if IDX_SUFFIX in suffixes else None
            if IDX_SUFFIX in suffixes and progress is not None:
                read += 1
                progress("reading old records", read, todo)
            if entry is not None:
                out.imported.append(entry)
            elif sweep:
                if IDX_SUFFIX in suffixes:
                    log.warning("dropping entry %s: %s", key[:12], out.problems[-1][1])
                for suffix in suffixes:
                    if suffix != IDX_SUFFIX:
                        log.info("sweeping uncommitted file %s%s", key, suffix)
                    fileops.unlink(self.root / f"{key}{suffix}")
        out.missing = [k for k in known if ".kv" not in by_key.get(k, ())]
        return out

    def _import(
        self, key: str, suffixes: list[str], problems: list[tuple[str, str]]
    ) -> Entry | None:
        """The entry a `.idx` record of kvproxy before the SQLite index commits, if its
        record reads and its files check out; else None, with the reason in `problems`."""
        try:
            entry = Entry.from_json(self._read_regular(self._idx_path(key), MAX_IDX_BYTES))
            if entry.key != key:
                raise ValueError("record names another key")
        except (OSError, ValueError, TypeError) as exc:
            problems.append((key, f"unreadable index record: {exc}"))
            return None
        entry.sidecars = tuple(sorted(s[3:] for s in suffixes if s.startswith(".kv.")))
        problem = self.check_state_file(entry)
        if problem is not None:
            problems.append((key, problem))
            return None
        # What is on disk counts against the budget, whatever the record says.
        entry.msgs_bytes = self._msgs_size(key) if MSGS_SUFFIX in suffixes else 0
        return entry

    def drop_records(self, keys: Iterable[str]) -> None:
        """Delete imported `.idx` records (their rows are committed): an older kvproxy that
        opens the dir then finds no record and sweeps the entries rather than trusting
        records the index may since have replaced."""
        for key in keys:
            fileops.unlink(self._idx_path(key))
        fileops.fsync_dir(self.root)

    def _msgs_size(self, key: str) -> int:
        """The size of `<key>.msgs`, 0 if it is missing or not a regular file."""
        try:
            return fileops.regular_size(self._msgs_path(key))
        except (OSError, ValueError):
            return 0

    @staticmethod
    def _read_regular(path: Path, limit: int) -> bytes:
        fd = fileops.open_regular(path)
        try:
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read(limit)
        finally:
            os.close(fd)

    # --- commits

    def commit(self, entry: Entry, temp: str, old: Entry | None) -> Entry | None:
        """Move a finished save from its temp name to `<key>.kv*`, fsynced, and write the
        text; the caller then commits the row. `old`: the entry this one replaces (its row is
        already gone), whose files not overwritten are deleted.

        Returns the entry to commit (sizes and sidecars filled in, text dropped; `entry` is
        left as it was), or None when llama-server wrote no file named `temp`: then nothing
        was changed.
        """
        key = entry.key
        state = self.state_name(key)
        src = self.root / temp
        if not src.exists():
            return None
        moved = [(src, self.root / state)]
        sidecars = []
        for suffix in SIDECAR_SUFFIXES:
            side = Path(f"{src}{suffix}")
            if side.exists():
                moved.append((side, self.root / f"{state}{suffix}"))
                sidecars.append(suffix)
        if old is not None:
            for path in self.state_files(old)[1:]:
                if all(path != dst for _, dst in moved):
                    fileops.unlink(path)
        fileops.unlink(self._msgs_path(key))
        size = 0
        digest = xxhash.xxh3_128()
        hashed: list[tuple[Path, int, int]] = []  # each file as it was when hashed
        for src_path, dst in sorted(moved, key=lambda pair: pair[1].name):
            before = os.lstat(src_path)
            size += fileops.regular_size(src_path)
            with contextlib.suppress(OSError):
                os.chmod(src_path, 0o600)
            fd = fileops.open_regular(src_path)
            try:
                hash_file(digest, dst.name[len(state) :], fd)
            finally:
                os.close(fd)
            fileops.fsync_file(src_path)
            os.replace(src_path, dst)
            hashed.append((dst, before.st_size, before.st_mtime_ns))
        msgs_bytes = self._write_messages(key, entry.messages) if entry.messages else 0
        # The renames are durable before the row that commits them is written.
        fileops.fsync_dir(self.root)
        checksum = digest.hexdigest()
        self._checked(key, hashed, checksum)
        # The text is on disk now: kept out of memory and out of the index.
        return replace(
            entry,
            state_bytes=size,
            msgs_bytes=msgs_bytes,
            checksum=checksum,
            sidecars=tuple(sidecars),
            messages=None,
        )

    def _checked(self, key: str, hashed: list[tuple[Path, int, int]], checksum: str) -> None:
        """The files a commit just hashed are known to match: the state's first restore (the
        conversation's next turn, often seconds later) need not read it a second time. Only
        if nothing wrote to them while they were hashed (their size and mtime as before)."""
        try:
            ids = [identity(dst) for dst, _, _ in hashed]
        except (OSError, ValueError):
            return
        if all(i[2] == n and i[3] == mtime for i, (_, n, mtime) in zip(ids, hashed, strict=True)):
            self.verified.remember(key, ids, checksum)

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

    def _write_atomic(self, path: Path, key: str, data: bytes) -> None:
        """Temp file (swept at start-up if we die), fsync, rename: readers see all or nothing."""
        tmp = self.root / f"{self.temp_name(key)}{path.suffix}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            fileops.unlink(tmp)
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
        """Cheap checks before asking the server to load a file; the reason it is bad, if so.
        A few `lstat`s of derived names and a 12-byte read."""
        path = self.root / self.state_name(entry.key)
        try:
            size = sum(fileops.regular_size(p) for p in self.state_files(entry))
            if size != entry.state_bytes:
                return f"size {size} != recorded {entry.state_bytes}"
            fd = fileops.open_regular(path)
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
        every byte, so the caller runs it beside the server's own read of the file; a file
        that hashed right since its last change is not read again (verify.py)."""
        if not entry.checksum:
            return None  # a record from before checksums: size and header only
        paths = sorted(self.state_files(entry), key=lambda f: f.name)
        return self.verified.check(entry.key, entry.checksum, paths, self.state_name(entry.key))

    # --- deleting

    def delete(self, entries: Iterable[Entry]) -> None:
        """Delete entries' files (their rows are gone already)."""
        for entry in entries:
            for path in [*self.state_files(entry), self._msgs_path(entry.key)]:
                with contextlib.suppress(OSError):
                    fileops.unlink(path)
            with contextlib.suppress(OSError):
                fileops.unlink(self._idx_path(entry.key))  # a record a downgrade may have left

    def delete_key(self, key: str) -> None:
        """Delete the files a key with no row may have (a damaged record): every derived
        name, with each known sidecar."""
        state = self.root / self.state_name(key)
        names = [state, *(Path(f"{state}{s}") for s in SIDECAR_SUFFIXES)]
        for path in [self._idx_path(key), *names, self._msgs_path(key)]:
            with contextlib.suppress(OSError):
                fileops.unlink(path)

    def discard_temp(self, temp: str) -> None:
        for path in [self.root / temp, *(self.root / f"{temp}{s}" for s in SIDECAR_SUFFIXES)]:
            with contextlib.suppress(OSError):
                fileops.unlink(path)
