"""Progress where a user waits: managed mode's first start shows one line, rewritten in
place, while llama-server loads its model on a terminal (the server's own lines held back
meanwhile), and nothing of the kind when stderr is a log (a pipe)."""

from __future__ import annotations

import io
import os
import pty
import select
import time
from pathlib import Path

import pytest

from kvproxy.cli.display import Ticker
from kvproxy.server.managed import ManagedServer, ServerError, free_port

from .standin_server import SLOW_START, standin_binary
from .test_startup import serve


def read_until(fd: int, marker: bytes, timeout: float = 60) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while marker not in out:
        assert time.monotonic() < deadline, f"no {marker!r} in:\n{out.decode(errors='replace')}"
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                out += os.read(fd, 65536)
            except OSError:  # the terminal closed: the process ended
                break
    return out


def test_a_terminal_sees_the_model_load_tick(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    binary, _ = standin_binary(tmp_path, SLOW_START)
    master, slave = pty.openpty()
    proc = serve(tmp_path, binary, tiny_models["dense"], free_port(), stdout=slave)
    os.close(slave)
    try:
        out = read_until(master, b"kvproxy ready").decode(errors="replace")
    finally:
        proc.terminate()
        proc.wait(30)
        os.close(master)
    assert "\r\x1b[Kllama-server is loading the model… 1 s" in out
    assert "loading the model… 2 s" in out
    # Held back while the line ticks; the line is cleared before kvproxy goes on.
    assert "llama_model_loader" not in out
    assert out.index("\r\x1b[K", out.rindex("loading the model…")) < out.index("llama-server is up")


def test_a_log_gets_no_progress_line(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    binary, _ = standin_binary(tmp_path, SLOW_START)
    proc = serve(tmp_path, binary, tiny_models["dense"], free_port())
    assert proc.stdout is not None
    out = b""
    try:
        deadline = time.monotonic() + 60
        while b"kvproxy ready" not in out:
            assert time.monotonic() < deadline, out.decode(errors="replace")
            line = proc.stdout.readline()
            assert line, out.decode(errors="replace")
            out += line
    finally:
        proc.terminate()
        proc.wait(30)
    text = out.decode()
    assert "loading the model…" not in text and "\r" not in text
    assert "llama-server| llama_model_loader: loaded meta data" in text  # relayed as before


async def test_a_start_that_times_out_shows_the_servers_last_lines(tmp_path: Path) -> None:
    """Its lines were held back from the terminal: the error brings them."""
    binary, _ = standin_binary(tmp_path, SLOW_START)
    port = free_port()
    server = ManagedServer([str(binary), "--port", str(port)], port)
    with pytest.raises(ServerError) as raised:
        await server.start(timeout=1, waiting=Ticker("loading", io.StringIO()))
    message = str(raised.value)
    assert "not healthy after 1s" in message
    assert "llama-server| llama_model_loader: loaded meta data" in message
