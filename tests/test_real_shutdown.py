"""SIGTERM while the real llama-server is deep in a long prefill (one thread, small batches,
a ~12k-token prompt: well over a minute of work) stops `kvproxy serve --model default` and its
server within `--shutdown-timeout`: a systemd unit's stop is then bounded, and kvproxy says in
its log what it did not save. The idle conversation is saved in the time there was."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from kvproxy_bench.dialogues import first_turn

from kvproxy.server import leftover
from kvproxy.server.managed import free_port
from kvproxy.store import DB_NAME, Store, dirfiles

from .test_managed import wait_ready

pytestmark = pytest.mark.real

DEADLINE = 9.0
# Past the deadline: the process's own exit (the log writer's last lines, the interpreter).
# Not a measure of speed: what is asserted is that nothing waits for the prefill to end.
MARGIN = 6.0


def alive(pid: int) -> bool:
    """Running (a zombie its parent has not reaped yet counts as gone)."""
    return leftover.running(pid) is not None


def server_pid(cache: Path) -> int:
    """The managed llama-server's pid, from the record kvproxy keeps of it in its cache dir."""
    started = leftover.Started.from_json(json.loads((cache / dirfiles.SERVER).read_text()))
    assert started is not None
    return started.pid


def start_slow(cache: Path, log: Path, port: int) -> subprocess.Popen[str]:
    with open(log, "a") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "kvproxy.cli", "serve", "--model", "default"),
                *("--port", str(port), "--cache-dir", str(cache), "--slots", "2"),
                *("--ctx-size", "16384", "--min-tokens", "256", "--idle-save-after", "3600"),
                *("--shutdown-timeout", f"{DEADLINE:g}"),
                # A slow server: one thread, 64-token batches.
                *("--", "--threads", "1", "-b", "64", "-ub", "64", "--cache-ram", "0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.mark.timeout(600)
async def test_sigterm_during_a_long_prefill_stops_within_the_deadline(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    log = tmp_path / "kvproxy.log"
    port = free_port()
    proc = start_slow(cache, log, port)
    url = f"http://127.0.0.1:{port}"
    try:
        server_url = await asyncio.to_thread(wait_ready, proc, log, port)
        async with aiohttp.ClientSession() as s:
            body = {"messages": first_turn(1, n_facts=30), "max_tokens": 4, "temperature": 0}
            async with s.post(url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()  # conversation 1: idle, not saved yet
            body = {"messages": first_turn(2, n_facts=550), "max_tokens": 4, "temperature": 0}
            long = asyncio.create_task(s.post(url + "/v1/chat/completions", json=body))
            for _ in range(600):  # until the server is busy with it
                async with s.get(server_url + "/slots") as r:
                    slots = await r.json()
                if any(slot["is_processing"] for slot in slots):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("the long prompt never reached the server")
            await asyncio.sleep(3.0)  # well into the prefill
            async with s.get(server_url + "/slots") as r:
                assert any(slot["is_processing"] for slot in await r.json())
            pids = [proc.pid, server_pid(cache)]
            proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            while any(alive(pid) for pid in pids) and time.monotonic() < began + DEADLINE + MARGIN:
                await asyncio.sleep(0.1)
            gone = [pid for pid in pids if not alive(pid)]
            waited = time.monotonic() - began
            with contextlib.suppress(aiohttp.ClientError, asyncio.CancelledError):
                long.cancel()
                await long
        text = log.read_text()
        print(f"\nstopped after {waited:.1f} s (deadline {DEADLINE:g} s)\n" + text[-1500:])
        assert gone == pids, f"still running {DEADLINE + MARGIN:g} s after SIGTERM:\n{text[-3000:]}"
        assert proc.wait(5) in (0, 1)  # its own exit, not a signal's
        # What it did not save is named; what it could save is on disk, committed.
        assert "not saved" in text, text[-3000:]
        assert (cache / DB_NAME).exists()
        store = Store(cache, 86400.0, 1 << 40)
        store.open_readonly()
        try:
            assert len(store.entries) >= 1, text[-3000:]
        finally:
            store.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        with contextlib.suppress(AssertionError, ProcessLookupError, OSError, ValueError):
            pid = server_pid(cache)
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
