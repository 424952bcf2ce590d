"""OpenAI chat completions (`/v1/chat/completions`): `messages` keyed one by one, `id_slot`
pins, the reply captured from the JSON body or the SSE events."""

from __future__ import annotations

from typing import Any

from kvproxy import keys
from kvproxy.wire import Conversation, NativeRoute, NotKeyed, keyed
from kvproxy.wire.capture import Reply, ReplyCapture


class ChatAdapter(NativeRoute):
    name = "chat"

    def __init__(self, keep_reasoning: bool = False) -> None:
        self.keep_reasoning = keep_reasoning

    def read(
        self, payload: dict[str, Any], model_identity: keys.Identity | str, tenant: str | None
    ) -> Conversation | NotKeyed:
        return keyed(payload, payload, model_identity, tenant)

    def capture(self, conversation: Conversation) -> ReplyCapture:
        return ReplyCapture(streaming=bool(conversation.payload.get("stream")))

    def echoed(self, reply: Reply) -> dict[str, Any]:
        return reply.as_echoed(self.keep_reasoning)
