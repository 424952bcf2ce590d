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


class CapturedBytes:
    """A reply's bytes as they were relayed, up to `limit` (a reply beyond it is not
    captured). `feed` only appends: the client's bytes must not wait for parsing; the reply
    is made sense of once, in the subclass's `finish()`, after the client has all of it."""

    def __init__(self, streaming: bool, limit: int = 64 * 1024 * 1024) -> None:
        self.streaming = streaming
        self.limit = limit
        self._buf = bytearray()
        self._overflow = False

    def feed(self, chunk: bytes) -> None:
        if self._overflow:
            return
        self._buf += chunk
        if len(self._buf) > self.limit:
            self._overflow = True
            self._buf.clear()


class ReplyCapture(CapturedBytes):
    """A chat completion's reply, streamed or not."""

    def __init__(self, streaming: bool, limit: int = 64 * 1024 * 1024) -> None:
        super().__init__(streaming, limit)
        self.reply = Reply()
        self._calls: dict[int, dict[str, Any]] = {}

    def finish(self) -> Reply | None:
        if self._overflow:
            return None
        try:
            if self.streaming:
                self._parse_events(bytes(self._buf))
            else:
                self._parse_whole(orjson.loads(bytes(self._buf)))
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError, KeyError):
            return None
        return self.reply

    def _parse_events(self, raw: bytes) -> None:
        content: list[str] = []
        reasoning: list[str] = []
        for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    self._parse_chunk(orjson.loads(data), content, reasoning)
        self.reply.content = "".join(content)
        self.reply.reasoning = "".join(reasoning)
        self.reply.tool_calls = [self._calls[i] for i in sorted(self._calls)]

    def _parse_chunk(self, chunk: dict[str, Any], content: list[str], reasoning: list[str]) -> None:
        if "timings" in chunk:
            self.reply.timings = chunk["timings"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
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
