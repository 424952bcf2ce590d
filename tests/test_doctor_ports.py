"""`kvproxy doctor` with no --upstream looks for llama-server at its default port, 8080, and
at 9931, the default llama.cpp #26508 announced for a future release. The tests point those
two defaults at ports they own (8080 may be anyone's on a shared machine)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from kvproxy.config import Settings
from kvproxy.server import findlocal
from kvproxy.server.doctor import diagnose
from kvproxy.server.managed import free_port

from .fakeserver import FakeLlamaServer


def test_the_default_ports_are_8080_then_9931() -> None:
    assert findlocal.default_urls() == ["http://127.0.0.1:8080", "http://127.0.0.1:9931"]


@pytest.mark.parametrize("where", ["first", "second"])
async def test_doctor_finds_a_server_at_either_default_port(
    fake: FakeLlamaServer, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    fake_port = int(fake.url.rsplit(":", 1)[1])
    nobody = free_port()
    ports = (fake_port, nobody) if where == "first" else (nobody, fake_port)
    monkeypatch.setattr(findlocal, "DEFAULT_PORTS", ports)
    assert fake.slot_save_path is not None
    checks = await diagnose(Settings(cache_dir=fake.slot_save_path), quick=True)
    server = next(c for c in checks if c.name == "server")
    assert server.status == "ok"
    assert f"127.0.0.1:{fake_port}" in server.detail
    assert all(c.status != "fail" for c in checks), [c for c in checks if c.status == "fail"]


async def test_doctor_with_no_server_at_either_port_says_where_it_looked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(findlocal, "DEFAULT_PORTS", (free_port(), free_port()))
    (check,) = await diagnose(Settings(cache_dir=tmp_path), quick=True)
    assert check.status == "fail"
    assert "127.0.0.1:8080 or 127.0.0.1:9931" in check.detail
    assert "--upstream" in check.fix


async def test_something_else_at_the_port_is_not_taken_for_llama_server(
    fake: FakeLlamaServer,
) -> None:
    """Only an answer /health gives as llama-server's does: 200, or 503 while it loads."""
    other = web.Application()  # a web server of another kind: no /health route
    runner = web.AppRunner(other)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        assert await findlocal.local_server([f"http://127.0.0.1:{port}"]) == []
    finally:
        await runner.cleanup()
    fake.loading = True
    assert await findlocal.local_server([fake.url]) == [fake.url]
