"""`chaos`'s requests on the wire: one conversation's body for each API it speaks, sending it
(whole, streamed, or hung up mid-stream) under a time bound, and reading the answer back.

A conversation is kept in chat form (system, user, assistant, …) and written out per API:
chat completions as is; Anthropic Messages with the system prompt in `system`; Responses
with it in `instructions` and the reply echoed as an `output_text` message item, as Codex
echoes it. Every request is greedy (temperature 0) so answers can be compared.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvproxy_bench.chaos_plan import Kind, Outcome, Wire, classify

MODEL = "chaos"


def route_body(
    wire: Wire, messages: list[dict[str, Any]], max_tokens: int, stream: bool = False
) -> tuple[str, dict[str, Any]]:
    """The path and body of the next turn of a conversation held in chat form."""
    system, rest = messages[0]["content"], messages[1:]
    if wire is Wire.CHAT:
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens}
        path = "/v1/chat/completions"
    elif wire is Wire.MESSAGES:
        body = {"model": MODEL, "system": system, "messages": rest, "max_tokens": max_tokens}
        path = "/v1/messages"
    else:
        items: list[dict[str, Any]] = []
        for m in rest:
            if m["role"] == "assistant":
                part = {"type": "output_text", "text": m["content"]}
                items.append({"type": "message", "role": "assistant", "content": [part]})
            else:
                items.append({"role": m["role"], "content": m["content"]})
        body = {"model": MODEL, "instructions": system, "input": items}
        body["max_output_tokens"] = max_tokens
        path = "/v1/responses"
    body["temperature"] = 0
    if stream:
        body["stream"] = True
    return path, body


def answer_of(wire: Wire | None, body: Any) -> str | None:
    """The reply's text in a JSON answer (`wire` None: `/completion`), None if it has none."""
    if not isinstance(body, dict):
        return None
    try:
        if wire is None:
            return str(body["content"])
        if wire is Wire.CHAT:
            return str(body["choices"][0]["message"]["content"] or "")
        if wire is Wire.MESSAGES:
            return "".join(b["text"] for b in body["content"] if b.get("type") == "text")
        texts = [
            part["text"]
            for item in body["output"]
            if item.get("type") == "message"
            for part in item.get("content") or []
            if part.get("type") == "output_text"
        ]
        return "".join(texts)
    except (KeyError, IndexError, TypeError):
        return None


@dataclass
class Stream:
    """What a streamed answer said, event by event."""

    text: str = ""
    done: bool = False  # its terminal event came
    error: bool = False  # an error event came
    timings: dict[str, Any] = field(default_factory=dict)

    def feed(self, wire: Wire, line: bytes) -> None:
        line = line.strip()
        if line.startswith(b"event:") and line[6:].strip() == b"error":
            self.error = True
        if not line.startswith(b"data:"):
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(event, dict):
            return
        if "error" in event or event.get("type") == "error":
            self.error = True
        elif wire is Wire.CHAT:
            for choice in event.get("choices") or []:
                self.text += (choice.get("delta") or {}).get("content") or ""
            if isinstance(event.get("timings"), dict):
                self.timings = event["timings"]
        elif event.get("type") == "content_block_delta":
            self.text += (event.get("delta") or {}).get("text") or ""
        elif event.get("type") == "message_stop":
            self.done = True


@dataclass
class Sent:
    outcome: Outcome
    status: int | None = None
    text: str | None = None  # the answer, when it came whole
    headers: dict[str, str] = field(default_factory=dict)
    timings: dict[str, Any] = field(default_factory=dict)
    detail: str = ""

    @property
    def cache_state(self) -> str:
        return self.headers.get("X-KVProxy-Cache", "-")

    @property
    def cache_n(self) -> int:
        return int(self.timings.get("cache_n") or 0)


def _proxy_error(raw: bytes) -> bool:
    """kvproxy's own 500 says `proxy_error`; aiohttp's for an unhandled exception is text."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return True
    error = body.get("error") if isinstance(body, dict) else None
    return not isinstance(error, dict) or error.get("code") == "proxy_error"


async def send(
    session: aiohttp.ClientSession,
    url: str,
    kind: Kind,
    wire: Wire | None,
    body: dict[str, Any] | None,
    headers: dict[str, str],
    bound: float,
) -> Sent:
    """One request, whole, streamed or hung up, classified; never longer than `bound`."""
    try:
        async with asyncio.timeout(bound):
            return await _send(session, url, kind, wire, body, headers)
    except TimeoutError:
        return Sent(classify(None, timed_out=True), detail=f"no answer within {bound:g}s")


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    kind: Kind,
    wire: Wire | None,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> Sent:
    try:
        if body is None:
            request = session.get(url, headers=headers)
        else:
            request = session.post(url, data=orjson.dumps(body), headers=headers)
        async with request as resp:
            got = dict(resp.headers)
            streamed = bool(body and body.get("stream")) and resp.status == 200
            if not streamed:
                raw = await resp.read()
                if resp.status == 200 and kind is Kind.METRICS:
                    return Sent(classify(200), 200, raw.decode("utf-8", "replace"), got)
                parsed = orjson.loads(raw) if resp.status == 200 else None
                text = answer_of(wire, parsed) if kind is not Kind.METRICS else ""
                timings = parsed.get("timings") if isinstance(parsed, dict) else None
                outcome = classify(resp.status, proxy_error=_proxy_error(raw))
                if outcome is Outcome.OK and text is None:
                    outcome = Outcome.OTHER  # a 200 without an answer in it
                detail = "" if resp.status == 200 else raw[:200].decode("utf-8", "replace")
                return Sent(outcome, resp.status, text, got, timings or {}, detail)
            assert wire is not None
            stream = Stream()
            async for line in resp.content:
                stream.feed(wire, line)
                if kind is Kind.HANG_UP and stream.text:
                    resp.close()  # drop the connection as a client closing its tab does
                    return Sent(classify(200, hung_up=True), 200, None, got)
            outcome = classify(200, complete=stream.done, error_event=stream.error)
            return Sent(outcome, 200, stream.text if stream.done else None, got, stream.timings)
    except aiohttp.ClientConnectorError as exc:
        return Sent(classify(None, refused=True), detail=str(exc))
    except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as exc:
        # After the request went out: the proxy died under it, or the answer broke off.
        return Sent(classify(None), detail=f"{type(exc).__name__}: {exc}")
