"""A disk that fills up mid-run, for `chaos`: the cache dir lives on a size-limited tmpfs of
its own (mounting one needs root; without it the fault is reported as not run), which a
filler file fills to the last byte and later frees.

Both processes write there: llama-server its slot saves, kvproxy its index. While the disk is
full every save fails; kvproxy must go on serving (uncached), commit no entry whose files are
short, and cache again once the filler is gone.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

CHUNK = 1 << 20


@dataclass
class DiskRecord:
    size_mib: int
    filled_at_s: float = 0.0
    freed_at_s: float = 0.0
    filler_mib: float = 0.0
    requests_while_full: int = 0  # ended, answered or not
    saves_before: int = 0  # kvproxy's save counter when the disk filled
    saves_while_full: int | None = 0  # None: kvproxy restarted meanwhile (its counter too)
    saves_after: int = 0  # saves committed after it was freed, up to the workload's end
    faults_seen: str = ""  # what kvproxy's stats listed as failing while full


class TinyDisk:
    def __init__(self, mount: Path, size_mib: int) -> None:
        self.mount = mount
        self.size_mib = size_mib
        self.filler = mount / "filler"  # beside the cache dir, never in it
        self.mounted = False

    @property
    def cache_dir(self) -> Path:
        return self.mount / "cache"

    def setup(self) -> str | None:
        """Mounts the tmpfs; the reason it cannot, or None."""
        if os.geteuid() != 0:
            return "needs root (mount -t tmpfs)"
        self.mount.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size_mib}m,mode=0700", "tmpfs", self.mount],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return f"mount failed: {done.stderr.strip() or done.returncode}"
        self.mounted = True
        self.cache_dir.mkdir(mode=0o700)
        return None

    def fill(self) -> int:
        """Writes the filler until the filesystem has no byte left; returns its size."""
        written = 0
        block = b"\0" * CHUNK
        with open(self.filler, "wb", buffering=0) as f:
            while True:
                try:
                    n = f.write(block)
                except OSError:  # ENOSPC: a last smaller write may still fit
                    for size in (CHUNK // 16, 4096, 512, 1):
                        with contextlib.suppress(OSError):
                            while True:
                                written += f.write(b"\0" * size)
                    return written
                written += n or 0

    def free(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def teardown(self) -> None:
        self.free()
        if self.mounted:
            subprocess.run(["umount", "-l", self.mount], capture_output=True, check=False)
            self.mounted = False
