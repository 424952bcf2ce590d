"""Checking a state file against the checksum its commit recorded, at the cost of no time the
restore did not already take.

A restore waits for two readers of the same file: the server's `action=restore` and this
check, started together (cache/slotio/slotwork.py), the request forwarded only once both are
done and the check passed. So the check must never be the slower one:

- it reads the file in large chunks into one reused buffer and hashes each (the GIL released
  for both; no new Python object a chunk; not `mmap`, where a file truncated meanwhile would
  kill the process with SIGBUS): from the page cache it hashes 1 GiB in ~0.15 s on this
  project's 2-core machine, faster than the server loads the same bytes into its KV cache,
  and cold it reads what the server is about to read (or reads from the page cache what the
  server just read), so the disk sees one pass, not two;
- a file this process has hashed since its last change is not hashed again: the identity
  `lstat` gives (device, inode, size, mtime, ctime) is remembered with the checksum it matched,
  and a later restore of the unchanged file (an opening or a stem restored for many
  conversations, a branch of one) reads nothing. Any write, truncation, rename over it or
  `utime` moves its ctime, which nobody can set back, so a changed file is hashed again.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvproxy.store.fileops import open_regular

CHUNK = 8 << 20  # bytes read, then hashed, at a time (the GIL released for both)
MAX_REMEMBERED = 4096  # files whose check is remembered; the oldest forgotten first

Identity = tuple[int, int, int, int, int]


def identity(path: Path) -> Identity:
    """What changes whenever the file's content can have changed; ValueError if it is not a
    regular file (a symlink is not followed)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def hash_file(digest: Any, suffix: str, fd: int) -> None:
    """Add one state file (its name's suffix after `<key>.kv`, then its bytes, read through
    `fd`) to `digest`: the same digest files.py's commit computes."""
    digest.update(suffix.encode() + b"\0")
    with contextlib.suppress(OSError, AttributeError):  # a deeper read-ahead when cold
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    try:
        while n := os.readv(fd, [buf]):
            digest.update(view[:n])
    finally:
        view.release()


class Verified:
    """The files this process found matching their checksum, by identity. Any thread may
    use it."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, tuple[tuple[Identity, ...], str]] = OrderedDict()
        self._lock = threading.Lock()

    def known(self, key: str, ids: Sequence[Identity], checksum: str) -> bool:
        with self._lock:
            return self._seen.get(key) == (tuple(ids), checksum)

    def remember(self, key: str, ids: Sequence[Identity], checksum: str) -> None:
        with self._lock:
            self._seen[key] = (tuple(ids), checksum)
            self._seen.move_to_end(key)
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)

    def check(self, key: str, checksum: str, paths: Sequence[Path], state: str) -> str | None:
        """Do the files of entry `key` (state file named `state` first, then its sidecars,
        sorted by name) hash to `checksum`? The reason they do not, if so."""
        try:
            ids = [identity(p) for p in paths]
            if self.known(key, ids, checksum):
                return None
            digest = xxhash.xxh3_128()
            for p in paths:
                fd = open_regular(p)
                try:
                    hash_file(digest, p.name[len(state) :], fd)
                finally:
                    os.close(fd)
        except (OSError, ValueError) as exc:
            self.forget(key)
            return str(exc)
        if digest.hexdigest() != checksum:
            self.forget(key)
            return "checksum mismatch: the state file changed since it was saved"
        self.remember(key, ids, checksum)
        return None

    def forget(self, key: str) -> None:
        with self._lock:
            self._seen.pop(key, None)
