"""Wire adapters: one per client API. An adapter turns a request body into a Conversation
the cache can key (or says why it cannot), writes the body pinned to a slot, and captures
the reply from the bytes relayed back. It knows no aiohttp server internals and no slots.

Chat completions now; Anthropic Messages and OpenAI Responses plug in here next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..replies import Reply


@dataclass
class Conversation:
    """One keyed request: what the cache needs to know about it."""

    payload: dict[str, Any]
    namespace: str
    keys: list[str]  # keys[i] covers messages[:i+1]
    messages: list[Any]
    template: dict[str, Any]  # request fields the chat template reads besides the messages


@dataclass(frozen=True)
class NotKeyed:
    """Why a request is forwarded without the cache keying it."""

    reason: str


class Capture(Protocol):
    """Fed the upstream reply's bytes as they pass; makes sense of them afterwards. The
    Reply's `timings` carry `cache_n`/`prompt_n` (from `usage` where the API has no timings)."""

    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> Reply | None: ...


class Translator(Protocol):
    """Turns the upstream reply into the client's wire format, chunk by chunk (for an API the
    server cannot pin, whose requests go to one it can)."""

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    def broke_off(self, message: str) -> bytes | None:
        """The last bytes of a reply the server broke off (an error event), or None when the
        body must be cut short instead."""
        ...


class WireAdapter(Protocol):
    name: str
    # Whether the client's own route honours `id_slot` (a request not keyed is pinned there;
    # otherwise it holds every slot while the server picks one).
    route_pins: bool

    def read(
        self, payload: dict[str, Any], model_identity: str, tenant: str | None
    ) -> Conversation | NotKeyed: ...

    def pinned(self, payload: dict[str, Any], slot_id: int) -> bytes:
        """The body to forward, pinned to the slot."""
        ...

    def upstream_path(self, path_qs: str) -> str:
        """Where the pinned request goes on the server."""
        ...

    def translator(self, conversation: Conversation) -> Translator | None:
        """None: the server's reply goes to the client unchanged."""
        ...

    def capture(self, conversation: Conversation) -> Capture: ...

    def echoed(self, reply: Reply) -> dict[str, Any]:
        """The reply as the client will send it back in its next request."""
        ...
