"""What one recorded request says, whatever API the client spoke: the chat body the server
renders for it (the wire adapters' mirrors of the server's own conversions), the reply as a
chat message, the server's `cache_n`/`prompt_n` and kvproxy's decision. Plain data in, plain
data out: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvproxy import keys
from kvproxy.wire import Conversation, NotKeyed
from kvproxy.wire.capture import Reply, ReplyCapture
from kvproxy.wire.chat import ChatAdapter
from kvproxy.wire.messages import MessagesAdapter
from kvproxy.wire.responses import ResponsesAdapter, ResponsesCapture
from kvproxy_bench.tap import Exchange

CACHE_HEADER = "X-KVProxy-Cache"
EVALUATED_HEADER = "X-KVProxy-Evaluated-Tokens"
DIRECT = "—"  # no kvproxy in the path: no decision


@dataclass
class Record:
    """One request as the benchmark reports it."""

    route: str  # chat, responses, messages
    prompt: dict[str, Any]  # the chat body the server renders: messages + template fields
    reply: dict[str, Any]  # the assistant message the server generated, in chat form
    decision: str
    cache_n: int
    prompt_n: int
    status: int
    error: str | None = None
    evaluated: int = 0  # tokens kvproxy had evaluated on the way (in cache_n, not cached)

    @property
    def presented(self) -> int:
        return self.cache_n + self.prompt_n


def _adapter(path: str) -> ChatAdapter | ResponsesAdapter | MessagesAdapter:
    if path.endswith("/responses"):
        return ResponsesAdapter(keep_reasoning=True)
    if path.endswith("/messages"):
        return MessagesAdapter()
    return ChatAdapter(keep_reasoning=True)


def read(exchange: Exchange) -> Record:
    adapter = _adapter(exchange.path)
    decision = exchange.headers.get(CACHE_HEADER, DIRECT)
    try:
        body = orjson.loads(exchange.body)
    except orjson.JSONDecodeError:
        body = None
    conv = adapter.read(body, "", None) if isinstance(body, dict) else NotKeyed("not JSON")
    if not isinstance(conv, Conversation):
        return Record(adapter.name, {}, {}, decision, 0, 0, exchange.status, conv.reason)
    prompt = {"messages": conv.messages, **keys.template_fields(conv.template)}
    reply = _reply(adapter, bool(body.get("stream")) if isinstance(body, dict) else False, exchange)
    error = None if exchange.status == 200 else exchange.reply[:200].decode("utf-8", "replace")
    if reply is None:
        return Record(
            adapter.name, prompt, {}, decision, 0, 0, exchange.status, error or "no reply"
        )
    timings = reply.timings or {}
    return Record(
        adapter.name,
        prompt,
        adapter.echoed(reply),
        decision,
        int(timings.get("cache_n", 0)),
        int(timings.get("prompt_n", 0)),
        exchange.status,
        error,
        _int_header(exchange.headers.get(EVALUATED_HEADER)),
    )


def _int_header(value: str | None) -> int:
    return int(value) if value is not None and value.isdigit() else 0


def _reply(
    adapter: ChatAdapter | ResponsesAdapter | MessagesAdapter, streaming: bool, ex: Exchange
) -> Reply | None:
    if isinstance(adapter, MessagesAdapter):
        return messages_reply(ex.reply, streaming)
    capture: ReplyCapture | ResponsesCapture
    if isinstance(adapter, ResponsesAdapter):
        capture = ResponsesCapture(streaming)
    else:
        capture = ReplyCapture(streaming)
    capture.feed(ex.reply)
    return capture.finish()


def messages_reply(raw: bytes, streaming: bool) -> Reply | None:
    """An Anthropic Messages reply (JSON or events) as a chat-form Reply; the server's usage
    says `cache_read_input_tokens` = cache_n and `input_tokens` = prompt_n."""
    try:
        if not streaming:
            body = orjson.loads(raw)
            return _from_blocks(body.get("content") or [], body.get("usage") or {})
        blocks: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            event = orjson.loads(line[5:].strip())
            kind = event.get("type")
            if kind == "message_start":
                usage.update((event.get("message") or {}).get("usage") or {})
            elif kind == "message_delta":
                usage.update(event.get("usage") or {})
            elif kind == "content_block_start":
                block = dict(event.get("content_block") or {})
                if block.get("type") == "tool_use":
                    block["input"] = ""
                blocks[int(event.get("index", len(blocks)))] = block
            elif kind == "content_block_delta":
                _add_delta(blocks.setdefault(int(event.get("index", 0)), {}), event["delta"])
        for block in blocks.values():
            if block.get("type") == "tool_use":
                block["input"] = orjson.loads(block["input"] or "{}")
        return _from_blocks([blocks[i] for i in sorted(blocks)], usage)
    except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError, KeyError):
        return None


def _add_delta(block: dict[str, Any], delta: dict[str, Any]) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = block.get("text", "") + delta.get("text", "")
    elif kind == "thinking_delta":
        block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
    elif kind == "input_json_delta":
        block["input"] = block.get("input", "") + delta.get("partial_json", "")


def _from_blocks(blocks: list[dict[str, Any]], usage: dict[str, Any]) -> Reply:
    reply = Reply()
    for block in blocks:
        kind = block.get("type")
        if kind == "text":
            reply.content += block.get("text", "")
        elif kind == "thinking":
            reply.reasoning += block.get("thinking", "")
        elif kind == "tool_use":
            arguments = orjson.dumps(block.get("input") or {}).decode()
            reply.tool_calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": arguments},
                }
            )
    reply.timings = {
        "cache_n": int(usage.get("cache_read_input_tokens") or 0),
        "prompt_n": int(usage.get("input_tokens") or 0),
    }
    return reply
