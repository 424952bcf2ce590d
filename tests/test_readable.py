"""Sizes and times as people read them at any scale (kvproxy/readable.py), and the
outputs that name them: `kvproxy stats`, `kvproxy ls`, the shutdown's and the request log's
lines (test_requestlog.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvproxy import keys, readable
from kvproxy.cli import main
from kvproxy.cli.stats import render_stats
from kvproxy.store import STATE_MAGIC, Entry, Store

GiB = 1 << 30


def test_sizes() -> None:
    assert readable.size(0) == "0 B"
    assert readable.size(512) == "512 B"
    assert readable.size(7 * 1024**2 + 100) == "7.0 MiB"
    assert readable.size(1288490188) == "1.2 GiB"
    assert readable.size(1024**2 - 1) == "1.0 MiB"  # never "1024.0 KiB"
    assert readable.size(3 * 1024**4) == "3.0 TiB"
    assert readable.rate(450e6) == "429.2 MiB/s"


def test_durations() -> None:
    assert readable.duration(0.0061) == "6.1 ms"
    assert readable.duration(0.198) == "198 ms"
    assert readable.duration(0.9999) == "1.0 s"  # never "1000 ms"
    assert readable.duration(2.4317) == "2.4 s"
    assert readable.duration(191.0) == "3.2 min"
    assert readable.duration(3 * 3600) == "3.0 h"
    assert readable.duration(-1) == "0.0 ms"
    assert readable.duration(2.4317, sep="") == "2.4s"


def test_kvproxy_stats_at_big_state_sizes() -> None:
    """An 8B model's states: GiB and seconds, not bytes and thousands of milliseconds."""
    shown = render_stats(
        {
            "saves": 3,
            "saved_bytes": 3 * GiB + 200 * 1024**2,
            "disk_bytes": int(2.86 * GiB),
            "entries": 7,
            "prefill_seconds": 1234.5,
            "prefill_seconds_saved": 191.0,
            "restores": 2,
            "prefills_over_restores": 1,
            "histograms": {
                "save_seconds": {"p50": 2.4317},
                "restore_seconds": {"p50": 0.198},
                "queue_wait_seconds": {"p50": 34.2, "p90": 0.0061},
            },
        },
        "u",
    )
    assert "3.2 GiB, p50 2.4 s" in shown
    assert "p50 198 ms" in shown
    assert "saved ≈ 3.2 min, spent 20.6 min" in shown
    assert "wait p50 34.2 s, p90 6.1 ms" in shown
    assert "7 entries, 2.9 GiB" in shown
    assert "1 prefilled instead" in shown


def big_entry(root: Path, size: int = 1288490188, tokens: int = 8377) -> str:
    """Commit an entry of `size` bytes (an 8B model's 8k tokens) as a save does, its state
    file sparse: on paper only. Its key."""
    store = Store(root, ttl=3600, max_bytes=0)
    key = keys.chain(keys.namespace("m", {}, None), [{"role": "user", "content": "x"}])[-1]
    temp = store.temp_name(key)
    with open(root / temp, "wb") as f:
        f.write(STATE_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little"))
        f.truncate(size)
    now = time.time()
    store.commit(Entry(key, "ns", tokens, 0, 1, now, now, chain=[key]), temp)
    store.close()
    return key


def test_kvproxy_ls_at_big_state_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = big_entry(tmp_path)
    assert main(["ls", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(key[:12]))
    assert "1.2 GiB" in row and "8,377" in row
    assert "1 entry, 1.2 GiB in" in out
