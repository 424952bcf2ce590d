"""Settings: flags beat env vars, every option has both, bad values are one clear line."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvproxy.cli import build_parser, main
from kvproxy.cli.flags import load_settings
from kvproxy.config import Settings


def test_defaults_are_safe() -> None:
    s = Settings()
    assert s.host == "127.0.0.1"
    assert s.ttl == 3 * 86400 and s.min_tokens == 256
    assert int(s.max_disk) == 50 * 1024**3


def test_env_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPROXY_PORT", "9000")
    monkeypatch.setenv("KVPROXY_TTL", "12h")
    monkeypatch.setenv("KVPROXY_MAX_DISK", "2GiB")
    assert load_settings({}).port == 9000
    s = load_settings({"port": "9100", "ttl": "90m", "write_through": True})
    assert s.port == 9100 and s.ttl == 5400 and s.write_through
    assert int(s.max_disk) == 2 * 1024**3


def test_version_flag_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"kvproxy {importlib.metadata.version('kvproxy')}\n"


def test_every_setting_is_a_flag() -> None:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    serve = sub.choices["serve"]
    flags = {opt for action in serve._actions for opt in action.option_strings}
    for name in Settings.model_fields:
        if name != "server_args":
            assert "--" + name.replace("_", "-") in flags


def test_server_args_after_double_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    captured = {}

    def fake_load(cli: dict[str, Any], config: Path | None = None) -> Settings:
        captured.update(cli)
        raise SystemExit(0)

    monkeypatch.setattr("kvproxy.cli.load_settings", fake_load)
    with pytest.raises(SystemExit):
        main(["serve", "--model", "x.gguf", "--", "--swa-full", "-t", "4"])
    assert captured["server_args"] == ["--swa-full", "-t", "4"]
    assert captured["model"] == "x.gguf"


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--port", "seventy"], {}, "--port / KVPROXY_PORT"),
        ([], {"KVPROXY_TTL": "soon"}, "--ttl / KVPROXY_TTL"),
        (["--max-disk", "lots"], {}, "--max-disk"),
        (["--upstream", "not a url"], {}, "--upstream"),
    ],
)
def test_invalid_values_fail_with_one_line(
    args: list[str], env: dict[str, str], needle: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvproxy.cli", "serve", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **env},
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvproxy: invalid setting:") and needle in lines[0]
    assert "Traceback" not in proc.stderr


def test_nothing_to_proxy_is_explained() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvproxy.cli", "serve"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "--upstream" in proc.stderr and "--model" in proc.stderr


def test_host_is_a_comma_list_as_llama_servers_is() -> None:
    s = Settings(host="127.0.0.1, ::1")
    assert s.hosts == ["127.0.0.1", "::1"] and s.loopback
    assert not Settings(host="127.0.0.1,0.0.0.0").loopback  # one address beyond loopback
    with pytest.raises(ValidationError):
        Settings(host=" , ")


async def test_serve_listens_on_each_address_of_host(tmp_path: Path) -> None:
    import aiohttp
    from aiohttp import web

    from kvproxy.edge.app import build_app
    from kvproxy.edge.listen import listen
    from kvproxy.server.managed import free_port

    settings = Settings(host="127.0.0.1,::1", port=free_port(), cache_dir=tmp_path / "c")
    runner = web.AppRunner(build_app(settings, "http://127.0.0.1:9"))
    await runner.setup()
    try:
        await listen(runner, settings)
        async with aiohttp.ClientSession() as s:
            for host in ("127.0.0.1", "[::1]"):
                async with s.get(f"http://{host}:{settings.port}/kvproxy/stats") as r:
                    assert r.status == 200, host
    finally:
        await runner.cleanup()


def test_min_tokens_0_is_accepted_and_negative_is_not() -> None:
    assert Settings(min_tokens=0).min_tokens == 0
    assert load_settings({"min_tokens": "0"}).min_tokens == 0
    with pytest.raises(SystemExit, match="--min-tokens"):
        load_settings({"min_tokens": "-1"})
