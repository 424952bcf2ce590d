"""No tenant reads another's KV state through a slot it is given: a slot that may hold
another tenant's tokens is erased before the request goes, so the server cannot reuse them
(its `timings.cache_n` would tell the new tenant that the other sent the same text)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from kvproxy_fake.model import render_chat
from kvproxy_fake.server import FakeLlamaServer

from kvproxy.config import Settings
from kvproxy.server.launch import managed_command

from .conftest import Maker, bundled_model, start_proxy
from .test_cache import chat, conv, settle

ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}


async def test_a_slot_holding_another_tenants_conversation_is_erased_first(make: Maker) -> None:
    fake, proxy = await make()
    await chat(proxy, conv(1), headers=ALICE)  # slot 0
    await chat(proxy, conv(2), headers=ALICE)  # slot 1
    await settle(proxy)
    # Bob sends Alice's conversation byte for byte; the least recently used slot (0) still
    # holds it on the server.
    status, body, h = await chat(proxy, conv(1), headers=BOB)
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["timings"]["cache_n"] == 0
    # Alice's own conversation is still hers: saved before the slot was given away.
    await settle(proxy)
    status, body, h = await chat(proxy, conv(1), headers=ALICE)
    assert h["X-KVProxy-Cache"] in ("resident", "restored")


async def test_a_bypass_completion_never_reuses_another_tenants_slot(make: Maker) -> None:
    fake, proxy = await make()
    await chat(proxy, conv(1), headers=ALICE)
    await chat(proxy, conv(2), headers=ALICE)
    await settle(proxy)
    # Bob's raw prompt is Alice's conversation as the server renders it.
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            proxy.url + "/completion",
            json={"prompt": render_chat(conv(1)), "n_predict": 2},
            headers=BOB,
        ) as r,
    ):
        body = await r.json()
    assert r.status == 200 and body["timings"]["cache_n"] == 0


async def test_a_new_proxy_trusts_no_slot_the_server_kept(make: Maker) -> None:
    """After a proxy restart the server's slots hold whatever they held: anyone's."""
    fake, proxy = await make()
    await chat(proxy, conv(1), headers=ALICE)
    await chat(proxy, conv(2), headers=ALICE)
    await settle(proxy)
    await proxy.stop()
    again = await start_proxy(fake.url, fake.save_dir)
    try:
        for n in (1, 2):
            status, body, h = await chat(again, conv(n), headers=BOB)
            assert status == 200 and body["timings"]["cache_n"] == 0
    finally:
        await again.stop()


async def test_requests_on_every_slot_never_reuse_another_tenants(make: Maker) -> None:
    """n=2 holds every slot and the server picks them by what they hold: both are erased."""
    fake, proxy = await make()
    await chat(proxy, conv(1), headers=ALICE)
    await chat(proxy, conv(2), headers=ALICE)
    await settle(proxy)
    status, body, h = await chat(proxy, conv(1), headers=BOB, n=2)
    assert status == 200 and h["X-KVProxy-Cache"] == "bypass"
    assert body["timings"]["cache_n"] == 0


async def test_a_state_restored_into_a_slot_no_task_ran_on_is_not_taken_for_empty(
    make: Maker,
) -> None:
    """The server shows no token count until a task runs on a slot: a state a killed proxy
    restored there is invisible, so a new proxy erases such a slot before its first use."""
    fake, proxy = await make()
    await chat(proxy, conv(1), headers=ALICE)
    await chat(proxy, conv(2), headers=ALICE)
    await chat(proxy, conv(3), headers=ALICE)  # conversation 1 goes to disk
    await settle(proxy)
    await proxy.stop()
    name = next(p.name for p in fake.save_dir.glob("*.kv"))
    await fake.stop()
    again_fake = FakeLlamaServer(slot_save_path=fake.slot_save_path)  # a fresh server
    await again_fake.start()
    try:
        async with aiohttp.ClientSession() as s:  # what the killed proxy had just done
            url = f"{again_fake.url}/slots/0?action=restore"
            async with s.post(url, json={"filename": name}) as r:
                assert r.status == 200
        again = await start_proxy(again_fake.url, again_fake.save_dir)
        try:
            status, body, h = await chat(again, conv(1), headers=BOB)
            assert status == 200 and body["timings"]["cache_n"] == 0
        finally:
            await again.stop()
    finally:
        await again_fake.stop()


async def test_a_server_without_slot_actions_tells_no_tenant_what_another_sent(
    tmp_path: Path,
) -> None:
    """No --slot-save-path: the server refuses slot actions, erase included (501). kvproxy
    clears the slot by evaluating a prompt of its own there: no tenant's `cache_n` counts
    another's tokens, and nobody gets an error."""
    fake = FakeLlamaServer(slot_save_path=None, n_slots=1)
    await fake.start()
    proxy = await start_proxy(fake.url, tmp_path)
    try:
        carol = {"Authorization": "Bearer carol"}
        for headers in (ALICE, BOB, ALICE, carol):
            status, body, _ = await chat(proxy, conv(1), headers=headers)
            assert status == 200, body
            assert body["choices"][0]["message"]["content"]
            assert body["timings"]["cache_n"] <= 2  # the BOS token kvproxy's prompt starts with
        status, body, _ = await chat(proxy, conv(1), headers=carol)  # a tenant alone
        assert body["timings"]["cache_n"] > 100
        assert not any(a[0] == "erase" and a[-1] for a in fake.actions)
    finally:
        await proxy.stop()
        await fake.stop()


async def test_managed_mode_turns_the_servers_ram_prompt_cache_off_for_tenants(
    tmp_path: Path,
) -> None:
    """The server's RAM prompt cache loads the closest prompt any slot held into any slot:
    with tenants, managed mode starts it with `--cache-ram 0` (a flag of the user's wins)."""

    async def command(**opts: Any) -> list[str]:
        settings = Settings(model=str(bundled_model()), cache_dir=tmp_path, **opts)
        return (await managed_command(settings, Path("/bin/llama-server"), 9000)).command

    def cache_ram(cmd: list[str]) -> list[str]:
        return [cmd[i + 1] for i, a in enumerate(cmd) if a == "--cache-ram"]

    assert cache_ram(await command()) == []
    assert cache_ram(await command(client_api_keys="k1,k2")) == ["0"]
    assert cache_ram(await command(tenant_header="X-Team")) == ["0"]
    given = await command(client_api_keys="k1", server_args=["--cache-ram", "512"])
    assert cache_ram(given) == ["512"]
