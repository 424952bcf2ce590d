"""A reply llama-server breaks off: an event stream ends as a complete HTTP response whose
last event is the error; any other body stays cut short, so nobody takes it for whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import RunningProxy, start_proxy

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}],"object":"chat.completion.chunk"}\n\n'
PARTIAL_JSON = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"Hel'


async def _breaking_upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers a chat completion with the start of a reply, then drops the connection, as a
    llama-server that crashes mid-generation does; every other route is a 404."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(
        (int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length")),
        0,
    )
    body = orjson.loads(await reader.readexactly(length)) if length else {}
    if lines[0].startswith("POST /v1/chat/completions"):
        if body.get("stream"):
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
            )
        else:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: 400\r\n\r\n" + PARTIAL_JSON
            )
        await writer.drain()
        await asyncio.sleep(0.05)
    else:
        error = b'{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
        writer.write(
            b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(error), error)
        )
        await writer.drain()
    writer.transport.abort()


@pytest.fixture
async def breaking_proxy(cache_dir: Path) -> AsyncIterator[RunningProxy]:
    server = await asyncio.start_server(_breaking_upstream, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = await start_proxy(f"http://127.0.0.1:{port}", cache_dir)
    try:
        yield proxy
    finally:
        await proxy.stop()
        server.close()


MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


async def test_a_broken_off_stream_is_a_complete_response_ending_in_an_error_event(
    breaking_proxy: RunningProxy,
) -> None:
    body = {"messages": MESSAGES, "stream": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(breaking_proxy.url + "/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        received = await resp.read()  # raises ClientPayloadError on a cut-off body
    events = [e for e in received.split(b"\n\n") if e]
    assert events[0] == CHUNK.strip()
    last = orjson.loads(events[-1].removeprefix(b"data: "))
    assert "broke off" in last["error"]["message"]
    assert b"[DONE]" not in received


async def test_the_openai_sdk_reads_the_error_event_as_an_api_error(
    breaking_proxy: RunningProxy,
) -> None:
    client = openai.AsyncOpenAI(base_url=breaking_proxy.url + "/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="any",
        messages=MESSAGES,
        stream=True,
    )
    pieces = []
    with pytest.raises(openai.APIError) as err:
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content)
    assert pieces == ["Hel"]
    assert "broke off" in err.value.message
    await client.close()


async def test_a_broken_off_json_body_stays_cut_short(breaking_proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(
            breaking_proxy.url + "/v1/chat/completions", json={"messages": MESSAGES}
        ) as resp:
            assert resp.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.read()
