"""The managed server's log on the status page: `GET /kvproxy/server-log?lines=N` returns the
tail of what llama-server printed (kept by ManagedServer), behind the admin guard of the other
/kvproxy/ routes; the page shows it in managed mode and hides it in sidecar mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from kvproxy.edge.app import SERVICE
from kvproxy.server.fleet import Fleet
from kvproxy.server.managed import ManagedServer, free_port

from .browser import dump_dom
from .conftest import Maker, RunningProxy, start_proxy
from .standin_server import SLOW_START, standin_binary
from .test_status_page import get, visible_text

# What the stand-in prints before it serves (standin_server.main).
STANDIN_LINES = [
    "system_info: n_threads = 2 | CPU : AMX_INT8 = 1 |",
    "llama threadpool init, n_threads = 2",
    "llama_model_loader: loaded meta data",
]


async def server_log(proxy: RunningProxy, query: str = "", **headers: str) -> tuple[int, Any]:
    status, text, _ = await get(proxy.url + "/kvproxy/server-log" + query, headers)
    return status, orjson.loads(text)


async def start_standin(tmp_path: Path) -> ManagedServer:
    """A stand-in llama-server as managed mode starts it: its lines relayed, none in a file."""
    binary, _ = standin_binary(tmp_path, SLOW_START)
    port = free_port()
    server = ManagedServer([str(binary), "--port", str(port)], port)
    await server.start(timeout=60)
    return server


async def test_managed_mode_keeps_the_servers_last_lines(tmp_path: Path) -> None:
    server = await start_standin(tmp_path)
    try:
        assert await server.recent_log(100) == STANDIN_LINES
        assert await server.recent_log(1) == STANDIN_LINES[-1:]
        assert await server.recent_log(0) == []
        fleet = Fleet([server], tmp_path)
        assert await fleet.recent_log(2) == STANDIN_LINES[-2:]
    finally:
        await server.stop()


async def test_the_route_returns_the_tail(make: Maker, tmp_path: Path) -> None:
    _, proxy = await make()
    assert await server_log(proxy) == (200, {"managed": False, "lines": []})  # sidecar mode
    server = await start_standin(tmp_path)
    try:
        proxy.app[SERVICE].server_log = server.recent_log
        assert await server_log(proxy) == (200, {"managed": True, "lines": STANDIN_LINES})
        status, body = await server_log(proxy, "?lines=2")
        assert status == 200 and body["lines"] == STANDIN_LINES[-2:]
        for bad in ("0", "abc", "1001", "-1", "%C2%B2", "9" * 5000):
            status, body = await server_log(proxy, f"?lines={bad}")
            assert status == 400 and body["error"]["code"] == "invalid_lines", bad
    finally:
        await server.stop()


async def test_client_keys_alone_do_not_read_it(make: Maker, tmp_path: Path) -> None:
    """With --client-api-keys every tenant reaches the port: the log needs the admin token."""
    fake, _ = await make()
    guarded = await start_proxy(
        fake.url, tmp_path / "c2", client_api_keys="tenant-key", admin_token="s3cret"
    )
    guarded.app[SERVICE].server_log = lambda n: _lines(["secret-ish server line"], n)
    try:
        assert (await server_log(guarded))[0] == 401
        assert (await server_log(guarded, Authorization="Bearer tenant-key"))[0] == 401
        status, body = await server_log(guarded, Authorization="Bearer s3cret")
        assert status == 200 and body["lines"] == ["secret-ish server line"]
    finally:
        await guarded.stop()


async def _lines(lines: list[str], n: int) -> list[str]:
    return lines[-n:]


async def test_the_page_shows_the_log_in_managed_mode_only(make: Maker, tmp_path: Path) -> None:
    _, proxy = await make()
    dom = await dump_dom(proxy.url + "/kvproxy/")
    assert 'id="server-log-section" hidden' in dom  # sidecar: no log to show
    proxy.app[SERVICE].server_log = lambda n: _lines(STANDIN_LINES, n)
    dom = await dump_dom(proxy.url + "/kvproxy/")
    assert 'id="server-log-section" hidden' not in dom
    text = visible_text(dom)
    assert "llama-server log" in text and "llama threadpool init, n_threads = 2" in text
