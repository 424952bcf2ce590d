"""Capturing the assistant's reply from the bytes relayed to the client, streamed or not."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

COMPLETE_REASONS = frozenset({"stop", "tool_calls", "length"})


@dataclass
class Reply:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    timings: dict[str, Any] | None = None

    @property
    def complete(self) -> bool:
        return self.finish_reason in COMPLETE_REASONS

    def as_echoed(self, keep_reasoning: bool) -> dict[str, Any]:
        """The assistant message as an OpenAI client sends it back on the next turn."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if keep_reasoning and self.reasoning:
            message["reasoning_content"] = self.reasoning
        return message


class ReplyCapture:
    """Fed every chunk the client received; `finish()` makes sense of them afterwards."""

    def __init__(self, streaming: bool, limit: int = 64 * 1024 * 1024) -> None:
        self.streaming = streaming
        self.limit = limit
        self.reply = Reply()
        self._buf = bytearray()
        self._overflow = False
        self._calls: dict[int, dict[str, Any]] = {}

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buf += chunk
        if len(self._buf) > self.limit:
            self._overflow = True
            self._buf.clear()
            return
        if self.streaming:
            self._drain_events()

    def finish(self) -> Reply | None:
        if self._overflow:
            return None
        try:
            if self.streaming:
                self._buf += b"\n\n"
                self._drain_events()
                self.reply.tool_calls = [self._calls[i] for i in sorted(self._calls)]
            else:
                self._parse_whole(orjson.loads(bytes(self._buf)))
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError, KeyError):
            return None
        return self.reply

    def _drain_events(self) -> None:
        buf = self._buf
        while True:
            end, sep = _event_end(buf)
            if end < 0:
                return
            event = bytes(buf[:end])
            del buf[: end + sep]
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    data = line[5:].strip()
                    if data and data != b"[DONE]":
                        self._parse_chunk(orjson.loads(data))

    def _parse_chunk(self, chunk: dict[str, Any]) -> None:
        if "timings" in chunk:
            self.reply.timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.reply.content += delta["content"]
            if delta.get("reasoning_content"):
                self.reply.reasoning += delta["reasoning_content"]
            for call in delta.get("tool_calls") or []:
                self._merge_call(call)
            if choice.get("finish_reason"):
                self.reply.finish_reason = choice["finish_reason"]

    def _merge_call(self, delta: dict[str, Any]) -> None:
        index = int(delta.get("index", len(self._calls)))
        call = self._calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if delta.get("id"):
            call["id"] = delta["id"]
        if delta.get("type"):
            call["type"] = delta["type"]
        fn = delta.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]

    def _parse_whole(self, body: dict[str, Any]) -> None:
        self.reply.timings = body.get("timings")
        choice = (body.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        self.reply.content = message.get("content") or ""
        self.reply.reasoning = message.get("reasoning_content") or ""
        self.reply.tool_calls = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {
                    "name": (call.get("function") or {}).get("name", ""),
                    "arguments": (call.get("function") or {}).get("arguments", ""),
                },
            }
            for call in message.get("tool_calls") or []
        ]
        self.reply.finish_reason = choice.get("finish_reason")


def _event_end(buf: bytearray) -> tuple[int, int]:
    """Index and length of the first event separator (blank line) in an SSE buffer."""
    best, size = -1, 0
    for sep in (b"\n\n", b"\r\n\r\n"):
        i = buf.find(sep)
        if i >= 0 and (best < 0 or i < best):
            best, size = i, len(sep)
    return best, size
