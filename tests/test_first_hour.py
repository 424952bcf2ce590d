"""A new user's first mistakes, caught at start in one line; managed mode's reply cap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvproxy.cli.flags import load_settings
from kvproxy.config import Settings
from kvproxy.edge.app import build_app
from kvproxy.edge.listen import listen, runner_options
from kvproxy.server.managed import free_port, server_command
from kvproxy.wire import with_reply_cap

from .fakeserver import FakeLlamaServer


def test_an_upstream_given_as_the_openai_base_url_is_the_server_address() -> None:
    s = Settings(upstream="http://127.0.0.1:8080/v1/")
    assert s.upstream_urls == ["http://127.0.0.1:8080"]


@pytest.mark.parametrize(
    ("cli", "says"),
    [
        ({"upstream": "http://127.0.0.1:8080", "model": "default"}, "not both"),
        ({"upstream": "http://127.0.0.1:8080", "slots": 4}, "--slots: managed mode only"),
        (
            {"upstream": "http://127.0.0.1:8080", "ctx_size": 4096},
            "--ctx-size: managed mode only",
        ),
    ],
)
def test_flags_of_the_other_mode_are_refused_in_one_line(cli: dict[str, object], says: str) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(cli)
    message = str(exc.value)
    assert says in message and "\n" not in message, message


def test_managed_mode_leaves_the_servers_reply_length_alone(tmp_path: Path) -> None:
    """No --n-predict: llama-server would also cut requests asking for more, and give
    /infill prompts less of their extra context (format_prompt_infill)."""
    cmd = server_command(Path("llama-server"), Path("m.gguf"), 1, tmp_path, 2, 256, None, [])
    assert "--n-predict" not in cmd and "-n" not in cmd


def test_the_reply_cap_fills_in_only_a_missing_reply_length() -> None:
    assert with_reply_cap({"messages": []}, 2048) == {"messages": [], "n_predict": 2048}
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        assert with_reply_cap({field: 5000}, 2048) == {field: 5000}
    assert with_reply_cap({"n_predict": 0}, 2048) == {"n_predict": 0}, "a ring update"
    assert with_reply_cap({"prompt": "x"}, -1) == {"prompt": "x"}
    assert Settings(model="default").request_reply_cap == 2048
    assert Settings(upstream="http://127.0.0.1:8080").request_reply_cap == -1, "sidecar"


async def test_managed_mode_caps_a_reply_that_sets_no_length(tmp_path: Path) -> None:
    """What the server receives from kvproxy in managed mode (its settings, no --upstream):
    the default cap where the client set none; the client's own length where it did."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    settings = Settings(model="default", cache_dir=cache, port=free_port(), min_tokens=0)
    runner = web.AppRunner(build_app(settings, [fake.url]), **runner_options(settings))
    await runner.setup()
    await listen(runner, settings)
    url = f"http://127.0.0.1:{settings.port}"
    try:
        async with aiohttp.ClientSession() as s:
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            for body in (chat, {**chat, "max_tokens": 5000}, {"prompt": "text"}):
                route = "/completion" if "prompt" in body else "/v1/chat/completions"
                async with s.post(url + route, json=body) as r:
                    assert r.status == 200, await r.text()
        sent = [b for _, p, b in fake.requests if p in ("/completion", "/v1/chat/completions")]
        assert sent[0]["n_predict"] == settings.reply_cap
        assert sent[1]["max_tokens"] == 5000 and "n_predict" not in sent[1]
        assert sent[2]["n_predict"] == settings.reply_cap
    finally:
        await runner.cleanup()
        await fake.stop()


def test_serve_help_shows_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvproxy", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "default 8081" in flat and "default 2048" in flat
