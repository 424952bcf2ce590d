"""`kvproxy doctor`'s probe of llama-server's RAM prompt cache (`--cache-ram`, on by default).

That cache keeps the prompt of a slot the server gives to other work, and loads the closest
prompt it kept into any slot for any request (server_prompt_cache::load): another tenant's
too, so a tenant's `timings.cache_n` tells how much of another tenant's prompt it sent,
however kvproxy clears its slots. The server does not show the setting (`/props` has no such
field), so the probe watches it work: one idle slot evaluates a prompt, then another, then
the first again. Without the cache the first comes back with its BOS token reused at most;
with it, whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kvproxy.http.session import UpstreamError
from kvproxy.server.api import LlamaClient, SlotInfo
from kvproxy.server.checks import Check

NAME = "RAM prompt cache"
FIRST = "A first prompt the doctor sends, to see whether the server keeps it aside. " * 3
OTHER = "Something else entirely, with no words in common at its start. " * 3


async def check_prompt_cache(llama: LlamaClient, slots: Sequence[SlotInfo]) -> Check:
    slot = next((s.id for s in slots if not s.is_processing), None)
    if slot is None:
        return Check(NAME, "warn", "every slot is busy: not probed")
    first = await llama.tokenize(FIRST)
    try:
        await llama.evaluate(slot, first)
        await llama.evaluate(slot, await llama.tokenize(OTHER))
        timings = await llama.evaluate(slot, first)
    finally:
        with contextlib.suppress(UpstreamError):  # 501 without --slot-save-path
            await llama.erase(slot)
    reused = int(timings.get("cache_n", 0))
    if reused < len(first) // 2:
        return Check(NAME, "ok", "off: no slot is given a prompt another slot held")
    return Check(
        NAME,
        "warn",
        f"on: a prompt the slot had given up came back from it ({reused} of {len(first)} "
        "tokens); with several tenants (--client-api-keys, --tenant-header), a tenant's "
        "cache_n would tell how much of another's prompt it sent",
        "with several tenants, start llama-server with --cache-ram 0 (kvproxy's disk cache "
        "does that cache's work)",
    )
