"""A llama-server a killed kvproxy left running is stopped at the next start (leftover.py);
nothing else ever is. The stand-in server here is `sleep`, recognised by its command line."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproxy.server import leftover
from kvproxy.server.leftover import Running, Started
from kvproxy.store import dirfiles

COMMAND = ("sleep", "300")


def test_only_the_same_command_without_its_kvproxy_is_a_leftover() -> None:
    started = Started(pid=4242, owner=100, command=COMMAND)
    assert leftover.is_leftover(started, Running(COMMAND, parent=1))
    assert not leftover.is_leftover(started, Running(COMMAND, parent=100))  # its kvproxy lives
    assert not leftover.is_leftover(started, Running(("bash",), parent=1))  # a reused pid
    assert not leftover.is_leftover(started, None)  # gone


@pytest.mark.parametrize("junk", [None, {}, {"pid": "x"}, {"pid": 1, "owner": 2, "command": ["a"]}])
def test_a_record_kvproxy_did_not_write_is_ignored(junk: object) -> None:
    assert Started.from_json(junk) is None


@pytest.fixture
def stand_in() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(COMMAND, start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def write(root: Path, pid: int, owner: int) -> None:
    dirfiles.write(root, dirfiles.SERVER, Started(pid, owner, COMMAND).to_json())


def test_the_leftover_is_stopped_and_forgotten(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    write(tmp_path, stand_in.pid, owner=2**22 + 7)  # a kvproxy that is gone
    assert leftover.stop_leftover(tmp_path) == stand_in.pid
    assert stand_in.wait(5) == -15  # SIGTERM was enough
    assert not (tmp_path / dirfiles.SERVER).exists()


def test_a_live_kvproxys_server_or_a_stranger_is_left_alone(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    write(tmp_path, stand_in.pid, owner=os.getpid())  # its parent, alive: another kvproxy's
    assert leftover.stop_leftover(tmp_path) is None
    dirfiles.write(
        tmp_path, dirfiles.SERVER, Started(stand_in.pid, 2**22 + 7, ("llama-server",)).to_json()
    )
    assert leftover.stop_leftover(tmp_path) is None  # the pid runs something else now
    assert stand_in.poll() is None


def test_the_record_is_private_and_holds_the_command(tmp_path: Path) -> None:
    leftover.record(tmp_path, 1234, ["llama-server", "--port", "1"])
    assert (tmp_path / dirfiles.SERVER).stat().st_mode & 0o777 == 0o600
    found = Started.from_json(dirfiles.read(tmp_path, dirfiles.SERVER))
    assert found == Started(1234, os.getpid(), ("llama-server", "--port", "1"))


def test_several_servers_left_by_a_killed_kvproxy_are_all_stopped(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    other = subprocess.Popen(list(COMMAND))
    try:
        dirfiles.write(
            tmp_path,
            dirfiles.SERVER,
            {
                "servers": [
                    Started(stand_in.pid, 2**22 + 7, COMMAND).to_json(),
                    Started(other.pid, 2**22 + 7, COMMAND).to_json(),
                ]
            },
        )
        assert leftover.stop_leftover(tmp_path) in (stand_in.pid, other.pid)
        assert stand_in.wait(5) == -15 and other.wait(5) == -15
        assert not (tmp_path / dirfiles.SERVER).exists()
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


def test_a_record_of_several_holds_each(tmp_path: Path) -> None:
    leftover.record_many(tmp_path, [(11, ["llama-server", "--port", "1"]), (12, ["x"])])
    found = leftover.recorded(dirfiles.read(tmp_path, dirfiles.SERVER))
    assert [s.pid for s in found] == [11, 12] and found[1].command == ("x",)


def test_a_kvproxy_writes_and_removes_only_its_own_entries(
    tmp_path: Path, stand_in: subprocess.Popen[bytes]
) -> None:
    """Two kvproxies on one cache dir: each one's record keeps the other's running server."""
    write(tmp_path, stand_in.pid, owner=2**22 + 7)  # another kvproxy's, running
    leftover.record(tmp_path, 999_999, ["llama-server", "--port", "2"])
    found = leftover.recorded(dirfiles.read(tmp_path, dirfiles.SERVER))
    assert [s.pid for s in found] == [stand_in.pid, 999_999]
    leftover.forget(tmp_path)
    assert leftover.recorded(dirfiles.read(tmp_path, dirfiles.SERVER)) == found[:1]
    leftover.forget(tmp_path)  # nothing of ours: left as the other wrote it
    assert leftover.recorded(dirfiles.read(tmp_path, dirfiles.SERVER)) == found[:1]
