"""`kvproxy serve` in managed mode refuses what it cannot run on before it starts anything: a
port another process holds (a second `kvproxy serve`), a cache dir it cannot write. Each is
one line; no llama-server is started; the record of the servers another kvproxy runs on the
same cache dir (leftover.py) is never removed, so `kvproxy doctor` still finds them.

Two serves run the real llama-server (with a tiny model): leftover.py recognises a server by
its exact command line, which a script stand-in's interpreter would change. The read-only
dir's serve runs a stand-in (standin_server.py) that counts its starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproxy.server import leftover
from kvproxy.server.managed import free_port

from .standin_server import standin_binary, starts

HEALTHY = "healthy"  # a stand-in that starts and answers /health


def serve_command(binary: Path | None, model: Path, cache: Path, port: int) -> list[str]:
    command = [sys.executable, "-m", "kvproxy.cli", "serve", "--model", str(model)]
    command += ["--server-bin", str(binary)] if binary is not None else []
    command += ["--cache-dir", str(cache), "--port", str(port), "--ctx-size", "512"]
    return [*command, "--server-start-timeout", "120"]


def servers_on(cache: Path) -> list[int]:
    """The pids of the llama-servers saving slots into `cache`, as /proc shows them."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--slot-save-path" in argv and str(cache).encode() in argv and proc.name.isdigit():
            pids.append(int(proc.name))
    return pids


def environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    env["HOME"] = str(home)
    env["XDG_CACHE_HOME"] = str(home / "xdg")
    return env


def start(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def wait_ready(port: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, "kvproxy never answered"
        time.sleep(0.2)


def ended(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """Its output, once it exits by itself."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"still running after {timeout:g} s:\n{out}") from None
    return out


def stop(proc: subprocess.Popen[str]) -> str:
    if proc.poll() is None:
        proc.terminate()
    out, _ = proc.communicate(timeout=60)
    return out


@pytest.mark.real
def test_a_second_serve_on_the_same_cache_dir_and_port_starts_nothing_and_removes_nothing(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    cache, port, model = tmp_path / "cache", free_port(), tiny_models["dense"]
    env = environment(tmp_path)
    first = start(serve_command(None, model, cache, port), env)
    try:
        wait_ready(port, first)
        found = leftover.managed_urls(cache)  # what `kvproxy doctor` finds
        running = servers_on(cache)
        assert len(found) == 1 and len(running) == 1

        second = start(serve_command(None, model, cache, port), env)
        out = ended(second)
        assert second.returncode == 1, out
        lines = out.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in out, out
        assert lines[0].startswith(f"kvproxy: cannot listen on 127.0.0.1:{port}"), out
        assert "starting" not in out and servers_on(cache) == running  # no second server
        assert leftover.managed_urls(cache) == found  # the first's record is intact

        # On another port the same cache dir serves; stopping it leaves the first's record.
        other = free_port()
        third = start(serve_command(None, model, cache, other), env)
        try:
            wait_ready(other, third)
            both = leftover.managed_urls(cache)
            assert len(both) == 2 and found[0] in both
        finally:
            stop(third)
        assert third.returncode == 0
        assert leftover.managed_urls(cache) == found and servers_on(cache) == running
    finally:
        stop(first)
    assert first.returncode == 0
    assert not (cache / "llama-server.json").exists()  # each took only its own entry away


@pytest.fixture
def read_only_cache(tmp_path: Path) -> Iterator[Path]:
    """A cache dir nothing can be written into. Root writes past permission bits, so as root
    the dir is made immutable (`chattr +i`: root's CAP_LINUX_IMMUTABLE, on ext4, xfs, btrfs)."""
    cache = tmp_path / "read-only"
    cache.mkdir(mode=0o700)
    if os.geteuid() != 0:
        cache.chmod(0o500)
        yield cache
        cache.chmod(0o700)
        return
    done = subprocess.run(["chattr", "+i", str(cache)], capture_output=True, text=True)
    assert done.returncode == 0, f"as root this test needs `chattr +i` on {tmp_path}: {done}"
    try:
        yield cache
    finally:
        subprocess.run(["chattr", "-i", str(cache)], check=True)


def test_a_read_only_cache_dir_in_managed_mode_is_one_line_before_anything_starts(
    tmp_path: Path, read_only_cache: Path, tiny_models: dict[str, Path]
) -> None:
    binary, record = standin_binary(tmp_path, HEALTHY)
    command = serve_command(binary, tiny_models["dense"], read_only_cache, free_port())
    proc = start(command, environment(tmp_path))
    out = ended(proc)
    assert proc.returncode == 1, out
    lines = out.strip().splitlines()
    assert "Traceback" not in out and len(lines) == 1, out
    assert lines[0].startswith(f"kvproxy: --cache-dir {read_only_cache} is not writable"), out
    assert starts(record) == []  # no llama-server was started
    assert list(read_only_cache.iterdir()) == []
