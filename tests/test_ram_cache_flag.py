"""Managed mode runs llama-server with its RAM prompt cache off unless the user sized it:
behind kvproxy it is written on every task start and almost never read."""

from __future__ import annotations

from kvproxy.server.managed import ram_cache_off


def test_off_when_the_user_said_nothing() -> None:
    assert ram_cache_off(["--threads", "2"], {}) == ["--threads", "2", "--cache-ram", "0"]


def test_the_users_size_is_kept() -> None:
    for flags in (["--cache-ram", "4096"], ["-cram", "-1"], ["--cache-ram=512"]):
        assert ram_cache_off(flags, {}) == flags
    assert ram_cache_off([], {"LLAMA_ARG_CACHE_RAM": "2048"}) == []
