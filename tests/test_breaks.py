"""Breaks a red-team run found, each reproduced here against what the server alone does."""

from __future__ import annotations

import asyncio
import os
import secrets
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvproxy.edge.app import SERVICE
from kvproxy.server.managed import free_port

from .conftest import Maker, RealServer, RunningProxy, start_proxy, start_real_server

CHAT = b'{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0}'


async def raw_request(
    url: str, method: str, path: str, headers: bytes = b"", body: bytes = b""
) -> tuple[int, bytes]:
    """One request written byte for byte (header values aiohttp's client would not send)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n".encode()
    if body:
        head += b"Content-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n".encode()
    writer.write(head + headers + b"\r\n" + body)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 120)
    writer.close()
    status = int(raw.split(b" ", 2)[1])
    return status, raw.partition(b"\r\n\r\n")[2]


@pytest.fixture
async def rproxy(real_server: RealServer) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(real_server.url, real_server.cache_dir)
    yield running
    await running.stop()


# --- (3) a header value that is not UTF-8


@pytest.mark.real
@pytest.mark.parametrize("tenant_header", [None, "X-Tenant"])
async def test_non_utf8_tenant_header_is_hashed_not_a_500(
    real_server: RealServer, tmp_path: Path, tenant_header: str | None
) -> None:
    proxy = await start_proxy(real_server.url, real_server.cache_dir, tenant_header=tenant_header)
    try:
        name = (tenant_header or "Authorization").encode()
        header = name + b": Bearer \xff\xfe\r\n"
        direct, _ = await raw_request(real_server.url, "POST", "/v1/chat/completions", header, CHAT)
        status, body = await raw_request(proxy.url, "POST", "/v1/chat/completions", header, CHAT)
        assert direct == 200
        assert status == 200, body[:300]
    finally:
        await proxy.stop()


async def test_non_utf8_authorization_against_client_and_admin_keys(tmp_path: Path) -> None:
    from .fakeserver import FakeLlamaServer

    async with FakeLlamaServer(slot_save_path=tmp_path) as fake:
        proxy = await start_proxy(
            fake.url, tmp_path, host="0.0.0.0", client_api_keys="k1", admin_token="t"
        )
        try:
            header = b"Authorization: Bearer \xff\xfe\r\n"
            status, body = await raw_request(proxy.url, "GET", "/v1/models", header)
            assert status == 401, body[:300]
            status, body = await raw_request(proxy.url, "GET", "/kvproxy/stats", header)
            assert status == 401, body[:300]
        finally:
            await proxy.stop()


# --- (5) a FIFO in the cache dir


def _unblock(fifo: Path) -> None:
    """Give a reader stuck on `fifo` its EOF (if anyone opened it blocking)."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass  # nobody is reading: nothing to unblock


def _finishes(fn: Callable[[], Any], fifo: Path, within: float = 5.0) -> Any:
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(within)
    stuck = worker.is_alive()
    if stuck:
        _unblock(fifo)
        worker.join(5)
    assert not stuck, f"blocked on the FIFO {fifo.name}"
    return out[0]


def test_fifo_index_record_neither_blocks_nor_loads(tmp_path: Path) -> None:
    from kvproxy.store.files import StoreFiles

    key = "ab" * 16
    os.mkfifo(tmp_path / f"{key}.idx")  # an old-style record, read when importing
    loaded = _finishes(lambda: StoreFiles(tmp_path).scan({}, sweep=True), tmp_path / f"{key}.idx")
    assert loaded.imported == [] and [k for k, _ in loaded.problems] == [key]
    assert not (tmp_path / f"{key}.idx").exists()  # swept like any unreadable record


def test_fifo_in_place_of_the_text_does_not_pin_a_thread(tmp_path: Path) -> None:
    from kvproxy.store.files import StoreFiles

    key = "cd" * 16
    os.mkfifo(tmp_path / f"{key}.msgs")
    files = StoreFiles(tmp_path)
    assert _finishes(lambda: files.read_messages(key), tmp_path / f"{key}.msgs") is None
    assert _finishes(lambda: files.read_many_messages([key]), tmp_path / f"{key}.msgs") == []


async def test_proxy_starts_with_a_fifo_index_record(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fifo = cache / f"{'ef' * 16}.idx"
    os.mkfifo(fifo)
    try:
        proxy = await asyncio.wait_for(start_proxy("http://127.0.0.1:9", cache), 10)
    except TimeoutError:
        _unblock(fifo)
        raise
    await proxy.stop()


# --- (9) --max-body on chunked bodies of pass-through routes


@pytest.mark.real
async def test_max_body_applies_to_chunked_pass_through_bodies(real_server: RealServer) -> None:
    proxy = await start_proxy(real_server.url, real_server.cache_dir, max_body="1MiB")
    body = orjson.dumps({"content": "hello " * (2 * 1024 * 1024 // 6 + 1)})

    async def chunked() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 64 * 1024):
            yield body[i : i + 64 * 1024]

    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(proxy.url + "/tokenize", data=body) as r:
                sized = (r.status, await r.read())
            async with s.post(proxy.url + "/tokenize", data=chunked()) as r:
                assert r.request_info.headers.get("Transfer-Encoding") == "chunked"
                streamed = (r.status, await r.read())
            async with s.post(proxy.url + "/tokenize", data=b'{"content": "small"}') as r:
                assert r.status == 200  # still serving
        assert sized[0] == 413
        assert streamed == sized
    finally:
        await proxy.stop()


# --- (6) Vertex AI's /predict reaches every server route, /slots included


@pytest.mark.real
async def test_vertex_predict_route_is_refused(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HTTP_PORT", str(port))  # the server listens there, whatever -port says
    server = await asyncio.to_thread(start_real_server, cache_dir, port=port)
    try:
        proxy = await start_proxy(server.url, cache_dir)
        erase = {"instances": [{"@requestFormat": "/slots/:id_slot"}]}
        chat = {"instances": [{"@requestFormat": "chatCompletions", **orjson.loads(CHAT)}]}
        try:
            async with aiohttp.ClientSession() as s:
                # The server alone: a slot action through the Vertex route.
                url = server.url + "/predict?id_slot=0&action=erase"
                async with s.post(url, json=erase) as r:
                    direct = await r.json()
                assert r.status == 200 and direct["predictions"][0]["id_slot"] == 0
                for path in ("/predict", "//predict", "/v1/../predict"):
                    for body in (erase, chat):
                        url = proxy.url + path + "?id_slot=0&action=erase"
                        async with s.post(url, json=body) as r:
                            assert r.status == 403, (path, await r.text())
                            assert (await r.json())["error"]["code"] == "forbidden_route"
        finally:
            await proxy.stop()
    finally:
        await asyncio.to_thread(server.stop)


async def test_custom_vertex_predict_route_is_refused(
    make: Maker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "my/predict")  # the server adds the leading slash
    fake, proxy = await make()
    for path in ("/my/predict", "/predict"):
        status, body = await raw_request(proxy.url, "POST", path, body=b'{"instances": []}')
        assert status == 403, body
    assert not [r for r in fake.requests if "predict" in r[1]]


# --- (8) resumable streams: the server keys them by a client-chosen id, with no owner


@pytest.mark.real
async def test_resumable_streams_never_cross_tenants(
    real_server: RealServer, rproxy: RunningProxy
) -> None:
    conv_id = "conv-A-7f3e"
    body = {**orjson.loads(CHAT), "max_tokens": 48, "stream": True}
    a = {"Authorization": "Bearer tenant-a", "X-Conversation-Id": conv_id}
    b = {"Authorization": "Bearer tenant-b"}
    async with aiohttp.ClientSession() as s:
        async with s.post(rproxy.url + "/v1/chat/completions", json=body, headers=a) as r:
            assert r.status == 200
            await r.content.readany()  # tenant A reads a little, then hangs up
        await asyncio.sleep(0.5)
        for method, path, data in (
            ("GET", f"/v1/stream?conv_id={conv_id}", None),
            ("POST", "/v1/streams/lookup", {"conversation_ids": [conv_id]}),
            ("DELETE", f"/v1/stream?conv_id={conv_id}", None),
        ):
            async with s.request(method, rproxy.url + path, json=data, headers=b) as r:
                text = await r.text()
                assert r.status == 403, (method, path, r.status, text[:200])
                assert (await r.json())["error"]["code"] == "forbidden_route"
        # The id never reached the server: no session kept generating after A hung up.
        async with s.get(real_server.url + f"/v1/stream?conv_id={conv_id}") as r:
            assert r.status == 404


# --- (4) JSON orjson cannot read or write back: a UTF-8 BOM, deep nesting


def _deep(levels: int) -> bytes:
    return b'{"a":' * (levels - 1) + b"[]" + b"}" * (levels - 1)


def _with(body: bytes, name: bytes, value: bytes) -> bytes:
    return body[:-1] + b',"' + name + b'":' + value + b"}"


PROMPT = b'{"prompt":"Hi","n_predict":4,"temperature":0}'
MESSAGES = b'{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0}'
RESPONSES = b'{"input":"Hi","max_output_tokens":4,"temperature":0}'
DEEP_CASES = [
    ("/v1/chat/completions", _with(CHAT, b"x", _deep(300))),
    ("/v1/chat/completions", _with(CHAT, b"tools", b"[" + _deep(300) + b"]")),
    ("/v1/chat/completions", _with(CHAT, b"chat_template_kwargs", _deep(300))),
    ("/v1/chat/completions", _with(CHAT, b"x", _deep(1100))),
    ("/v1/chat/completions", b"\xef\xbb\xbf" + CHAT),
    ("/v1/chat/completions", b"\xef\xbb\xbf" + _with(CHAT, b"x", _deep(300))),
    ("/completion", _with(PROMPT, b"x", _deep(300))),
    ("/completion", _with(PROMPT, b"x", _deep(1100))),
    ("/completion", b"\xef\xbb\xbf" + PROMPT),
    ("/v1/completions", _with(PROMPT, b"x", _deep(300))),
    ("/v1/messages", _with(MESSAGES, b"x", _deep(300))),
    ("/v1/messages", b"\xef\xbb\xbf" + MESSAGES),
    ("/v1/responses", _with(RESPONSES, b"x", _deep(300))),
    ("/v1/responses", b"\xef\xbb\xbf" + RESPONSES),
]


def _case_id(path: str, body: bytes) -> str:
    bom = "bom-" if body.startswith(b"\xef\xbb\xbf") else ""
    return f"{path}-{bom}{body.count(b'{')}"


@pytest.mark.real
@pytest.mark.parametrize(
    ("path", "body"),
    DEEP_CASES,
    ids=[_case_id(p, b) for p, b in DEEP_CASES],
)
async def test_bodies_orjson_cannot_handle_get_what_the_server_says(
    real_server: RealServer, rproxy: RunningProxy, path: str, body: bytes
) -> None:
    direct, want = await raw_request(real_server.url, "POST", path, body=body)
    status, got = await raw_request(rproxy.url, "POST", path, body=body)
    assert b"proxy_error" not in got, got[:200]
    assert status == direct, (direct, want[:200], status, got[:200])
    # Still serving, and slots the server used meanwhile were re-read, not trusted blindly.
    status, _ = await raw_request(rproxy.url, "POST", "/v1/chat/completions", body=CHAT)
    assert status == 200


# --- (7) more than one completion: the server runs the others on further idle slots


async def _post_json(
    url: str, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, dict[str, Any], str]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None), r.headers.get("X-KVProxy-Cache", "")


@pytest.mark.real
@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("/v1/chat/completions", "n"),
        ("/v1/chat/completions", "n_cmpl"),
        ("/completion", "n_cmpl"),
        ("/v1/completions", "n"),
    ],
)
async def test_several_completions_hold_every_slot(
    real_server: RealServer, rproxy: RunningProxy, path: str, field: str
) -> None:
    a = {"Authorization": "Bearer tenant-a"}
    turn1 = [
        {"role": "system", "content": f"You are {secrets.token_hex(4)}. " + "Be brief. " * 60},
        {"role": "user", "content": "Say hello."},
    ]
    gen = {"max_tokens": 4, "temperature": 0}
    url = rproxy.url + "/v1/chat/completions"
    status, reply, cache = await _post_json(url, {"messages": turn1, **gen}, a)
    assert status == 200 and cache == "miss"  # tenant A's turn, in a slot, not yet saved

    # Tenant B asks for two completions: pinned to the other slot, the second one would run
    # in A's slot and wipe what A's next turn needs.
    if path == "/v1/chat/completions":
        other: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}], **gen}
    else:
        other = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    b = {"Authorization": "Bearer tenant-b"}
    status, two, _ = await _post_json(rproxy.url + path, {**other, field: 2}, b)
    assert status == 200
    if "choices" in two:
        assert len(two["choices"]) == 2
    else:
        assert isinstance(two, list) and len(two) == 2

    turn2 = [*turn1, reply["choices"][0]["message"], {"role": "user", "content": "Again."}]
    status, done, cache = await _post_json(url, {"messages": turn2, **gen}, a)
    assert status == 200
    # A's state was saved before B's request ran, not lost: turn 2 reuses turn 1's prompt.
    assert done["timings"]["cache_n"] >= reply["timings"]["prompt_n"] - 8, (cache, done["timings"])


# --- requests the server refuses without a slot never queue behind every slot


async def _timed_post(url: str, body: dict[str, Any]) -> tuple[int, float]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as r:
        await r.read()
        return r.status, time.monotonic()


@pytest.mark.real
async def test_embeddings_the_server_refuses_do_not_wait_for_every_slot(
    real_server: RealServer, rproxy: RunningProxy
) -> None:
    embed = {"input": "hello", "model": "any"}
    async with (
        aiohttp.ClientSession() as s,
        s.post(real_server.url + "/v1/embeddings", json=embed) as r,
    ):
        assert r.status == 501  # started without --embeddings: refused at once, no slot used
    long = {
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 150,
        "ignore_eos": True,
        "temperature": 0,
    }
    url = rproxy.url + "/v1/chat/completions"
    busy = [asyncio.create_task(_timed_post(url, long)) for _ in range(2)]  # every slot
    while sum(s.busy for s in rproxy.cache.pool.slots) < 2:
        await asyncio.sleep(0.02)
    status, answered = await _timed_post(rproxy.url + "/v1/embeddings", embed)
    done = await asyncio.gather(*busy)
    assert status == 501
    assert all(code == 200 for code, _ in done)
    assert answered < min(t for _, t in done)  # not queued behind the long generations


@pytest.mark.real
async def test_embeddings_the_server_serves_still_hold_every_slot(cache_dir: Path) -> None:
    """An embedding takes a slot the server picks and replaces its cached prompt."""
    extra = ("--cache-ram", "0", "--swa-full", "--embeddings", "--pooling", "mean")
    server = await asyncio.to_thread(start_real_server, cache_dir, extra=extra)
    proxy = await start_proxy(server.url, cache_dir)
    try:
        backend = proxy.app[SERVICE].cache.backend
        assert not await backend.refuses("/v1/embeddings")
        assert await backend.refuses("/v1/rerank") and await backend.refuses(
            "/audio/transcriptions"
        )
        turn1 = [
            {"role": "system", "content": f"You are {secrets.token_hex(4)}. " + "Be brief. " * 60},
            {"role": "user", "content": "Say hello."},
        ]
        gen = {"max_tokens": 4, "temperature": 0}
        url = proxy.url + "/v1/chat/completions"
        status, reply, _ = await _post_json(url, {"messages": turn1, **gen}, {})
        assert status == 200
        for word in ("apple ", "river "):  # unlike each other: one slot each, LRU, one is A's
            embed = {"input": word * 300, "model": "any"}
            status, _, cache = await _post_json(proxy.url + "/v1/embeddings", embed, {})
            assert status == 200 and cache == "bypass"
        turn2 = [*turn1, reply["choices"][0]["message"], {"role": "user", "content": "Again."}]
        status, done, _ = await _post_json(url, {"messages": turn2, **gen}, {})
        assert done["timings"]["cache_n"] >= reply["timings"]["prompt_n"] - 8, done["timings"]
    finally:
        await proxy.stop()
        await asyncio.to_thread(server.stop)


# --- a request that must hold every slot is not starved by a steady load


async def test_hold_all_is_not_starved_under_load(make: Maker) -> None:
    fake, proxy = await make(server={"token_delay": 0.02})
    url = proxy.url + "/v1/chat/completions"
    one = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}
    stop = asyncio.Event()
    latencies: list[float] = []

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                body = {**one, "messages": [{"role": "user", "content": f"client {n}"}]}
                sent = time.monotonic()
                async with s.post(url, json=body) as r:
                    await r.read()
                latencies.append(time.monotonic() - sent)

    load = [asyncio.create_task(client(n)) for n in range(16)]
    try:
        await asyncio.sleep(0.5)  # both slots always busy, requests always waiting
        started = time.monotonic()
        async with aiohttp.ClientSession() as s:
            async with s.post(url, json={**one, "n": 2}) as r:  # holds every slot
                assert r.status == 200 and r.headers["X-KVProxy-Cache"] == "bypass"
        waited = time.monotonic() - started
    finally:
        stop.set()
        await asyncio.gather(*load)
    # It waits its turn among the requests that came before it, and for those running, like
    # any request (~1.6 s here: 16 clients on 2 slots, ~0.2 s each); not for one slot, then
    # the whole queue again for the next while holding the first (~2.5 times as long).
    typical = statistics.median(latencies)
    assert waited < 1.6 * typical + 0.3, (waited, typical)
