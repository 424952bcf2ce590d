"""A new user's first run: what kvproxy says when something is set up wrong names the fix
(the flag, the file), and its command line takes only what it documents."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then

SERVER_KEY = {"Authorization": "Bearer sekrit"}


async def test_a_server_with_an_api_key_kvproxy_lacks_is_named_with_the_flag(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's key reaches the server, so its chats answer; kvproxy's own calls get 401,
    so caching is off: the warning says which flag turns it on."""
    caplog.set_level(logging.WARNING, logger="kvproxy")
    fake = FakeLlamaServer(slot_save_path=tmp_path, api_key="sekrit")
    await fake.start()
    proxy = await start_proxy(fake.url, tmp_path)
    try:
        status, _, headers = await chat(proxy, conv(1), headers=SERVER_KEY)
        assert status == 200 and headers["X-KVProxy-Cache"] == "bypass"
        said = [r.getMessage() for r in caplog.records if "--api-key" in r.getMessage()]
        assert len(said) == 1 and "--upstream-api-key KEY" in said[0], said
    finally:
        await proxy.stop()
    proxy = await start_proxy(fake.url, tmp_path, upstream_api_key="sekrit")
    try:  # the flag it named: cached
        status, reply, headers = await chat(proxy, conv(1), headers=SERVER_KEY)
        assert status == 200 and headers["X-KVProxy-Cache"] == "miss"
        await settle(proxy)
        _, _, headers = await chat(proxy, then(conv(1), reply), headers=SERVER_KEY)
        assert headers["X-KVProxy-Cache"] == "resident"
    finally:
        await proxy.stop()
        await fake.stop()
