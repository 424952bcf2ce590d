"""Managed mode's servers (server/fleet.py), with stand-in llama-servers: several start on
ports of their own, one that dies is started again on its port after a back-off, the
leftover record always names what runs, and one that keeps dying is given up on."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp

from kvproxy.server import leftover
from kvproxy.server.fleet import HEALTHY_RUN_S, Backoff, Fleet, Streak
from kvproxy.server.managed import ManagedServer, free_port
from kvproxy.server.startup import Quirks
from kvproxy.store import dirfiles

from .standin_server import ALWAYS_DIES, REPLY, standin_binary, starts

SERVES = "serves"  # any mode the stand-in does not die in


def test_the_back_off_doubles_up_to_its_cap() -> None:
    backoff = Backoff(first=1, most=30, give_up=5)
    assert [backoff.delay(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30]


def standins(tmp_path: Path, mode: str, n: int) -> tuple[list[ManagedServer], Path]:
    binary, record = standin_binary(tmp_path, mode)
    servers = []
    for _ in range(n):
        port = free_port()
        command = [str(binary), "--model", "m.gguf", "--port", str(port)]
        servers.append(ManagedServer(command, port, quirks=Quirks(tmp_path / "quirks.json")))
    return servers, record


async def answers(url: str) -> str:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json={"messages": []}) as r,
    ):
        body = await r.json()
        return str(body["choices"][0]["message"]["content"])


def recorded_pids(cache: Path) -> set[int]:
    return {s.pid for s in leftover.recorded(dirfiles.read(cache, dirfiles.SERVER))}


async def test_a_server_that_dies_is_started_again_on_its_port(tmp_path: Path) -> None:
    servers, record = standins(tmp_path, SERVES, 2)
    fleet = Fleet(servers, tmp_path, Backoff(first=0.1, most=0.2, give_up=3))
    await fleet.start(timeout=30)
    supervisor = asyncio.create_task(fleet.supervise())
    try:
        assert len(set(fleet.urls)) == 2
        assert [await answers(url) for url in fleet.urls] == [REPLY, REPLY]
        first = servers[0].process
        assert first is not None
        assert recorded_pids(tmp_path) == {s.process.pid for s in servers if s.process}
        os.kill(first.pid, signal.SIGKILL)
        for _ in range(300):
            if fleet.restarts == 1:
                break
            await asyncio.sleep(0.05)
        assert fleet.restarts == 1 and not supervisor.done()
        # The same port answers again, from a new process, and the record names it.
        again = servers[0].process
        assert again is not None and again.pid != first.pid
        assert await answers(fleet.urls[0]) == REPLY
        assert recorded_pids(tmp_path) == {s.process.pid for s in servers if s.process}
        assert len(starts(record)) == 3
    finally:
        supervisor.cancel()
        await fleet.stop()
    assert not (tmp_path / dirfiles.SERVER).exists()
    assert all(s.process is None or s.process.returncode is not None for s in servers)


async def test_a_server_that_cannot_start_again_is_given_up_on(tmp_path: Path) -> None:
    servers, _ = standins(tmp_path, SERVES, 1)
    fleet = Fleet(servers, tmp_path, Backoff(first=0.05, most=0.05, give_up=2))
    await fleet.start(timeout=30)
    try:
        # From now on the binary dies at every start (a broken rebuild, a lost GPU).
        dies, _ = standin_binary(tmp_path, ALWAYS_DIES)
        servers[0].command[0] = str(dies)
        process = servers[0].process
        assert process is not None
        os.kill(process.pid, signal.SIGKILL)
        reason = await asyncio.wait_for(fleet.supervise(), 60)
        assert "not starting it again" in str(reason) and "SIGILL" in str(reason)
    finally:
        await fleet.stop()


async def test_a_server_that_served_and_dies_again_and_again_is_always_started_again(
    tmp_path: Path,
) -> None:
    """A server that came up healthy and died (a client's request crashing it) is no failed
    start: killed more times in a row than `give_up`, it is started again every time and
    kvproxy keeps supervising."""
    servers, _ = standins(tmp_path, SERVES, 1)
    fleet = Fleet(servers, tmp_path, Backoff(first=0.05, most=0.1, give_up=2))
    await fleet.start(timeout=30)
    supervisor = asyncio.create_task(fleet.supervise())
    try:
        for n in range(1, 5):
            process = servers[0].process
            assert process is not None
            os.kill(process.pid, signal.SIGKILL)
            async with asyncio.timeout(60):
                while fleet.restarts < n and not supervisor.done():
                    await asyncio.sleep(0.05)
            assert not supervisor.done(), supervisor.result()
            assert await answers(fleet.urls[0]) == REPLY
    finally:
        supervisor.cancel()
        await fleet.stop()


def test_only_failed_starts_count_toward_giving_up() -> None:
    streak = Streak(Backoff(first=1, most=30, give_up=3))
    assert [streak.died(1.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]  # never gives up
    assert streak.died(HEALTHY_RUN_S) == 1  # a minute up: back to the first delay
    assert streak.start_failed() == 2
    assert streak.start_failed() == 4
    assert streak.start_failed() is None
    streak = Streak(Backoff(first=1, most=30, give_up=3))
    streak.start_failed()
    streak.started()
    assert streak.failed_starts == 0
