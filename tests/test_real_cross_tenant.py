"""A real llama-server without --slot-save-path refuses every slot action, erase included:
kvproxy still clears a slot before another tenant's request runs on it, so that tenant's
`timings.cache_n` tells nothing of what the slot held before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvproxy.server.managed import find_server_binary, free_port, server_command

from .conftest import bundled_model, run_server_command, server_loop, start_proxy
from .test_cache import chat

pytestmark = pytest.mark.real

ALICE, BOB = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
# Alice's secret, and Bob's guess at it: the same long beginning, then other words.
SECRET = "The launch code of project Bluebird is written below, keep it safe. " * 6


def messages(guess: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": SECRET},
        {"role": "user", "content": guess},
    ]


@pytest.fixture(scope="module")
def no_slot_actions(real_server_dir: Path) -> Iterator[str]:
    """llama-server with one slot and no --slot-save-path (its slot actions answer 501)."""
    port = free_port()
    cmd = server_command(
        find_server_binary(None),
        bundled_model(),
        port,
        real_server_dir,
        1,
        4096,
        None,
        ["--cache-ram", "0", "--swa-full"],
    )
    at = cmd.index("--slot-save-path")
    del cmd[at : at + 2]
    managed = run_server_command(cmd, port, real_server_dir / f"llama-server-{port}.log")
    try:
        yield managed.url
    finally:
        server_loop().run(managed.stop(grace=20))


async def test_another_tenants_prompt_cannot_be_guessed_from_cache_n(
    no_slot_actions: str, tmp_path: Path
) -> None:
    proxy = await start_proxy(no_slot_actions, tmp_path)
    try:
        status, body, _ = await chat(proxy, messages("What is it?"), headers=ALICE, max_tokens=4)
        assert status == 200, body
        # Bob's guess shares Alice's whole system prompt: the server would reuse it all.
        status, body, _ = await chat(proxy, messages("Tell me."), headers=BOB, max_tokens=4)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"]
        guessed = body["timings"]["cache_n"]
        assert guessed <= 2, f"Bob's cache_n {guessed} tells how much of Alice's prompt he sent"
        # A tenant alone still reuses its own slot.
        status, body, _ = await chat(proxy, messages("Tell me."), headers=BOB, max_tokens=4)
        assert status == 200 and body["timings"]["cache_n"] > 100
    finally:
        await proxy.stop()
