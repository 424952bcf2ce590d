"""Security defaults: loopback Host only, admin routes behind a token, private cache files,
no symlink followed, tenants isolated."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvproxy.store import DB_NAME
from kvproxy.store.salt import SALT_NAME

from .conftest import NOT_ENTRIES, Maker, start_proxy
from .test_cache import chat, conv, settle


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers or {}) as r:
        return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8081", "192.168.1.5", "localhost.evil.example"]
)
async def test_foreign_host_is_refused_on_loopback(make: Maker, host: str) -> None:
    fake, proxy = await make()
    status, body = await get(proxy.url + "/v1/models", {"Host": host})
    assert status == 403 and body["error"]["code"] == "host_not_allowed"
    assert not [r for r in fake.requests if r[1] == "/v1/models"]


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8081", "127.0.0.1:1", "[::1]:80", "my.box"]
)
async def test_loopback_and_allowed_hosts_pass(make: Maker, host: str) -> None:
    fake, proxy = await make(allowed_hosts="my.box")
    status, _ = await get(proxy.url + "/v1/models", {"Host": host})
    assert status == 200


async def test_stats_are_open_on_loopback_and_need_a_token_elsewhere(
    make: Maker, tmp_path: Path
) -> None:
    fake, proxy = await make()
    await chat(proxy, conv(1))
    await settle(proxy)  # a miss is counted once it is explained, off the request path
    status, body = await get(proxy.url + "/kvproxy/stats")
    assert status == 200 and body["requests"]["miss"] == 1 and len(body["slots"]) == 2

    # Told to listen beyond loopback (the test still binds 127.0.0.1): a token is required.
    exposed = await start_proxy(fake.url, tmp_path / "c2", host="0.0.0.0", admin_token="s3cret")
    try:
        assert (await get(exposed.url + "/kvproxy/stats"))[0] == 401
        assert (await get(exposed.url + "/kvproxy/stats", {"Authorization": "Bearer nope"}))[
            0
        ] == 401
        status, _ = await get(exposed.url + "/kvproxy/stats", {"Authorization": "Bearer s3cret"})
        assert status == 200
        # ...and a Host check would be meaningless there: names are the operator's business.
        assert (await get(exposed.url + "/v1/models", {"Host": "box.lan"}))[0] == 200
    finally:
        await exposed.stop()


async def test_cache_dir_and_files_are_private(make: Maker) -> None:
    fake, proxy = await make()
    for c in (1, 2, 3):
        await chat(proxy, conv(c))
    await settle(proxy)
    root = proxy.cache.store.root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    files = [p for p in root.iterdir() if not p.is_dir()]
    dirs = [p for p in root.iterdir() if p.is_dir()]  # the owners' lock files (owners.py)
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in dirs)
    inside = [f for d in dirs for f in d.iterdir()]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in inside)
    assert (root / DB_NAME).exists()  # the index, private like the rest
    assert (root / SALT_NAME).exists()  # the tenant salt, private too
    for p in files:  # names come from hashes only (but the index's and the salt)
        if p.name.startswith(NOT_ENTRIES):
            continue
        stem = p.name.split(".")[0]
        assert len(stem) == 32 and all(ch in "0123456789abcdef" for ch in stem)


async def test_symlinks_in_the_cache_dir_are_never_followed(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    outside = tmp_path / "precious"
    outside.write_bytes(b"do not touch")
    key = "ab" * 16
    (cache / f"{key}.kv").symlink_to(outside)
    (cache / f"{key}.idx").symlink_to(outside)
    proxy = await start_proxy("http://127.0.0.1:9", cache)
    try:
        assert proxy.cache.store.entries == {}
        assert not (cache / f"{key}.kv").is_symlink() and not (cache / f"{key}.kv").exists()
        assert outside.read_bytes() == b"do not touch"
    finally:
        await proxy.stop()


async def test_same_conversation_two_tenant_headers(make: Maker) -> None:
    fake, proxy = await make(tenant_header="X-Team", write_through=True)
    red, blue = {"X-Team": "red"}, {"X-Team": "blue"}
    _, r1, _ = await chat(proxy, conv(1), headers=red)
    await settle(proxy)
    await chat(proxy, conv(2), headers=red)
    await chat(proxy, conv(3), headers=red)
    await settle(proxy)
    nxt = [
        *conv(1),
        {"role": "assistant", "content": r1["choices"][0]["message"]["content"]},
        {"role": "user", "content": "next"},
    ]
    _, _, h = await chat(proxy, nxt, headers=blue)
    assert h["X-KVProxy-Cache"] == "miss"  # red's entry exists, blue never gets it
    restores = [a for a in fake.actions if a[0] == "restore"]
    assert restores == []
    _, _, h = await chat(proxy, nxt, headers=red)
    assert h["X-KVProxy-Cache"] in ("restored", "resident")
    await settle(proxy)
    assert len({e.namespace for e in proxy.cache.store.entries.values()}) == 2


def test_bad_cache_dir_permissions_are_fixed(tmp_path: Path) -> None:
    from kvproxy.store import Store

    root = tmp_path / "c"
    root.mkdir(mode=0o755)
    Store(root, 0, 0).open()
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


async def test_client_api_keys_are_required_when_set(make: Maker) -> None:
    fake, proxy = await make(client_api_keys="k1, k2")
    status, body = await get(proxy.url + "/v1/models")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert (await get(proxy.url + "/v1/models", {"Authorization": "Bearer k3"}))[0] == 401
    for key in ("k1", "k2"):
        assert (await get(proxy.url + "/v1/models", {"Authorization": f"Bearer {key}"}))[0] == 200
    assert (await get(proxy.url + "/health"))[0] == 200  # health checks need no key
    # Only the two requests with a right key reached the server.
    assert len([r for r in fake.requests if r[1] == "/v1/models"]) == 2


def test_exposing_the_server_key_without_client_keys_is_refused() -> None:
    from kvproxy.cli import main

    args = [
        "serve",
        "--host",
        "0.0.0.0",
        "--upstream",
        "http://127.0.0.1:9",
        "--upstream-api-key",
        "k",
    ]
    with pytest.raises(SystemExit, match="--client-api-keys"):
        main(args)


async def test_client_api_keys_are_read_as_the_server_reads_them(make: Maker) -> None:
    """llama-server takes `Authorization` (with or without `Bearer `), else `X-Api-Key`
    (Anthropic SDK clients send that one)."""
    fake, proxy = await make(client_api_keys="k1")
    for headers in ({"X-Api-Key": "k1"}, {"Authorization": "k1"}, {"Authorization": "Bearer k1"}):
        assert (await get(proxy.url + "/v1/models", headers))[0] == 200, headers
    for headers in ({"X-Api-Key": "k2"}, {"Authorization": "Bearer k2", "X-Api-Key": "k1"}):
        assert (await get(proxy.url + "/v1/models", headers))[0] == 401, headers
    _, _, h = await chat(proxy, conv(1), headers={"X-Api-Key": "k1"})
    assert h["X-KVProxy-Cache"] == "miss"


def test_an_x_api_key_names_the_same_tenant_as_its_bearer_token() -> None:
    from kvproxy.keys import tenant_of

    salt = bytes(range(32))
    as_bearer = tenant_of({"Authorization": "Bearer k1"}, None, salt)
    assert tenant_of({"X-Api-Key": "k1"}, None, salt) == as_bearer
    assert as_bearer not in (None, tenant_of({"X-Api-Key": "k2"}, None, salt))


async def test_cors_preflight_and_the_ui_root_need_no_key(make: Maker) -> None:
    """The server answers every OPTIONS before its key check (browsers send no credentials
    on a preflight), and lets `/` through: so does kvproxy; anything else still needs one."""
    fake, proxy = await make(
        client_api_keys="k1", upstream_api_key="upstream", server={"api_key": "upstream"}
    )
    preflight = {
        "Origin": "web.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "Authorization",
    }
    async with aiohttp.ClientSession() as s:
        async with s.options(proxy.url + "/completions", headers=preflight) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == "web.example"
            assert r.headers["Access-Control-Allow-Credentials"] == "true"
            assert r.headers["Access-Control-Allow-Headers"] == "*"
        async with s.get(proxy.url + "/") as r:
            assert r.status == 404  # let through to the server (this one has no UI)
        for path in ("/index.html", "/favicon.ico", "/props"):
            async with s.get(proxy.url + path) as r:
                assert r.status == 401, path


async def test_admin_routes_need_the_admin_token_whenever_client_keys_are_set(
    make: Maker,
) -> None:
    """On loopback too: a tenant's key, a wrong key or none reads no other tenant's slots,
    misses or counters."""
    _, proxy = await make(client_api_keys="alice,bob", admin_token="root")
    async with aiohttp.ClientSession() as s:
        for path in ("/kvproxy/status.json", "/kvproxy/stats", "/kvproxy/", "/metrics"):
            for headers in ({}, {"Authorization": "Bearer alice"}, {"Authorization": "Bearer x"}):
                async with s.get(proxy.url + path, headers=headers) as r:
                    assert r.status == 401, (path, headers)
                    assert (await r.json())["error"]["code"] == "admin_token_required"
            async with s.get(proxy.url + path, headers={"Authorization": "Bearer root"}) as r:
                assert r.status == 200, path
    _, keyed_only = await make(client_api_keys="alice")
    async with (
        aiohttp.ClientSession() as s,
        s.get(keyed_only.url + "/kvproxy/stats", headers={"Authorization": "Bearer alice"}) as r,
    ):
        assert r.status == 401 and "--admin-token" in (await r.json())["error"]["message"]


async def test_admin_routes_behind_an_allowed_host_need_the_admin_token(make: Maker) -> None:
    """A name of --allowed-hosts is a reverse proxy or a LAN name: anyone may come through
    it, so kvproxy's own routes (the status page quotes prompts) need the token there; a
    loopback name still does not."""
    _, proxy = await make(allowed_hosts="llm.example.org", admin_token="root")
    async with aiohttp.ClientSession() as s:
        for path in ("/kvproxy/status.json", "/kvproxy/stats", "/kvproxy/", "/metrics"):
            outside = {"Host": "llm.example.org"}
            async with s.get(proxy.url + path, headers=outside) as r:
                assert r.status == 401, path
            async with s.get(proxy.url + path, headers={**outside, **ROOT}) as r:
                assert r.status == 200, path
            async with s.get(proxy.url + path, headers={"Host": "localhost"}) as r:
                assert r.status == 200, path
        async with s.get(proxy.url + "/v1/models", headers={"Host": "llm.example.org"}) as r:
            assert r.status == 200  # the API itself, as before


ROOT = {"Authorization": "Bearer root"}
