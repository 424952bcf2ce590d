"""Reply capture from the bytes the client received."""

from __future__ import annotations

from typing import Any

import orjson

from kvproxy.wire.capture import ReplyCapture


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def delta(d: dict[str, Any], finish: str | None = None, **extra: object) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}], **extra}


def test_streamed_content_split_anywhere() -> None:
    raw = sse(
        delta({"role": "assistant", "content": None}),
        delta({"reasoning_content": "hmm"}),
        delta({"content": "Hel"}),
        delta({"content": "lo"}),
        delta({}, "stop", timings={"cache_n": 5, "prompt_n": 3}),
    )
    for step in (1, 7, len(raw)):
        cap = ReplyCapture(streaming=True)
        for i in range(0, len(raw), step):
            cap.feed(raw[i : i + step])
        reply = cap.finish()
        assert reply is not None
        assert reply.content == "Hello" and reply.reasoning == "hmm"
        assert reply.finish_reason == "stop" and reply.complete
        assert reply.timings == {"cache_n": 5, "prompt_n": 3}
        assert reply.as_echoed(False) == {"role": "assistant", "content": "Hello"}
        assert reply.as_echoed(True)["reasoning_content"] == "hmm"


def test_streamed_tool_calls_are_assembled() -> None:
    raw = sse(
        delta({"role": "assistant", "content": None}),
        delta(
            {
                "tool_calls": [
                    {
                        "index": 0,
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get", "arguments": ""},
                    }
                ]
            }
        ),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"x"'}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        delta({}, "tool_calls"),
    )
    cap = ReplyCapture(streaming=True)
    cap.feed(raw)
    reply = cap.finish()
    assert reply is not None and reply.finish_reason == "tool_calls"
    assert reply.as_echoed(False) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"x": 1}'}}
        ],
    }


def test_unfinished_stream_is_not_complete() -> None:
    cap = ReplyCapture(streaming=True)
    cap.feed(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n')
    reply = cap.finish()
    assert reply is not None and not reply.complete


def test_non_streamed_reply() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "length",
                "message": {"role": "assistant", "content": "abc"},
            }
        ],
        "timings": {"cache_n": 1, "prompt_n": 2},
    }
    cap = ReplyCapture(streaming=False)
    raw = orjson.dumps(body)
    cap.feed(raw[:10])
    cap.feed(raw[10:])
    reply = cap.finish()
    assert reply is not None and reply.content == "abc" and reply.complete


def test_garbage_is_no_reply() -> None:
    cap = ReplyCapture(streaming=False)
    cap.feed(b"<html>oops")
    assert cap.finish() is None
