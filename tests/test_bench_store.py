"""`kvproxy bench store`, run tiny: it builds an old-style cache dir, imports it, runs the
proxy over the fake server and the CLI on it, and prints the issue's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvproxy import cli
from kvproxy.store import Store

ROWS = (
    "first open of an old `.idx` cache dir (import, once)",
    "`kvproxy serve` until `/health` answers",
    "`kvproxy serve` until the cache is open and on",
    "proxy RSS (per entry, against an empty cache dir)",
    "every save: commit + victim selection + deletion",
    "every restore: the file check before the server's call",
    "housekeeping, every second",
    "lookup of a new conversation whose system prompt 100 entries share",
    "lookup of a conversation sharing nothing stored",
    "lookup of a continuing conversation",
    "first two keys of every entry, kept in memory",
    "`kvproxy ls --limit 20` / `rm <prefix>`",
    "`kvproxy gc` evicting 100 (`--dry-run`)",
)


def test_bench_store_prints_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "work"
    code = cli.main(["bench", "store", "--entries", "200", "--workdir", str(work), "--keep"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| 200 entries | measured | target at 100k |" in out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    for row in ROWS:
        [line] = [line for line in lines if row in line]
        measured = line.split(" | ")[1]
        assert any(ch.isdigit() for ch in measured), line
    # What the benchmark left: 200 imported, 50 saved and 50 evicted by them, 1 removed by
    # `rm`, 100 evicted by `gc`; the index and the files agree.
    cache = work / "cache"
    store = Store(cache, 0, 0)
    store.open_readonly()
    assert len(store.entries) == 200 - 1 - 100
    assert set(store.entries) == {p.name[:-3] for p in cache.glob("*.kv")}
    assert not list(cache.glob("*.idx")) and not list(cache.glob("*.tmp*"))
    store.close()
