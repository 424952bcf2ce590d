"""The namespaces read under the server's current fingerprint, and the LoRA adapter scales
each one's states are computed with, for kvproxy's own evaluations on a slot (a canonical
prefix before a save, an opening, a stem).

A request's adapter scales are part of its namespace (keys.Identity): every token of a slot
holding that namespace's conversation was computed with them. kvproxy's own evaluation of
more tokens on such a slot must use the same scales, named in full (a request naming none
gets the server's, and the server would reuse the slot's cache computed with others). A
namespace not seen recently is not known here: its evaluation is then not done (the slot is
saved as it is, or no opening is made), never done with other scales.

When the server is seen to start again the namespaces are forgotten (`clear`): a request read
under the fingerprint before, still on its way, has its state neither saved (it was computed
by the server as it is now, and would be filed under what it was) nor restored from
(`current`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from kvproxy import keys
from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.servers.slots import Slot
from kvproxy.server.api import LlamaClient
from kvproxy.wire import Conversation, with_lora

MAX_NAMESPACES = 4096
PRIME_PROMPT = " "
PRIME_TOKENS = 8  # at most what the server shows the slot holding after it


class NamespaceLoras:
    def __init__(self) -> None:
        self._scales: OrderedDict[str, tuple[float, ...]] = OrderedDict()

    def note(self, conv: Conversation) -> None:
        """A request of `conv.namespace` was read, with these scales."""
        self._scales[conv.namespace] = conv.lora
        self._scales.move_to_end(conv.namespace)
        while len(self._scales) > MAX_NAMESPACES:
            self._scales.popitem(last=False)

    def current(self, namespace: str) -> bool:
        """Read under the server's current fingerprint (and recently)."""
        return namespace in self._scales

    def body(self, namespace: str, adapters: int) -> tuple[bool, list[dict[str, Any]] | None]:
        """(known, the `lora` list to send) for an evaluation of `namespace` on a server with
        `adapters` adapters; with none, nothing is needed."""
        scales = self._scales.get(namespace)
        if scales is None:
            return False, None
        if adapters == 0:
            return True, None
        if len(scales) != adapters:
            return False, None
        return True, keys.lora_body(scales)

    def clear(self) -> None:
        self._scales.clear()


async def prime(client: LlamaClient, slot: Slot, lora: list[dict[str, Any]]) -> None:
    """Before a state computed with adapter scales `lora` is restored into the slot: the
    server keeps the scales of the slot's last task across a restore, and clears the slot's
    cache when a request names other ones. A tiny evaluation naming them first makes the
    restored state the one the request (naming them too) goes on from."""
    slot.forget()
    slot.mark_started()
    await client.evaluate(slot.id, PRIME_PROMPT, lora)
    slot.ours_ended(0, PRIME_TOKENS)


async def before_restore(client: LlamaClient, slot: Slot, conv: Conversation) -> None:
    """What a restore for `conv` needs first: `prime` when it names scales of its own."""
    lora = conv.lora_body()
    if lora is not None and not conv.lora_default:
        await prime(client, slot, lora)


def sent(conv: Conversation, decision: Decision) -> dict[str, Any]:
    """The request's body as it goes to the server: naming every LoRA adapter with its scale
    (the server clears a slot last used with other scales), except on a state restored for
    the server's own scales (naming none then leaves the restored cache in place, where the
    slot's last task may have named others)."""
    lora = conv.lora_body()
    if lora is None:
        return conv.payload
    if decision is Decision.RESTORED and conv.lora_default:
        return with_lora(conv.payload, None)
    return with_lora(conv.payload, lora)
