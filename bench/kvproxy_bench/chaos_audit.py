"""The cache dir after a chaos run, checked as a restore would check it, changing nothing.

Committed: every row of the index (`index.sqlite3`, the commit marker). Valid: its state file
and sidecars are regular files of the recorded size with a llama.cpp header, and they hash to
the recorded checksum. Orphaned: any other file (temp files of a save a SIGKILL cut short, a
state file whose row was never written); start-up sweeps those, they are never served.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvproxy.store.db import DB_NAME, IndexDB
from kvproxy.store.files import TMP_MARK, StoreFiles


@dataclass
class Audit:
    committed: int = 0
    valid: int = 0
    without_checksum: int = 0  # valid by size and header only (records from before checksums)
    invalid: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    orphaned: list[str] = field(default_factory=list)  # file names
    state_bytes: int = 0


def audit(root: Path) -> Audit:
    """Blocking file I/O: run it in a thread, with no kvproxy using the directory."""
    files = StoreFiles(root)
    out = Audit()
    committed: set[str] = set()
    if (root / DB_NAME).exists():
        db = IndexDB(root, create=False)
        try:
            entries = list(db.oldest())
        finally:
            db.close()
        for entry in entries:
            committed.add(entry.key)
            problem = files.check_state_file(entry) or files.verify_checksum(entry)
            if problem is not None:
                out.invalid.append((entry.key, problem))
                continue
            out.valid += 1
            out.without_checksum += not entry.checksum
            out.state_bytes += entry.state_bytes
    with os.scandir(root) as it:
        names = sorted(de.name for de in it if not de.name.startswith(DB_NAME))
    out.committed = len(committed)
    out.orphaned = [n for n in names if TMP_MARK in n or n.split(".", 1)[0] not in committed]
    return out
