"""Plain file operations on the cache dir: regular files only (never a FIFO, a device or
through a symlink), and fsync."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

# Opening never blocks (a FIFO would block until a writer comes) and follows no symlink.
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def regular_size(path: Path) -> int:
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path.name} is not a regular file")
    return st.st_size


def open_regular(path: Path) -> int:
    """A read-only fd of `path`, checked to be a regular file; ValueError if it is not."""
    fd = os.open(path, READ_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path.name} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def fsync_file(path: Path) -> None:
    _fsync(path, READ_FLAGS)


def fsync_dir(path: Path) -> None:
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
