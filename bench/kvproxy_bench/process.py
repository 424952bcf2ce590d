"""A benchmark's helper process (kvproxy, a fake server), its output in a log file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path
from typing import IO


class LoggedProcess:
    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None

    async def start(self, command: list[str]) -> None:
        self._log = await asyncio.to_thread(open, self.log_path, "ab")
        # Its own session, so a kill reaches what it started (kvproxy's llama-server).
        self.process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def exited(self) -> int | None:
        """The exit code once it has ended, else None."""
        return self.process.returncode if self.process is not None else None

    async def kill(self) -> None:
        """SIGKILL to its whole session, as a crash would: nothing gets to clean up."""
        proc = self.process
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await self.stop(grace=0)

    async def stop(self, grace: float) -> None:
        """SIGTERM (kvproxy's graceful path: slots saved), SIGKILL after `grace` seconds."""
        proc = self.process
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        self.process = None
        if self._log is not None:
            await asyncio.to_thread(self._log.close)
            self._log = None
