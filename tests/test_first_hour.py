"""A new user's first mistakes, caught at start in one line; managed mode's reply cap."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvproxy.cli.flags import load_settings
from kvproxy.config import Settings
from kvproxy.server.managed import server_command


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


def test_managed_mode_caps_replies_unless_told_otherwise(tmp_path: Path) -> None:
    default = Settings(model="default").reply_cap
    cmd = server_command(
        Path("llama-server"), Path("m.gguf"), 1, tmp_path, 2, 256, None, [], default
    )
    assert cmd[cmd.index("--n-predict") + 1] == str(default) and 0 < default <= 4096
    none = server_command(Path("llama-server"), Path("m.gguf"), 1, tmp_path, 2, 256, None, [], -1)
    assert "--n-predict" not in none


def test_serve_help_shows_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvproxy", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "default 8081" in flat and "default 2048" in flat
