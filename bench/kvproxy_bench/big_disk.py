"""`big`'s measurements of the machine itself, beside the servers: the disk's own read and
write of a state's size, the tokens a slot save file holds (to tell whose state a file is),
and a process's resident memory, sampled while a run goes on."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvproxy_bench.restore import drop_from_page_cache, read_times

__all__ = ["drop_from_page_cache", "read_times"]

STATE_MAGIC = 0x67677371  # llama_state_seq_save_file's "ggsq"
WRITE_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class DiskWrite:
    """A plain write of `bytes` into the cache dir's file system: into the page cache
    (`write_s`), then to the disk (`fsync_s`, after the write)."""

    bytes: int
    write_s: float
    fsync_s: float

    @property
    def total_s(self) -> float:
        return self.write_s + self.fsync_s


def disk_write(directory: Path, n_bytes: int) -> DiskWrite:
    """Blocking: write `n_bytes` (incompressible) beside the states, fsync, remove it; the
    file is dropped from the page cache too, so it leaves the cache as it found it."""
    path = directory / f".bench-write-{os.getpid()}.tmp"
    chunk = os.urandom(WRITE_CHUNK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        started = time.perf_counter()
        left = n_bytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, WRITE_CHUNK)])
        written = time.perf_counter()
        os.fsync(fd)
        synced = time.perf_counter()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
    return DiskWrite(n_bytes, written - started, synced - written)


def state_tokens(path: Path) -> list[int]:
    """The tokens a llama-server slot save file holds (its header's token words: `-1, 1,
    n, tokens…` or a plain list from older servers); [] when it is not such a file."""
    try:
        with open(path, "rb") as f:
            head = f.read(12)
            if len(head) < 12:
                return []
            magic, _version, n_words = struct.unpack("<III", head)
            if magic != STATE_MAGIC:
                return []
            raw = f.read(4 * n_words)
    except OSError:
        return []
    words = list(struct.unpack(f"<{len(raw) // 4}i", raw[: len(raw) // 4 * 4]))
    if words[:1] == [-1] and len(words) >= 3:
        return words[3 : 3 + words[2]]
    return words


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def files_of(cache_dir: Path, tokens: list[int], share: int) -> list[Path]:
    """Blocking: the state files (`*.kv`) that hold at least `share` of `tokens` as their
    own first tokens — one conversation's states, whatever kvproxy named them."""
    found = []
    for path in cache_dir.glob("*.kv"):
        if common_prefix(state_tokens(path), tokens) >= share:
            found.append(path)
    return found


def restored_file(cache_dir: Path, tokens: list[int]) -> Path | None:
    """Blocking: the state file a restore for a request of `tokens` would pick: the one that
    shares the longest start with it (the newest on a tie)."""
    best: tuple[int, float, Path] | None = None
    for path in cache_dir.glob("*.kv"):
        try:
            mtime = path.stat().st_mtime
        except OSError:
            continue
        shared = common_prefix(state_tokens(path), tokens)
        if shared and (best is None or (shared, mtime) > best[:2]):
            best = (shared, mtime, path)
    return best[2] if best is not None else None


def rss_bytes(pid: int) -> int | None:
    """VmRSS of a process (Linux /proc), None when it is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


@dataclass
class RssSample:
    seconds: float  # since the sampler started
    rss: int
    phase: str


@dataclass
class RssSampler:
    """Samples the RSS of whatever process `pid()` names (None: none now, e.g. across a
    restart) every `interval` seconds, labelled with the phase the run says it is in."""

    pid: Callable[[], int | None]
    interval: float = 0.25
    phase: str = "start"
    samples: list[RssSample] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        began = time.perf_counter()
        while True:
            pid = self.pid()
            rss = rss_bytes(pid) if pid is not None else None
            if rss is not None:
                self.samples.append(RssSample(time.perf_counter() - began, rss, self.phase))
            await asyncio.sleep(self.interval)
