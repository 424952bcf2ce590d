"""How kvproxy reports what goes wrong with the cache dir or the server's slot actions: a disk
error once at error level (then at debug, until a save succeeds again), and a server that
cannot save into the cache dir by turning the disk cache off, with the fix."""

from __future__ import annotations

import logging
from pathlib import Path

from kvproxy.cache.servers.backend import Backend
from kvproxy.server.savepath import saves_elsewhere

log = logging.getLogger("kvproxy.cache")


class DiskTrouble:
    def __init__(self, backend: Backend, cache_dir: Path) -> None:
        self.backend = backend
        self.cache_dir = cache_dir
        self._logged = False

    def error(self, message: str) -> None:
        if not self._logged:
            log.error("%s (further disk errors logged at debug level)", message)
            self._logged = True
        else:
            log.debug(message)

    def recovered(self) -> None:
        self._logged = False

    def no_slot_actions(self, why: str = "llama-server has no --slot-save-path") -> None:
        self.backend.refuses_slot_actions()
        log.warning(
            "%s: disk cache off (start llama-server with --slot-save-path %s, or pass "
            "--cache-dir <its --slot-save-path>)",
            why,
            self.cache_dir,
        )

    async def file_gone(self, slot_id: int, exc: FileNotFoundError) -> None:
        """A save the server answered left no file: the disk cache goes off only when the
        server saves into another dir, not when the file was removed meanwhile."""
        if await saves_elsewhere(self.backend.client, slot_id, self.cache_dir):
            self.no_slot_actions(f"{exc} in --cache-dir: its --slot-save-path is another dir")
        else:
            self.error(f"the file of a save of slot {slot_id} was removed: {exc}")
