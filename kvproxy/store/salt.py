"""The cache dir's tenant salt: a secret of this install, mixed into every tenant's hash.

A tenant is a hash of the key (or tenant header) a client sends (keys.tenant_of), and it
goes into every conversation key, so into the file names of the cache dir. Unsalted, anyone
who knows a client's key, or guesses it, could tell that tenant's files and status rows from
the hash alone. The salt is made once, at random, and kept in the cache dir (private, like
everything there) so a restarted proxy, or another one sharing the dir, finds the same
tenants' states again. A new salt (a new cache dir, or the file deleted) only makes each
stored conversation miss once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import time
from pathlib import Path

log = logging.getLogger("kvproxy.cache")

SALT_NAME = "tenant-salt"
SALT_BYTES = 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def load_or_create(root: Path) -> bytes:
    """The salt in `root`, created if there is none. Creation is atomic: the salt is
    written whole under a private temp name, then linked to its name, which fails if another
    process got there first (then its salt is the one read). A file that is not a salt
    kvproxy wrote (another size, not hex, not a regular file) is moved aside and replaced."""
    path = root / SALT_NAME
    found = _read(path)
    if found is not None:
        return found
    tmp = root / f".{SALT_NAME}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(secrets.token_hex(SALT_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    found = _read(path)
    if found is None:
        raise OSError(f"{path}: the tenant salt cannot be read back")
    return found


def _read(path: Path) -> bytes | None:
    """The salt, or None when there is none (a bad one is moved aside first)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # a symlink (ELOOP), unreadable: not ours
        _set_aside(path, str(exc))
        return None
    try:
        text = b""
        if stat.S_ISREG(os.fstat(fd).st_mode):
            with os.fdopen(fd, "rb", closefd=False) as f:
                text = f.read(2 * SALT_BYTES + 1)
    finally:
        os.close(fd)
    try:
        salt = bytes.fromhex(text.decode("ascii"))
    except ValueError:
        salt = b""
    if len(salt) != SALT_BYTES:
        _set_aside(path, "not a salt kvproxy wrote")
        return None
    return salt


def _set_aside(path: Path, why: str) -> None:
    aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
    log.warning(
        "%s: %s; moved aside to %s, a new salt made (stored conversations miss once)",
        path,
        why,
        aside,
    )
    os.rename(path, aside)
