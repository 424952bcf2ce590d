"""Whether a kvproxy serves from a cache dir now.

Each running proxy holds a shared `flock` on the cache dir itself for its life, released by
the kernel however the process ends (SIGKILL too), so nothing stale is ever left to clean up;
several proxies on one dir each hold theirs. A command that must not touch a running
proxy's slots (`kvproxy doctor`'s probes) tries for an exclusive lock, without waiting: it
fails exactly while some proxy holds the dir. The dir is the one place both must name (the
server's --slot-save-path), so the doctor finds a proxy whatever port it listens on.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

log = logging.getLogger("kvproxy.store")


def hold(root: Path) -> int | None:
    """Mark the dir as served from (made if missing, private): the descriptor to keep open
    while serving, None when the dir cannot be opened (it is then reported as the store
    fails to open it; the doctor just does not see this proxy)."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        log.debug("not marking %s as served from: %s", root, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as exc:  # a filesystem without flock
        log.debug("not marking %s as served from: %s", root, exc)
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def served_from(root: Path) -> bool:
    """Does a kvproxy serve from `root` now?"""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # closing drops the lock taken
    return False
