"""A state file's check against its commit checksum (store/verify.py): what the restore waits
for beside the server's read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvproxy.store import Store, verify

from .test_store import save


def damage(path: Path) -> None:
    """Other bytes, same size and header: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[-8:] = b"\xff" * 8
    path.write_bytes(bytes(data))


def counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The files the check reads from now on."""
    hashed: list[int] = []
    real = verify.hash_file

    def counted(digest: Any, suffix: str, fd: int) -> None:
        hashed.append(fd)
        real(digest, suffix, fd)

    monkeypatch.setattr(verify, "hash_file", counted)
    return hashed


@pytest.mark.parametrize("sidecar", [False, True])
def test_a_fresh_commit_checks_out(tmp_path: Path, sidecar: bool) -> None:
    """The check computes what the commit recorded (sidecars in the same order), read by a
    process that did not commit it (the memo of the commit's own hash left out)."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 2, size=3 * 1000 + 7, sidecar=sidecar)
    assert entry.checksum
    store.files.verified.forget(entry.key)
    assert store.files.verify_checksum(entry) is None


def test_a_state_just_committed_is_not_read_again_at_its_first_restore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit hashed it a moment ago: the conversation's next turn waits for no second
    read of it (and a change since is still caught, below)."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 2, size=50_000)
    hashed = counting(monkeypatch)
    assert store.files.verify_checksum(entry) is None
    assert hashed == []
    damage(store.files.state_files(entry)[0])
    assert "checksum mismatch" in (store.files.verify_checksum(entry) or "")


def test_an_empty_file_hashes_like_the_commit(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 1, sidecar=True)
    side = store.files.state_files(entry)[1]
    side.write_bytes(b"")
    # Recommit the same key: the recorded checksum now covers an empty sidecar.
    temp = store.temp_name(entry.key)
    (tmp_path / temp).write_bytes(store.files.state_files(entry)[0].read_bytes())
    (tmp_path / f"{temp}.ckpt").write_bytes(b"")
    again = store.commit(entry, temp)
    store.files.verified.forget(again.key)
    assert store.files.verify_checksum(again) is None


def test_an_unchanged_file_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An opening restored for many conversations is hashed once, not at every restore."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 2, size=50_000)
    store.files.verified.forget(entry.key)  # as a process that did not commit it
    hashed = counting(monkeypatch)
    assert store.files.verify_checksum(entry) is None
    assert store.files.verify_checksum(entry) is None
    assert store.files.verify_checksum(entry) is None
    assert len(hashed) == 1


def test_a_file_checked_once_then_damaged_is_caught(tmp_path: Path) -> None:
    """Remembering a check never hides a change: a write moves the file's ctime."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 2, size=50_000)
    assert store.files.verify_checksum(entry) is None
    damage(store.files.state_files(entry)[0])
    assert "checksum mismatch" in (store.files.verify_checksum(entry) or "")


def test_a_file_replaced_by_another_is_caught(tmp_path: Path) -> None:
    """Renamed over (a new inode), the same size and times set back: still hashed again."""
    store = Store(tmp_path, ttl=3600, max_bytes=0)
    entry = save(store, 2, size=50_000)
    kv = store.files.state_files(entry)[0]
    assert store.files.verify_checksum(entry) is None
    st = kv.stat()
    other = tmp_path / "other"
    data = bytearray(kv.read_bytes())
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, kv)
    assert "checksum mismatch" in (store.files.verify_checksum(entry) or "")
