"""Which kvproxy processes use a cache dir now, so that none deletes another's files in flight.

Several kvproxy may share a cache dir (one per server, or two started by mistake). Each holds
an exclusive `flock` on a lock file of its own, `owners/<token>.lock`, while its store is open:
the kernel releases it when the process ends, however it ends, so a lock file nobody holds is
a dead owner's (and is removed). Every temp file a kvproxy makes carries its token
(`<key>.<token>-<random>.tmp`): the start-up sweep deletes temp files of dead owners only, and
files no index row covers (a save renamed into place and not yet committed) only while no
other owner is alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from pathlib import Path

OWNERS = "owners"
LOCK_SUFFIX = ".lock"
TOKEN_HEX = 8  # characters of a token
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class Owner:
    """This process's hold on a cache dir, from `take` until `release`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = secrets.token_hex(TOKEN_HEX // 2)
        self._fd: int | None = None

    @property
    def path(self) -> Path:
        return self.root / OWNERS / f"{self.token}{LOCK_SUFFIX}"

    def take(self) -> None:
        if self._fd is not None:
            return
        (self.root / OWNERS).mkdir(mode=0o700, exist_ok=True)
        # Locked under another name first: a lock file is never seen unlocked while alive.
        tmp = self.path.with_name(f".{self.token}.new")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = None

    def others(self) -> set[str]:
        """Tokens of the other owners alive now (lock files of dead ones are removed)."""
        return alive(self.root) - {self.token}


def alive(root: Path) -> set[str]:
    """Tokens of the owners holding their lock now."""
    found: set[str] = set()
    try:
        names = os.listdir(root / OWNERS)
    except OSError:
        return found
    for name in names:
        if not name.endswith(LOCK_SUFFIX):
            continue
        path = root / OWNERS / name
        try:
            fd = os.open(path, os.O_RDWR | _NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            found.add(name[: -len(LOCK_SUFFIX)])
        except OSError:
            pass
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)  # a dead owner's, taken (and so released) by nobody else
        finally:
            os.close(fd)
    return found


def token_of(temp_name: str) -> str | None:
    """The owner token a temp file's name carries (`<key>.<token>-<random>.tmp…`), None for
    a name of an older kvproxy (no owner)."""
    parts = temp_name.split(".")
    if len(parts) < 3:
        return None
    token, dash, _ = parts[1].partition("-")
    return token if dash and len(token) == TOKEN_HEX else None


def stale_temp(name: str, mine: str, others: set[str]) -> bool:
    """A temp file nobody alive will finish: its owner's when its name carries one (not
    `mine`, nor one of `others` alive), else any while no other kvproxy is alive."""
    owner = token_of(name)
    if owner is None:
        return not others
    return owner != mine and owner not in others
