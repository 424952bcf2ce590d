"""Progress where a user waits on the cache commands: a long `kvproxy gc`, and the first open
of an old cache dir (its `.idx` records imported once, by any command), show one line
rewritten in place on a terminal and cleared at the end; in a log (a pipe) nothing of it,
only the result."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path

from kvproxy.cli.display import PROGRESS_MIN
from kvproxy.store import Store

from .test_inventory import commit, names
from .test_start_progress import read_until
from .test_store import legacy

N = PROGRESS_MIN + 5
CLEAR = "\r\x1b[K"


def kvproxy(*argv: str, terminal: bool) -> tuple[int, str, str]:
    """`kvproxy ARGV` as a process, its stderr a terminal or a pipe: (status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    command = [sys.executable, "-m", "kvproxy.cli", *argv]
    if not terminal:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        return done.returncode, done.stdout, done.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    try:
        err = read_until(master, b"\0never\0", timeout=120).decode()  # until it closes
    finally:
        os.close(master)
    out, _ = proc.communicate(timeout=60)
    return proc.returncode, out, err


def expired(root: Path) -> None:
    store = Store(root, ttl=0, max_bytes=0)
    store.open()
    for i in range(N):
        commit(store, f"{i:032x}", size=100, last_used=time.time() - 7200)
    store.close()


def test_a_long_gc_ticks_on_a_terminal(tmp_path: Path) -> None:
    expired(tmp_path)
    code, out, err = kvproxy("gc", "--ttl", "1h", "--cache-dir", str(tmp_path), terminal=True)
    assert code == 0 and f"evicted {N} of {N} entries" in out
    assert f"{CLEAR}evicting 1/{N} (0%)" in err
    assert f"{CLEAR}evicting {N // 2}/{N} ({100 * (N // 2) // N}%)" in err
    assert f"{CLEAR}evicting {N}/{N} (100%){CLEAR}" in err
    assert err.endswith(CLEAR) and "\n" not in err  # cleared: the result line follows
    assert names(tmp_path) == set()


def test_a_long_gc_in_a_log_shows_only_its_result(tmp_path: Path) -> None:
    expired(tmp_path)
    code, out, err = kvproxy("gc", "--ttl", "1h", "--cache-dir", str(tmp_path), terminal=False)
    assert code == 0 and f"evicted {N} of {N} entries" in out
    assert err == ""
    assert names(tmp_path) == set()


def test_the_import_of_an_old_cache_dir_ticks_on_a_terminal(tmp_path: Path) -> None:
    old = [legacy(tmp_path, i) for i in range(1, N + 1)]
    code, out, err = kvproxy("ls", "--cache-dir", str(tmp_path), "--limit", "1", terminal=True)
    assert code == 0 and f"{N} entries" in out, out
    assert f"{CLEAR}reading old records 1/{N} (0%)" in err
    assert f"{CLEAR}reading old records {N}/{N} (100%)" in err
    assert f"{CLEAR}importing old entries {N}/{N} (100%){CLEAR}" in err
    assert err.endswith(CLEAR) and "\n" not in err
    assert not list(tmp_path.glob("*.idx"))  # imported: the rows took over
    assert {f"{e.key}.kv" for e in old} <= names(tmp_path)


def test_the_import_of_an_old_cache_dir_in_a_log_is_quiet(tmp_path: Path) -> None:
    for i in range(1, N + 1):
        legacy(tmp_path, i)
    code, out, err = kvproxy("ls", "--cache-dir", str(tmp_path), "--limit", "1", terminal=False)
    assert code == 0 and f"{N} entries" in out, out
    assert err == ""
    assert not list(tmp_path.glob("*.idx"))
