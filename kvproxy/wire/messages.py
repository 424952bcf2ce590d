"""Anthropic Messages (`/v1/messages`, Claude Code): pinned by going to chat completions.

llama-server's own `/v1/messages` converts the body into a chat-completions body that carries
only the fields it knows, so `id_slot` is dropped and the server picks the slot itself. kvproxy
makes the same conversion (anthropic.py), sends it to `/v1/chat/completions` with `id_slot`,
and writes the reply back the way the server's `/v1/messages` would have written it: the same
JSON (server-task.cpp `to_json_anthropic`) and the same events (`to_json_anthropic` of partial
results, `to_json_anthropic_stream` of the final one), compact and with keys in the order
the server writes them. Streams ask for `timings_per_token`: the last chunk of each token's
group then carries timings, which marks where a group ends and gives message_start its usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvproxy import keys
from kvproxy.wire import Conversation, NotKeyed, keyed
from kvproxy.wire.anthropic import NotConvertible, convert_message, to_chat
from kvproxy.wire.capture import Reply, ReplyCapture

CHAT_PATH = "/v1/chat/completions"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def _json(value: Any) -> bytes:
    # The server's JSON keeps insertion order (ordered_json): the dicts here are built in its.
    return orjson.dumps(value)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json(data) + b"\n\n"


def _arguments(raw: str) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}


def _stop_reason(finish_reason: Any) -> str:
    return STOP_REASONS.get(finish_reason, "max_tokens") if finish_reason else "max_tokens"


def content_blocks(reasoning: str, content: str, tool_calls: list[dict[str, Any]]) -> list[Any]:
    """A reply as Anthropic content blocks: thinking, text, then tool uses."""
    blocks: list[Any] = []
    if reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if content:
        blocks.append({"type": "text", "text": content})
    for call in tool_calls:
        fn = call.get("function") or {}
        blocks.append(
            {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": fn.get("name") or "",
                "input": _arguments(fn.get("arguments") or ""),
            }
        )
    return blocks


class MessagesAdapter:
    name = "messages"
    route_pins = False

    def read(
        self, payload: dict[str, Any], model_identity: keys.Identity | str, tenant: str | None
    ) -> Conversation | NotKeyed:
        if "stop_sequences" in payload:
            # The reply names the stop sequence that matched; chat completions does not say.
            return NotKeyed("stop_sequences")
        try:
            chat = to_chat(payload)
        except NotConvertible as exc:
            return NotKeyed(str(exc))
        return keyed(chat, chat, model_identity, tenant)

    def pinned(self, payload: dict[str, Any], slot_id: int) -> bytes:
        body = {**payload, "id_slot": slot_id}
        if payload.get("stream"):
            body["timings_per_token"] = True
        return orjson.dumps(body)

    def upstream_path(self, path_qs: str) -> str:
        return CHAT_PATH

    def translator(self, conversation: Conversation) -> MessageStream | MessageJson:
        return MessageStream() if conversation.payload.get("stream") else MessageJson()

    def capture(self, conversation: Conversation) -> ReplyCapture:
        return ReplyCapture(streaming=bool(conversation.payload.get("stream")))

    def echoed(self, reply: Reply) -> dict[str, Any]:
        """Anthropic clients send the reply back as its content blocks (thinking included);
        keyed as the server converts them."""
        blocks = content_blocks(reply.reasoning, reply.content, reply.tool_calls)
        converted = convert_message({"role": "assistant", "content": blocks})
        return converted[0] if converted else {"role": "assistant", "content": ""}


class MessageJson:
    """A non-streamed chat completion, written as the server's /v1/messages reply."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        return b""

    def finish(self) -> bytes:
        try:
            body = orjson.loads(bytes(self._buf))
            choice = body["choices"][0]
            message = choice.get("message") or {}
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
            return bytes(self._buf)  # not a chat completion: as it came
        timings = body.get("timings") or {}
        usage = body.get("usage") or {}
        return _json(
            {
                "id": body.get("id"),
                "type": "message",
                "role": "assistant",
                "content": content_blocks(
                    message.get("reasoning_content") or "",
                    message.get("content") or "",
                    message.get("tool_calls") or [],
                ),
                "model": body.get("model"),
                "stop_reason": _stop_reason(choice.get("finish_reason")),
                "stop_sequence": None,
                "usage": {
                    "cache_read_input_tokens": timings.get("cache_n", 0),
                    "input_tokens": timings.get("prompt_n", 0),
                    "output_tokens": usage.get("completion_tokens", 0),
                },
            }
        )

    def broke_off(self, message: str) -> bytes | None:
        return None


class MessageStream:
    """Chat-completion chunks, grouped per token, written as the server's /v1/messages events."""

    def __init__(self) -> None:
        self._buf = b""
        self._group: list[dict[str, Any]] = []
        # The message so far, and which blocks the partial events started.
        self.content = ""
        self.reasoning = ""
        self.calls: dict[int, dict[str, str]] = {}
        self.thinking_started = False
        self.text_started = False

    def feed(self, chunk: bytes) -> bytes:
        self._buf += chunk
        out = bytearray()
        while b"\n\n" in self._buf:
            raw, self._buf = self._buf.split(b"\n\n", 1)
            out += self._on_event(raw)
        return bytes(out)

    def finish(self) -> bytes:
        return self._on_event(self._buf) if self._buf.strip() else b""

    def broke_off(self, message: str) -> bytes | None:
        return _event("error", {"code": 502, "message": message, "type": "server_error"})

    def _on_event(self, raw: bytes) -> bytes:
        data = b"".join(line[5:].strip() for line in raw.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return raw + b"\n\n"  # a keep-alive ping (":"), as the server sends it for both
        if data == b"[DONE]":
            return b""  # the server ends its Anthropic streams without one
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return b""
        if not isinstance(chunk, dict):
            return b""
        if "error" in chunk:
            return _event("error", chunk["error"])
        self._group.append(chunk)
        if "timings" not in chunk:
            return b""  # the group of this token goes on
        group, self._group = self._group, []
        final = any(c.get("finish_reason") for ch in group for c in ch.get("choices") or [])
        return self._final(group) if final else self._partial(group)

    @staticmethod
    def _deltas(group: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for chunk in group:
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if (
                    delta.get("content")
                    or delta.get("reasoning_content")
                    or delta.get("tool_calls")
                ):
                    out.append(delta)
        return out

    def _accumulate(self, deltas: list[dict[str, Any]]) -> None:
        for d in deltas:
            self.reasoning += d.get("reasoning_content") or ""
            self.content += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                call = self.calls.setdefault(int(tc.get("index", 0)), {"id": "", "name": ""})
                call["id"] = call["id"] or tc.get("id") or ""
                call["name"] += (tc.get("function") or {}).get("name") or ""

    def _partial(self, group: list[dict[str, Any]]) -> bytes:
        """server_task_result_cmpl_partial::to_json_anthropic."""
        out = bytearray()
        last = group[-1]
        first = any(
            (c.get("delta") or {}).get("role") == "assistant"
            for ch in group
            for c in ch.get("choices") or []
        )
        if first:
            timings = last.get("timings") or {}
            message: dict[str, Any] = {
                "id": last.get("id"),
                "type": "message",
                "role": "assistant",
                "content": [],
                "model": last.get("model"),
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "cache_read_input_tokens": timings.get("cache_n", 0),
                    "input_tokens": timings.get("prompt_n", 0),
                    "output_tokens": 0,
                },
            }
            out += _event("message_start", {"type": "message_start", "message": message})
        deltas = self._deltas(group)
        self._accumulate(deltas)
        text_index = 1 if self.reasoning else 0
        started = _Started(self.thinking_started, self.text_started)
        for d in deltas:
            out += _text_events(d, text_index, started)
            for tc in d.get("tool_calls") or []:
                index = (1 if self.reasoning else 0) + (1 if started.text else 0)
                index += int(tc.get("index", 0))
                fn = tc.get("function") or {}
                if fn.get("name"):
                    block = {"type": "tool_use", "id": tc.get("id") or "", "name": fn["name"]}
                    out += _start(index, block)
                if fn.get("arguments"):
                    delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
                    out += _delta(index, delta)
        self.thinking_started |= any(d.get("reasoning_content") for d in deltas)
        self.text_started |= any(d.get("content") for d in deltas)
        return bytes(out)

    def _final(self, group: list[dict[str, Any]]) -> bytes:
        """server_task_result_cmpl_final::to_json_anthropic_stream: the last token's diffs
        (with block-start flags of its own, as the server keeps them), then the closing
        events."""
        out = bytearray()
        deltas = self._deltas(group)
        self._accumulate(deltas)
        has_thinking, has_text = bool(self.reasoning), bool(self.content)
        text_index = 1 if has_thinking else 0
        started = _Started(thinking=False, text=False)
        calls_started: set[int] = set()
        for d in deltas:
            out += _text_events(d, text_index, started)
            for tc in d.get("tool_calls") or []:
                i = int(tc.get("index", 0))
                index = (1 if has_thinking else 0) + (1 if has_text else 0) + i
                if i not in calls_started:
                    call = self.calls.get(i, {"id": "", "name": ""})
                    block = {"type": "tool_use", "id": call["id"], "name": call["name"]}
                    out += _start(index, block)
                    calls_started.add(i)
                arguments = (tc.get("function") or {}).get("arguments")
                if arguments:
                    out += _delta(index, {"type": "input_json_delta", "partial_json": arguments})
        if has_thinking:
            out += _delta(0, {"type": "signature_delta", "signature": ""})
            out += _stop(0)
        if has_text:
            out += _stop(text_index)
        for i in range(len(self.calls)):
            out += _stop((1 if has_thinking else 0) + (1 if has_text else 0) + i)
        finish = next(
            (
                c.get("finish_reason")
                for ch in group
                for c in ch.get("choices") or []
                if c.get("finish_reason")
            ),
            None,
        )
        timings = group[-1].get("timings") or {}
        out += _event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": _stop_reason(finish), "stop_sequence": None},
                "usage": {"output_tokens": timings.get("predicted_n", 0)},
            },
        )
        out += _event("message_stop", {"type": "message_stop"})
        return bytes(out)


@dataclass
class _Started:
    """Which of the reply's blocks the events so far have started."""

    thinking: bool
    text: bool


def _text_events(d: dict[str, Any], text_index: int, started: _Started) -> bytes:
    """One diff's reasoning and text as events: a block's start the first time, then deltas."""
    out = bytearray()
    if d.get("reasoning_content"):
        if not started.thinking:
            out += _start(0, {"type": "thinking", "thinking": ""})
            started.thinking = True
        out += _delta(0, {"type": "thinking_delta", "thinking": d["reasoning_content"]})
    if d.get("content"):
        if not started.text:
            out += _start(text_index, {"type": "text", "text": ""})
            started.text = True
        out += _delta(text_index, {"type": "text_delta", "text": d["content"]})
    return bytes(out)


def _start(index: int, block: dict[str, Any]) -> bytes:
    data = {"type": "content_block_start", "index": index, "content_block": block}
    return _event("content_block_start", data)


def _delta(index: int, delta: dict[str, Any]) -> bytes:
    return _event(
        "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}
    )


def _stop(index: int) -> bytes:
    return _event("content_block_stop", {"type": "content_block_stop", "index": index})
