"""Compressed request bodies: llama-server (cpp-httplib without zlib in this build) answers 415
to them, and aiohttp would inflate them under the original headers and past --max-body. So
any Content-Encoding but identity is a 415 on every route, before the body is read."""

from __future__ import annotations

import gzip

import aiohttp
import orjson
import pytest

from .conftest import Maker, RealServer, start_proxy

# 8 MiB of JSON that gzip makes about 8 KiB of.
BIG = orjson.dumps({"content": "a" * (8 << 20)})
SMALL = b'{"content": "hello"}'


@pytest.mark.parametrize(
    "path", ["/tokenize", "/apply-template", "/v1/chat/completions", "/completion", "/embeddings"]
)
@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "zstd", "GZIP", "x-custom"])
async def test_compressed_bodies_are_refused_on_every_route(
    make: Maker, path: str, encoding: str
) -> None:
    fake, proxy = await make(max_body="1MiB")
    body = gzip.compress(BIG)
    assert len(body) < 64 << 10
    before = len(fake.requests)
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
        async with s.post(proxy.url + path, data=body, headers=headers) as resp:
            assert resp.status == 415, await resp.text()
            error = (await resp.json())["error"]
    assert error["code"] == "unsupported_content_encoding"
    assert error["type"] == "invalid_request_error"
    assert not [r for r in fake.requests[before:] if r[1].startswith(path)]


async def test_identity_bodies_pass(make: Maker) -> None:
    fake, proxy = await make()
    async with aiohttp.ClientSession() as s:
        for encoding in ("identity", "Identity", ""):
            async with s.post(
                proxy.url + "/tokenize", data=SMALL, headers={"Content-Encoding": encoding}
            ) as resp:
                assert resp.status == 200, await resp.text()
    assert [r[2] for r in fake.requests if r[1] == "/tokenize"][-1] is not None


@pytest.mark.real
async def test_the_server_itself_refuses_gzip_and_so_does_kvproxy(real_server: RealServer) -> None:
    body = gzip.compress(orjson.dumps({"content": "hello"}))
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    proxy = await start_proxy(real_server.url, real_server.cache_dir)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(real_server.url + "/tokenize", data=body, headers=headers) as r:
                assert r.status == 415  # cpp-httplib without CPPHTTPLIB_ZLIB_SUPPORT
            async with s.post(proxy.url + "/tokenize", data=body, headers=headers) as r:
                assert r.status == 415
            async with s.post(proxy.url + "/tokenize", json={"content": "hello"}) as r:
                assert r.status == 200 and (await r.json())["tokens"]
    finally:
        await proxy.stop()
