"""SIGTERM stops kvproxy within its deadline (`--shutdown-timeout`), whatever is in flight:
requests get a third of it, then unsaved slots are saved in what is left; a slot that cannot
be saved in time is named and lost. systemd sends SIGKILL 90 s after SIGTERM by default, and
then nothing is saved."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp

from kvproxy.cache.servers.leases import Background
from kvproxy.server.managed import free_port
from kvproxy.store import DB_NAME, Store

from .fakeserver import FakeLlamaServer

DEADLINE = 6.0


def conversation(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"Conversation {n}. " + "pad " * 200},
        {"role": "user", "content": "go"},
    ]


async def wait_listening(url: str, proc: asyncio.subprocess.Process) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(600):
            assert proc.returncode is None, "kvproxy exited at start-up"
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError("kvproxy did not start")


async def test_sigterm_during_a_long_reply_stops_within_the_deadline(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache, token_delay=0.1, ignore_eos=True) as fake:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "kvproxy.cli", "serve", "--upstream", fake.url, "--port", str(port)),
            *("--cache-dir", str(cache), "--min-tokens", "0", "--idle-save-after", "3600"),
            *("--shutdown-timeout", str(DEADLINE)),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            await wait_listening(url, proc)
            async with aiohttp.ClientSession() as s:
                body = {"messages": conversation(1), "max_tokens": 4}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200  # conversation 1 now sits unsaved in its slot
                # Conversation 2's reply never ends (the model ignores EOS, no output cap).
                body = {"messages": conversation(2), "stream": True}
                resp = await s.post(url + "/v1/chat/completions", json=body)
                await resp.content.readline()
                proc.send_signal(signal.SIGTERM)
                began = time.monotonic()
                _, err = await asyncio.wait_for(proc.communicate(), DEADLINE + 20)
                stopped_after = time.monotonic() - began
                resp.close()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode is not None
    # Stopped by its deadline, not by the reply's end (it has none) nor by a SIGKILL.
    assert stopped_after < DEADLINE + 15, err.decode()[-2000:]
    # What could be saved was: conversation 1's state is on disk, committed.
    assert (cache / DB_NAME).exists()
    store = Store(cache, 86400.0, 1 << 40)
    store.open_readonly()
    try:
        assert len(store.entries) >= 1, err.decode()[-2000:]
    finally:
        store.close()


async def test_a_bounded_wait_for_background_work_leaves_it_running() -> None:
    """Shutdown waits for kvproxy's own work (a long prefill on a slot) only as long as its
    deadline allows: the work goes on, so the slot it holds is still known busy and is
    named as not saved (a wait_for around a gather would cancel it)."""
    background = Background()
    done = asyncio.Event()

    async def long_prefill() -> None:
        await asyncio.sleep(0.5)
        done.set()

    background.spawn(long_prefill())
    assert await background.wait(0.05) is False
    assert len(background) == 1  # still running
    assert await background.wait() is True
    assert done.is_set()
