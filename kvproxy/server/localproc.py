"""The llama-server process behind a loopback URL, when this machine's /proc shows it.

kvproxy's own managed server, or a sidecar started on the same machine (by the same user, or
any user when kvproxy runs as root), is found from its listening socket: /proc/net/tcp{,6}
names the socket's inode, and the process holding that inode among its file descriptors is
the server. Its command line tells the flags it was started with, its working directory
resolves a relative `-m model.gguf`, its `LLAMA_ARG_*` environment the flags given that way,
and its start time tells a restarted server from the one kvproxy knew (a pid can be reused, a
pid with the same start time cannot). Nothing here is trusted for anything but the
fingerprint: a server elsewhere (another host, a container) is simply not found.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

PROC = Path("/proc")
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's `st` column
ENV_PREFIX = "LLAMA_ARG_"


@dataclass(frozen=True)
class ServerProcess:
    pid: int
    started: int  # clock ticks after boot (/proc/<pid>/stat field 22)
    argv: tuple[str, ...] = ()
    cwd: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # its LLAMA_ARG_* variables
    exe: Path | None = None


def loopback_port(url: str) -> int | None:
    """The port of a loopback URL (127.0.0.0/8, ::1, localhost); None for any other host,
    whose process is not this machine's to look at."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if host != "localhost":
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return None
        except ValueError:
            return None
    try:
        return parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None


def find(url: str) -> ServerProcess | None:
    """The process listening on a loopback URL's port, if /proc shows it."""
    port = loopback_port(url)
    if port is None:
        return None
    inodes = _listening_inodes(port)
    if not inodes:
        return None
    pid = _holder(inodes)
    return read(pid) if pid is not None else None


def read(pid: int) -> ServerProcess | None:
    started = start_time(pid)
    if started is None:
        return None
    base = PROC / str(pid)
    try:
        raw = (base / "cmdline").read_bytes()
    except OSError:
        return None
    argv = tuple(a.decode("utf-8", "surrogateescape") for a in raw.split(b"\0")[:-1])
    return ServerProcess(pid, started, argv, _link(base / "cwd"), _env(base), _link(base / "exe"))


def start_time(pid: int) -> int | None:
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        # The command name (field 2) is in parentheses and may hold spaces or parentheses.
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def same_process(proc: ServerProcess) -> bool:
    """Is the process still the one found (not ended, its pid not reused)?"""
    return start_time(proc.pid) == proc.started


def _listening_inodes(port: int) -> set[str]:
    found = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != LISTEN:
                continue
            local = cols[1].rsplit(":", 1)
            if len(local) == 2 and int(local[1], 16) == port:
                found.add(cols[9])
    return found


def _holder(inodes: set[str]) -> int | None:
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        pids = [int(p) for p in os.listdir(PROC) if p.isdigit()]
    except OSError:
        return None
    for pid in pids:
        fds = PROC / str(pid) / "fd"
        try:
            names = os.listdir(fds)
        except OSError:
            continue
        for fd in names:
            try:
                if os.readlink(fds / fd) in wanted:
                    return pid
            except OSError:
                continue
    return None


def _link(path: Path) -> Path | None:
    try:
        return Path(os.readlink(path))
    except OSError:
        return None


def _env(base: Path) -> dict[str, str]:
    try:
        raw = (base / "environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        text = item.decode("utf-8", "surrogateescape")
        name, sep, value = text.partition("=")
        if sep and name.startswith(ENV_PREFIX):
            out[name] = value
    return out
