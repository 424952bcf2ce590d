"""bench/kvproxy_bench/exchanges.py on plain recorded bytes: the chat body the server renders, the
reply in chat form, the server's cache_n/prompt_n and kvproxy's decision, for each API."""

from __future__ import annotations

from typing import Any

import orjson
from kvproxy_bench.exchanges import DIRECT, read
from kvproxy_bench.tap import Exchange


def events(*chunks: dict[str, Any], named: bool = False) -> bytes:
    out = b""
    for c in chunks:
        if named:
            out += b"event: " + c["type"].encode() + b"\n"
        out += b"data: " + orjson.dumps(c) + b"\n\n"
    return out


def test_chat_streamed_through_kvproxy() -> None:
    body = {
        "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "stream": True,
        "temperature": 0.2,
    }
    reply = (
        events(
            {"choices": [{"delta": {"content": "Hel"}}]},
            {"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}]},
            {"choices": [], "timings": {"cache_n": 90, "prompt_n": 7}},
        )
        + b"data: [DONE]\n\n"
    )
    ex = Exchange(
        "/v1/chat/completions", orjson.dumps(body), 200, {"X-KVProxy-Cache": "restored"}, reply
    )
    rec = read(ex)
    assert (rec.route, rec.decision, rec.cache_n, rec.prompt_n) == ("chat", "restored", 90, 7)
    assert rec.prompt == {"messages": body["messages"], "tools": body["tools"]}
    assert rec.reply == {"role": "assistant", "content": "Hello"}
    assert rec.error is None and rec.presented == 97


def test_responses_streamed_direct() -> None:
    body = {
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
        ],
        "stream": True,
    }
    done = {
        "type": "response.completed",
        "response": {
            "status": "completed",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "Yo"}]}],
            "usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 40}},
        },
    }
    ex = Exchange("/v1/responses", orjson.dumps(body), 200, {}, events(done, named=True))
    rec = read(ex)
    assert (rec.route, rec.decision, rec.cache_n, rec.prompt_n) == ("responses", DIRECT, 40, 10)
    assert rec.prompt["messages"][0] == {"role": "system", "content": "You are Codex."}
    assert rec.prompt["messages"][1]["role"] == "user"
    assert rec.reply["role"] == "assistant" and "Yo" in orjson.dumps(rec.reply).decode()


def test_messages_streamed_with_a_tool_call() -> None:
    body = {
        "system": [{"type": "text", "text": "You are Claude Code."}],
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
    }
    reply = events(
        {
            "type": "message_start",
            "message": {"usage": {"input_tokens": 12, "cache_read_input_tokens": 4600}},
        },
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Ok"}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t1", "name": "Read", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"path": "a"}'},
        },
        {"type": "message_delta", "usage": {"output_tokens": 9}},
        named=True,
    )
    ex = Exchange("/v1/messages", orjson.dumps(body), 200, {"X-KVProxy-Cache": "resident"}, reply)
    rec = read(ex)
    assert (rec.route, rec.decision, rec.cache_n, rec.prompt_n) == (
        "messages",
        "resident",
        4600,
        12,
    )
    assert rec.prompt["messages"][0] == {"role": "system", "content": "You are Claude Code."}
    calls = rec.reply["tool_calls"]
    assert calls[0]["function"]["name"] == "Read"
    assert orjson.loads(calls[0]["function"]["arguments"]) == {"path": "a"}


def test_an_error_reply_is_kept_with_its_status() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}]}
    ex = Exchange("/v1/chat/completions", orjson.dumps(body), 503, {}, b'{"error": "busy"}')
    rec = read(ex)
    assert rec.status == 503 and rec.error is not None and "busy" in rec.error
    assert rec.cache_n == 0 and rec.prompt_n == 0


def test_a_body_the_server_cannot_convert_is_reported_not_rendered() -> None:
    ex = Exchange("/v1/responses", b'{"previous_response_id": "r1", "input": "x"}', 400, {}, b"{}")
    rec = read(ex)
    assert rec.prompt == {} and rec.error is not None
