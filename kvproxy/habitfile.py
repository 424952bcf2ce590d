"""The clients' habits (habits.py) kept in the cache dir, so a restarted proxy saves a
rewriting client's conversations as it will send them from the first save on, not only after
the client has shown its habit again. One small JSON file, written whole (a fixed temp name,
fsync, rename) when something new was learnt; private like everything in the cache dir."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("kvproxy.cache")

NAME = "habits.json"
MAX_BYTES = 1 << 20  # larger than kvproxy writes it: not read
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read(root: Path) -> Any | None:
    """What the file holds, or None (absent, not a regular file, too large, not JSON)."""
    path = root / NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            log.warning("ignoring %s: not a file kvproxy wrote", path)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return orjson.loads(f.read(MAX_BYTES + 1))
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    finally:
        os.close(fd)


def write(root: Path, data: Any) -> None:
    """Readers see the old file or the new one, never a part."""
    tmp, path = root / f".{NAME}.tmp", root / NAME
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(orjson.dumps(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
