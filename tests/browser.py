"""Debian's chromium, headless, for the status page tests: the DOM after the page's scripts
ran, and a screenshot. A missing chromium fails the test (`.ci/run` installs it)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")


def chromium() -> str:
    for name in CHROMIUM:
        found = shutil.which(name)
        if found:
            return found
    raise AssertionError(
        "no chromium on PATH: the status page is tested in a real headless browser "
        "(`apt-get install chromium`, as .ci/run does)"
    )


async def _run(url: str, *flags: str, timeout: float = 90) -> str:
    # A profile of its own: nothing of another run's (or the user's) browser state.
    with tempfile.TemporaryDirectory(prefix="kvproxy-chromium-") as profile:
        proc = await asyncio.create_subprocess_exec(
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            # Virtual time runs the page's timers and waits for its fetches: the DOM is dumped
            # after a few polls of status.json.
            "--virtual-time-budget=5000",
            *flags,
            url,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    assert proc.returncode == 0, f"chromium failed ({proc.returncode}): {err.decode()[-2000:]}"
    return out.decode()


async def dump_dom(url: str) -> str:
    return await _run(url, "--dump-dom")


async def screenshot(url: str, path: Path, size: str = "1100,1000") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    await _run(url, f"--screenshot={path}", f"--window-size={size}")
    assert path.exists() and path.stat().st_size > 1000, f"no screenshot at {path}"
