"""Clearing a slot that may hold another tenant's tokens, before a request runs on it.

The server reuses the common prefix of what a slot holds with any prompt sent to it, and its
`timings.cache_n` says how long that prefix was: a tenant given a slot that still holds
another tenant's prompt learns how much of that prompt it guessed. An erase clears it; a
server without --slot-save-path refuses every slot action (501), erase included, so kvproxy
evaluates a prompt of its own there instead (the scrub).
"""

from __future__ import annotations

from kvproxy.cache.servers.slots import Slot
from kvproxy.http.session import UpstreamError
from kvproxy.server.api import LlamaClient

# What a scrub evaluates. The server keeps only the prefix the slot shares with it (the BOS
# token at most) and drops the rest, so a newcomer's `cache_n` counts this prompt's tokens
# at most, and they are nobody's. One character: a token's prefill; no chat template starts
# with it.
SCRUB_PROMPT = "\n"


async def clear_slot(client: LlamaClient, slot: Slot, erase: bool) -> bool:
    """Clear the server's slot (it must be ours): erased when `erase` and the server can,
    else scrubbed. Returns False when an erase was refused as unsupported (the server has no
    --slot-save-path). Raises UpstreamError when the slot could not be cleared: the request
    must not go."""
    if erase:
        try:
            await client.erase(slot.id)
            return True
        except UpstreamError as exc:
            if exc.status != 501:
                raise
    slot.mark_started()
    await client.evaluate(slot.id, SCRUB_PROMPT)
    return not erase
