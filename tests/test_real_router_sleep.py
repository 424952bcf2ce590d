"""A router whose models sleep (`--sleep-idle-seconds`, which every model's server gets):
kvproxy saves a conversation before its model falls asleep and restores it after the
wake-up; and after a restart of kvproxy and the router both, from disk."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from .test_cache import chat, then
from .test_real_router import FILLER, get_json, models_dir, serve_models, stop

pytestmark = pytest.mark.real


def turn(url: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    proxy = SimpleNamespace(url=url)
    status, body, headers = asyncio.run(chat(proxy, messages, model="gemma", max_tokens=8))
    assert status == 200, body
    return body, headers


def status_of(server_url: str, model: str) -> str:
    listed = get_json(server_url + "/models")["data"]
    return str({m["id"]: m["status"]["value"] for m in listed}[model])


def reused(first: dict[str, Any], later: dict[str, Any]) -> tuple[int, int]:
    """(tokens the later turn took from cache, tokens of the first turn it could reuse)."""
    t = first["timings"]
    return later["timings"]["cache_n"], t["cache_n"] + t["prompt_n"] + t["predicted_n"]


def test_conversations_survive_sleep_and_a_restart_of_both(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    models = models_dir(tmp_path, tiny_models["dense"])
    # kvproxy saves an idle slot within half the sleep time; a save's steps take seconds on a
    # loaded 2-core machine, so the margin is 5 s (with 2 s, a run beside the fast suite lost
    # the race and the turn came back a miss).
    router = serve_models(tmp_path, models, "--sleep-idle-seconds", "10")
    story = " ".join(f"Line {i}: {FILLER}" for i in range(90))
    first = [
        {"role": "system", "content": "You answer in one word. " + story},
        {"role": "user", "content": "Which animal jumps?"},
    ]
    try:
        r1, _ = turn(f"http://127.0.0.1:{router.port}", first)
        assert r1["timings"]["cache_n"] + r1["timings"]["prompt_n"] >= 1500
        deadline = time.monotonic() + 90
        while status_of(router.server_url, "gemma") != "sleeping":
            assert time.monotonic() < deadline, "gemma never fell asleep"
            time.sleep(0.5)
        second = then(first, r1)
        r2, h2 = turn(f"http://127.0.0.1:{router.port}", second)
        cache_n, reusable = reused(r1, r2)
        print(f"\nafter sleep: {cache_n} of {reusable} reusable tokens from cache")
        assert h2["X-KVProxy-Cache"] == "restored", h2
        assert cache_n >= 0.99 * reusable
    finally:
        stop(router)

    router = serve_models(tmp_path, models, "--sleep-idle-seconds", "10")
    try:
        r3, h3 = turn(f"http://127.0.0.1:{router.port}", then(second, r2, "And then?"))
        cache_n, reusable = reused(r2, r3)
        print(f"after a restart of both: {cache_n} of {reusable} reusable tokens from cache")
        assert h3["X-KVProxy-Cache"] == "restored", h3
        assert cache_n >= 0.99 * reusable
    finally:
        stop(router)
