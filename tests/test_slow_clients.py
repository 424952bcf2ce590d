"""Slow clients (slowloris) hold nothing for long: a request head trickled past
--client-timeout is cut off, a body trickled past it gets a 408 and never reaches the server
(kvproxy forwards only whole bodies, so a slow client holds none of llama-server's HTTP
threads), and connections beyond --max-connections are answered 503 at once. Meanwhile
other clients are served."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

from kvproxy.edge.listen import Admission, admit

from .conftest import Maker, RunningProxy

# What each test waits at most for kvproxy to act: a bound so a broken build fails rather than
# hangs, far above the 1 s --client-timeout the tests set.
BOUND = 30.0


async def connect(proxy: RunningProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def trickle(
    writer: asyncio.StreamWriter, reader: asyncio.StreamReader, piece: bytes
) -> bytes:
    """Writes `piece` every 0.2 s until kvproxy answers or closes; returns what it said."""
    answer = asyncio.create_task(reader.read(4096))
    try:
        async with asyncio.timeout(BOUND):
            while not answer.done():
                with contextlib.suppress(ConnectionError):
                    writer.write(piece)
                    await writer.drain()
                await asyncio.wait({answer}, timeout=0.2)
        return answer.result()
    finally:
        answer.cancel()
        writer.close()


async def tokenize_ok(proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/tokenize", json={"content": "hello"}) as resp:
            assert resp.status == 200, await resp.text()
            assert "tokens" in await resp.json()


async def test_a_trickled_request_head_is_cut_off_and_others_are_served(make: Maker) -> None:
    _, proxy = await make(client_timeout=1.0)
    reader, writer = await connect(proxy)
    writer.write(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    slow = asyncio.create_task(trickle(writer, reader, b"X-Slow: 1\r\n"))
    await tokenize_ok(proxy)
    assert await slow == b""  # closed without an answer: the head never ended


async def test_a_trickled_body_gets_408_and_never_reaches_the_server(make: Maker) -> None:
    fake, proxy = await make(client_timeout=1.0)
    before = len(fake.requests)
    reader, writer = await connect(proxy)
    writer.write(
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100000\r\n\r\n{"content": "'
    )
    slow = asyncio.create_task(trickle(writer, reader, b"a"))
    await tokenize_ok(proxy)
    answer = await slow
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b'"request_timeout"' in answer
    assert len([r for r in fake.requests[before:] if r[1].startswith("/tokenize")]) == 1


async def test_a_slow_whole_body_reaches_the_server_whole(make: Maker) -> None:
    fake, proxy = await make(client_timeout=10.0)
    body = b'{"content": "hello there"}'
    reader, writer = await connect(proxy)
    writer.write(
        b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    for i in range(0, len(body), 8):
        writer.write(body[i : i + 8])
        await writer.drain()
        await asyncio.sleep(0.1)
    async with asyncio.timeout(BOUND):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert b'"tokens"' in answer


async def test_connections_over_the_cap_are_answered_503(make: Maker) -> None:
    _, proxy = await make(max_connections=3)
    held = [await connect(proxy) for _ in range(3)]
    await asyncio.sleep(0.2)
    reader, writer = await connect(proxy)
    async with asyncio.timeout(BOUND):
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503"), answer
    assert b"--max-connections" in answer
    for _, w in held:
        w.close()
    async with asyncio.timeout(BOUND):
        while True:  # the server sees the closed connections go
            try:
                await tokenize_ok(proxy)
                break
            except (AssertionError, aiohttp.ClientError):
                await asyncio.sleep(0.1)


async def test_one_client_holding_slow_connections_leaves_room_for_another(make: Maker) -> None:
    """One client (127.0.0.1) re-opening slow connections gets its share of --max-connections,
    then 503s; another client (127.0.0.2) is still served."""
    _, proxy = await make(max_connections=8, client_timeout=30.0)
    held = [await connect(proxy) for _ in range(8)]
    await asyncio.sleep(0.2)
    refused = 0
    for reader, _ in held:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                answer = await reader.read()
                assert answer.startswith(b"HTTP/1.1 503"), answer
                assert b"its share" in answer
                refused += 1
    assert refused == 4  # half for a client alone
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
    async with aiohttp.ClientSession(connector=connector) as s:
        for _ in range(5):
            async with s.post(proxy.url + "/tokenize", json={"content": "hi"}) as resp:
                assert resp.status == 200, await resp.text()
    for _, w in held:
        w.close()


def test_a_clients_share_shrinks_as_clients_come() -> None:
    assert admit(3, 3, 1, 8) is Admission.ADMIT
    assert admit(4, 4, 1, 8) is Admission.OVER_SHARE
    assert admit(0, 4, 2, 8) is Admission.ADMIT
    assert admit(2, 6, 3, 8) is Admission.OVER_SHARE  # 8 // 3 = 2
    assert admit(0, 8, 3, 8) is Admission.FULL
    assert admit(0, 0, 1, 1) is Admission.ADMIT  # never under one
