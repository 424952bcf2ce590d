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
    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> Reply | None: ...


class WireAdapter(Protocol):
    name: str

    def read(
        self, payload: dict[str, Any], model_identity: str, tenant: str | None
    ) -> Conversation | NotKeyed: ...

    def pinned(self, payload: dict[str, Any], slot_id: int) -> bytes:
        """The body to forward, pinned to the slot."""
        ...

    def capture(self, conversation: Conversation) -> Capture: ...

    def echoed(self, reply: Reply) -> dict[str, Any]:
        """The reply as the client will send it back in its next request."""
        ...
