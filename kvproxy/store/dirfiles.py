"""Small JSON files kvproxy keeps in the cache dir besides the index and the states, each
written whole (a fixed temp name, fsync, rename), private like everything there, and read
without trusting what is found (a FIFO, a symlink, garbage: nothing).

- habits.json: the clients' habits (cache/habits/), so a restarted proxy saves a rewriting
  client's conversations as it will send them from the first save on, not only after the
  client has shown its habit again; written when something new was learnt.
- llama-server.json: the llama-server managed mode started (leftover.py), so the next start
  can stop one that a killed kvproxy left running."""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger("kvproxy.cache")

HABITS = "habits.json"
SERVER = "llama-server.json"
MAX_BYTES = 1 << 20  # larger than kvproxy writes it: not read
# habits.json is read up to this (an older kvproxy wrote it unbounded): what is read is then
# trimmed to the bounds (cache/habits/), never discarded whole. A larger one is moved aside.
HABITS_READ_LIMIT = 64 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def read(root: Path, name: str, limit: int = MAX_BYTES) -> Any | None:
    """What the file holds, or None (absent, not a regular file, too large, not JSON). A
    regular file past `limit` is renamed `<name>.too-large-<time>`, so it is never
    overwritten by the next write: an operator can still look at it."""
    path = root / name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("ignoring %s: not a file kvproxy wrote", path)
            return None
        if st.st_size > limit:
            aside = root / f"{name}.too-large-{int(time.time())}"
            log.warning("%s is larger than %d bytes: moved aside to %s", path, limit, aside)
            with contextlib.suppress(OSError):
                os.rename(path, aside)
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return orjson.loads(f.read(limit + 1))
    except (OSError, orjson.JSONDecodeError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return None
    finally:
        os.close(fd)


def write(root: Path, name: str, data: Any) -> None:
    """Readers see the old file or the new one, never a part."""
    tmp, path = root / f".{name}.tmp", root / name
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


def remove(root: Path, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / name)
