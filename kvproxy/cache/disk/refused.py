"""Restores the server refused (400), which leave the slot erased: for a damaged file, or for
its KV layout.

llama-server refuses a state saved with another KV layout: another `--cache-type-k/-v`, flash
attention on where it was off (the V cache is laid out transposed or not), more cells than a
slot has (another `--parallel` or context per slot), the sliding-window cache's size
(`--swa-full`). Such a state is right for the configuration that saved it: it is kept, and
only set aside while this server runs (`RestoreGuard.set_aside`), so switching between two
configurations keeps both configurations' entries. A file that no longer hashes as it did
when saved is dropped.
"""

from __future__ import annotations

import logging

from kvproxy.cache.decisions.policy import RestoreGuard
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry

log = logging.getLogger("kvproxy.cache")


def kept_for_its_layout(
    entry: Entry, damaged: str | None, exc: UpstreamError, guard: RestoreGuard, life: str
) -> bool:
    """Whether the refused entry is kept (set aside for `life`); False: drop it."""
    if damaged is not None:
        log.warning("restore of %s failed, dropping it: %s (%s)", entry.key[:12], exc, damaged)
        return False
    guard.set_aside(life, entry.key)
    log.warning(
        "llama-server refused to restore %s (%s): kept for the settings it was saved with "
        "(another KV cache type, flash attention, context per slot?), not restored while "
        "this server runs",
        entry.key[:12],
        exc,
    )
    return True
