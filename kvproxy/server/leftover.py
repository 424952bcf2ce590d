"""A llama-server that a killed kvproxy left running (managed mode).

The managed server runs in a session of its own (a Ctrl-C is kvproxy's to relay), so when
kvproxy dies without stopping it (SIGKILL, the OOM killer, a crash) it keeps running: its
model and KV memory stay taken, and a restarted kvproxy would start a second one beside it.
kvproxy writes down what it started (dirfiles.SERVER, in the cache dir) and, at the next
start, stops that process if it is still there and no longer has the kvproxy that started it
as its parent. A process is recognised by its exact command line, so a reused pid or a
server someone else runs is never touched; another kvproxy still running on the same cache
dir keeps its server, and its entry in the record: each kvproxy writes and removes only its
own entries there (by its pid, `owner`)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvproxy.server.modellist import flag_value
from kvproxy.store import dirfiles

log = logging.getLogger("kvproxy.managed")

STOP_GRACE_S = 5.0  # SIGTERM first: a server mid-save finishes writing its file


@dataclass(frozen=True)
class Started:
    """What managed mode started: the process, who started it, with what command."""

    pid: int
    owner: int
    command: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "owner": self.owner, "command": list(self.command)}

    @staticmethod
    def from_json(data: Any) -> Started | None:
        try:
            started = Started(
                int(data["pid"]), int(data["owner"]), tuple(map(str, data["command"]))
            )
        except (TypeError, KeyError, ValueError):
            return None
        return started if started.pid > 1 and started.command else None


@dataclass(frozen=True)
class Running:
    """A live process as /proc shows it."""

    command: tuple[str, ...]
    parent: int


def is_leftover(started: Started, running: Running | None) -> bool:
    """Ours to stop: it runs exactly what was started, and its parent is no longer the kvproxy
    that started it (it was handed to init or a subreaper when that kvproxy died)."""
    return (
        running is not None
        and running.command == started.command
        and (running.parent != started.owner)
    )


def running(pid: int) -> Running | None:
    """The process `pid`, or None once it is gone (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold anything.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if not raw or not fields or fields[0] == b"Z":
        return None
    command = tuple(part.decode("utf-8", "surrogateescape") for part in raw.split(b"\0")[:-1])
    return Running(command, int(fields[1]))


def record(root: Path, pid: int, command: list[str]) -> None:
    record_many(root, [(pid, command)])


def record_many(root: Path, processes: Sequence[tuple[int, Sequence[str]]]) -> None:
    """What this kvproxy's managed mode runs now (`--servers N`: several), replacing its own
    entries; those of other kvproxies on the same cache dir whose servers still run stay."""
    owner = os.getpid()
    ours = [Started(pid, owner, tuple(command)) for pid, command in processes]
    _write(root, [*others_running(recorded(dirfiles.read(root, dirfiles.SERVER))), *ours])


def others_running(entries: Sequence[Started]) -> list[Started]:
    """The entries of other kvproxies whose servers still run exactly as started."""
    owner = os.getpid()
    return [s for s in entries if s.owner != owner and _runs_as_started(s)]


def _runs_as_started(started: Started) -> bool:
    now = running(started.pid)
    return now is not None and now.command == started.command


def _write(root: Path, entries: Sequence[Started]) -> None:
    """The record of `entries` (the one-server form for one); none: no record."""
    if not entries:
        dirfiles.remove(root, dirfiles.SERVER)
        return
    started = [s.to_json() for s in entries]
    dirfiles.write(root, dirfiles.SERVER, started[0] if len(started) == 1 else {"servers": started})


def recorded(data: Any) -> list[Started]:
    """The processes a record names: one (the single-server form) or several."""
    items = data.get("servers") if isinstance(data, dict) and "servers" in data else [data]
    if not isinstance(items, list):
        return []
    return [s for s in map(Started.from_json, items) if s is not None]


def managed_urls(root: Path) -> list[str]:
    """Where the llama-servers a kvproxy started on this cache dir listen, those still
    running exactly as started (`kvproxy doctor` without --upstream finds `make run`'s)."""
    urls = []
    for started in recorded(dirfiles.read(root, dirfiles.SERVER)):
        now = running(started.pid)
        port = flag_value(started.command, ("--port",))
        if now is None or now.command != started.command or port is None:
            continue
        host = flag_value(started.command, ("--host",)) or "127.0.0.1"
        urls.append(f"http://{'[' + host + ']' if ':' in host else host}:{port}")
    return urls


def forget(root: Path) -> None:
    """This kvproxy's servers stopped: its entries go; another kvproxy's stay."""
    everything = recorded(dirfiles.read(root, dirfiles.SERVER))
    owner = os.getpid()
    if everything and all(s.owner != owner for s in everything):
        return  # nothing of ours: the record is left exactly as another kvproxy wrote it
    _write(root, others_running(everything))


def stop_leftover(root: Path, grace: float = STOP_GRACE_S) -> int | None:
    """Stops the servers a killed kvproxy left running on this cache dir; the pid of one it
    stopped, or None if there was none. Blocks up to `grace` seconds a server and a little:
    call it off the event loop."""
    everything = recorded(dirfiles.read(root, dirfiles.SERVER))
    if not everything:
        return None
    stopped: int | None = None
    kept: list[Started] = []
    for started in everything:
        now = running(started.pid)
        if not is_leftover(started, now):
            if now is not None and now.command == started.command:
                kept.append(started)  # another kvproxy's, still running: its entry stays
            continue
        log.warning(
            "stopping llama-server pid %d: a kvproxy that was killed left it running on %s",
            started.pid,
            root,
        )
        if any(_ended(started.pid, sig, grace) for sig in (signal.SIGTERM, signal.SIGKILL)):
            stopped = started.pid
        else:
            kept.append(started)
            log.warning("llama-server pid %d is still there after SIGKILL", started.pid)
    if kept != everything:
        _write(root, kept)
    return stopped


def _ended(pid: int, sig: signal.Signals, grace: float) -> bool:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + grace
    while running(pid) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
