"""Whether a llama-server saves slots into kvproxy's cache dir: one probe save, checked on disk.

`POST /slots/{id}?action=save` writes `<--slot-save-path>/<filename>` (server-context.cpp:
`params.slot_save_path + filename`, the name checked by `fs_validate_filename`, so no
directory part), whatever the slot holds: an empty slot writes a small file of no tokens.
A sidecar started with another `--cache-dir` than the server's `--slot-save-path` would
learn it only at its first save ("wrote no file") and leave its temp files in the server's
dir; probed at start, it refuses to start instead, in one line naming the fix. `kvproxy
doctor` runs the same probe.

The probe saves an idle slot (the emptiest: the smallest file), never a busy one (a slot
action sent to a busy slot is deferred and can hang the completions queued after it), and
deletes the file. A probe that landed elsewhere cannot be deleted (the server has no API for
it, and its dir is unknown): it is named, and its name is swept as a temp file by a kvproxy
whose cache dir it is in.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Literal

from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient

log = logging.getLogger("kvproxy.server")

PROBE_MARK = ".probe.tmp"  # with TMP_MARK in it: a start-up sweep removes one left behind
PROBE_TIMEOUT = 120.0


class Landed(StrEnum):
    HERE = "here"  # the probe file appeared in the cache dir
    ELSEWHERE = "elsewhere"  # the server wrote it somewhere else
    OFF = "off"  # slot saves are off: llama-server without --slot-save-path (501)
    FAILED = "failed"  # the server could not save (its dir missing, not writable, full)
    NOT_PROBED = "not probed"  # no idle slot, no GET /slots (not up yet): nothing known


@dataclass(frozen=True)
class Probe:
    cache_dir: Path
    landed: Landed
    filename: str = ""
    n_written: int = 0
    detail: str = ""  # why not probed


def probe_name() -> str:
    """Key-shaped (32 hex digits), so kvproxy's start-up sweep of temp files covers it."""
    return f"{secrets.token_hex(16)}{PROBE_MARK}"


async def probe_save_path(llama: LlamaClient, cache_dir: Path) -> Probe:
    """Save the emptiest idle slot under a fresh name and look for the file in `cache_dir`."""
    try:
        slots = await llama.slots()
    except UpstreamError as exc:
        return Probe(cache_dir, Landed.NOT_PROBED, detail=f"GET /slots: {exc}")
    idle = [s for s in slots if not s.is_processing]
    if not idle:
        return Probe(cache_dir, Landed.NOT_PROBED, detail="every slot is busy")
    slot = min(idle, key=lambda s: s.n_prompt_tokens or 0)
    name = probe_name()
    try:
        saved = await llama.save(slot.id, name, timeout=PROBE_TIMEOUT)
    except UpstreamError as exc:
        if exc.status == 501:
            return Probe(cache_dir, Landed.OFF, name)
        return Probe(cache_dir, Landed.FAILED, name, detail=f"a probe save failed: {exc}")
    probe = cache_dir / name
    here = await asyncio.to_thread(probe.exists)
    if here:
        await asyncio.to_thread(_unlink, probe)
    return Probe(cache_dir, Landed.HERE if here else Landed.ELSEWHERE, name, saved.n_written)


async def saves_elsewhere(llama: LlamaClient, slot_id: int, cache_dir: Path) -> bool:
    """A save the server answered left no file in `cache_dir`: does it save elsewhere, or
    was the file deleted before kvproxy committed it (a user, or another kvproxy sweeping
    the dir)? A second save of the same slot (the caller's, idle) under a probe name tells.
    Only a probe that lands elsewhere says so; one that fails says nothing."""
    name = probe_name()
    try:
        await llama.save(slot_id, name, timeout=PROBE_TIMEOUT)
    except UpstreamError:
        return False
    probe = cache_dir / name
    here = await asyncio.to_thread(probe.exists)
    if here:
        await asyncio.to_thread(_unlink, probe)
    return not here


def probe_check(probe: Probe) -> tuple[Literal["ok", "warn", "fail"], str, str]:
    """`kvproxy doctor`'s verdict on a probe: status, what it found, the fix."""
    where = probe.cache_dir
    if probe.landed is Landed.HERE:
        return "ok", f"a probe save landed in {where} ({probe.n_written} bytes)", ""
    if probe.landed is Landed.NOT_PROBED:
        return "warn", f"not probed ({probe.detail}); rerun later", ""
    if probe.landed is Landed.FAILED:
        return "fail", probe.detail, ""
    if probe.landed is Landed.OFF:
        fix = f"start llama-server with --slot-save-path {where}"
        return "fail", "slot save/restore is off in llama-server", fix
    return (
        "fail",
        f"llama-server saves slots somewhere else than {where} (its probe file "
        f"{probe.filename} is there)",
        f"start llama-server with --slot-save-path {where} (the same dir as kvproxy's "
        "--cache-dir), or pass --cache-dir <its dir>",
    )


def elsewhere_message(url: str, cache_dir: Path, probe: Probe) -> str:
    """One line: what is wrong, and both ways to fix it."""
    return (
        f"kvproxy: llama-server at {url} saves slots somewhere else than --cache-dir "
        f"{cache_dir} (its probe file {probe.filename} is not there): start llama-server "
        f"with --slot-save-path {cache_dir}, or pass --cache-dir <its --slot-save-path> "
        "(a kvproxy sweeps the probe file from its own cache dir)"
    )


async def refuse_foreign_save_paths(
    urls: Sequence[str], api_key: str | None, cache_dir: Path
) -> list[str]:
    """Sidecar start: SystemExit, in one line, when an --upstream is another kvproxy or a
    server that saves slots elsewhere. A server not answering, or not probed (not up yet,
    every slot busy), is logged and served: its first save tells. The URLs of those that do
    not answer at all."""
    down = []
    for url in urls:
        upstream = Upstream(url, api_key)
        await upstream.start()
        try:
            found = await answering(upstream)
            probe = await probe_save_path(LlamaClient(upstream), cache_dir) if found else None
        finally:
            await upstream.close()
        if found == KVPROXY:
            raise SystemExit(
                f"kvproxy: --upstream {url} is a kvproxy, not a llama-server: give the address "
                "of the llama-server behind it (that kvproxy's --upstream, or the `llama-server "
                "is up at` address its managed mode logs)"
            )
        if probe is None:
            down.append(url)
            log.warning(
                "llama-server at %s does not answer: kvproxy answers 502 until it does (is "
                "--upstream right? is the server started?)",
                url,
            )
        elif probe.landed is Landed.ELSEWHERE:
            raise SystemExit(elsewhere_message(url, cache_dir, probe))
        elif probe.landed is Landed.NOT_PROBED:
            log.info("did not check where %s saves slots: %s", url, probe.detail)
        elif probe.landed is Landed.FAILED:
            log.warning("%s: %s; kvproxy cannot save there until it can", url, probe.detail)
    return down


KVPROXY = "kvproxy"
LLAMA_SERVER = "llama-server"


async def answering(upstream: Upstream) -> str | None:
    """What answers at `upstream`: KVPROXY (it answers kvproxy's own /kvproxy/stats, or
    refuses it for want of that kvproxy's admin token), else LLAMA_SERVER, or None when
    nothing answers at all."""
    try:
        stats = await upstream.get_json("/kvproxy/stats", timeout=10)
    except UpstreamError as exc:
        if exc.status is None:
            return None
        body = exc.body
        error = body.get("error") if isinstance(body, dict) else None
        own = isinstance(error, dict) and error.get("code") == "admin_token_required"
        return KVPROXY if own else LLAMA_SERVER
    return KVPROXY if isinstance(stats, dict) and "backends" in stats else LLAMA_SERVER


def unwritable(cache_dir: Path) -> str | None:
    """Managed mode's check before it starts anything: the cache dir is made if missing
    (private) and a file written there and removed; one line when that fails, else None.
    (Root writes past permission bits: a read-only mount still fails here.)"""
    try:
        cache_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".kvproxy-", suffix=".write-check.tmp", dir=cache_dir)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return (
            f"--cache-dir {cache_dir} is not writable ({exc.strerror or exc}): llama-server "
            "saves slots there and kvproxy keeps its index there; give a directory this user "
            "can write (--cache-dir DIR)"
        )
    return None


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
