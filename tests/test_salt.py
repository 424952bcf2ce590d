"""The tenant salt (store/salt.py): made once per cache dir, private, kept across restarts."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvproxy.store import Store
from kvproxy.store.salt import SALT_BYTES, SALT_NAME, load_or_create


def test_the_salt_is_made_private_and_kept(tmp_path: Path) -> None:
    salt = load_or_create(tmp_path)
    assert len(salt) == SALT_BYTES
    mode = stat.S_IMODE((tmp_path / SALT_NAME).stat().st_mode)
    assert mode == 0o600
    assert load_or_create(tmp_path) == salt  # a restart finds the same tenants' states
    assert [p.name for p in tmp_path.iterdir()] == [SALT_NAME]  # no temp file left


def test_two_installs_salt_differently(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert load_or_create(tmp_path / "a") != load_or_create(tmp_path / "b")


def test_a_file_that_is_no_salt_is_moved_aside_and_replaced(tmp_path: Path) -> None:
    (tmp_path / SALT_NAME).write_text("guessable")
    salt = load_or_create(tmp_path)
    assert len(salt) == SALT_BYTES and load_or_create(tmp_path) == salt
    assert any(p.name.startswith(f"{SALT_NAME}.bad-") for p in tmp_path.iterdir())


def test_a_symlink_in_its_place_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere"
    secret.write_text("ab" * SALT_BYTES)  # a valid-looking salt an attacker chose
    os.symlink(secret, tmp_path / SALT_NAME)
    assert load_or_create(tmp_path) != bytes.fromhex("ab" * SALT_BYTES)
    assert not (tmp_path / SALT_NAME).is_symlink()


async def test_the_proxys_store_reads_the_same_salt_after_a_restart(tmp_path: Path) -> None:
    first = Store(tmp_path / "cache", 3600, 1 << 30)
    await first.open_async()
    salt = first.tenant_salt
    first.close()
    again = Store(tmp_path / "cache", 3600, 1 << 30)
    await again.open_async()
    try:
        assert len(salt) == SALT_BYTES and again.tenant_salt == salt
    finally:
        again.close()
