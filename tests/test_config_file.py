"""`--config FILE.toml`: a file of settings below the flags and the KVPROXY_* env vars; a key
that names no setting, a malformed file or a missing one is one clear line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvproxy.cli import main
from kvproxy.cli.flags import load_settings
from kvproxy.config import Settings
from kvproxy.server.managed import free_port

EXAMPLE = Path(__file__).resolve().parent.parent / "deploy" / "kvproxy.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvproxy.toml"
    path.write_text(text)
    return path


def refusal(cli: dict[str, object], config: Path) -> str:
    with pytest.raises(SystemExit) as exit_:
        load_settings(cli, config)
    message = str(exit_.value.code)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_flags_beat_env_vars_beat_the_file_beats_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, 'port = 9001\nttl = "2d"\nmin_tokens = 64\nmax_disk = "1GiB"\n')
    monkeypatch.setenv("KVPROXY_TTL", "12h")
    monkeypatch.setenv("KVPROXY_MIN_TOKENS", "32")
    s = load_settings({"min_tokens": "16"}, config)
    assert s.port == 9001  # the file's
    assert s.ttl == 12 * 3600  # the env var's over the file's
    assert s.min_tokens == 16  # the flag's over both
    assert int(s.max_disk) == 2**30
    assert s.idle_save_after == Settings().idle_save_after  # nobody's: the default


def test_an_unknown_key_is_one_line_naming_it(tmp_path: Path) -> None:
    config = write(tmp_path, "port = 9001\nmax_disc = 5\n")
    message = refusal({}, config)
    assert f"{config}: unknown setting 'max_disc'" in message


def test_a_flag_spelling_is_named_with_the_key_to_write(tmp_path: Path) -> None:
    message = refusal({}, write(tmp_path, 'cache-dir = "/tmp/x"\n'))
    assert "unknown setting 'cache-dir' (write it cache_dir)" in message


def test_there_are_no_per_model_tables(tmp_path: Path) -> None:
    """Per-model llama-server flags belong in llama-server's --models-preset file."""
    message = refusal({}, write(tmp_path, "[models.gemma]\nctx_size = 4096\n"))
    assert "unknown setting 'models'" in message


def test_a_bad_value_in_the_file_names_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, 'port = "many"\n')
    message = refusal({}, config)
    assert message.startswith("kvproxy: invalid setting: --port / KVPROXY_PORT / port in ")
    assert str(config) in message


def test_a_missing_or_malformed_file_is_one_line(tmp_path: Path) -> None:
    assert (
        refusal({}, tmp_path / "nope.toml")
        == f"kvproxy: --config {tmp_path}/nope.toml: no such file"
    )
    message = refusal({}, write(tmp_path, "port = 1\nport = 2\n"))
    assert message.startswith(f"kvproxy: --config {tmp_path}/kvproxy.toml: not valid TOML: ")


def test_serve_reads_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, "slots = 4\nupstream = ['http://127.0.0.1:8080']\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", str(config)])
    assert "--slots: managed mode only" in str(exit_.value.code)


def test_doctor_reads_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    config = write(tmp_path, f"upstream = ['http://127.0.0.1:{port}']\ncache_dir = '{tmp_path}'\n")
    assert main(["doctor", "--config", str(config), "--quick", "--json"]) == 1
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert f"127.0.0.1:{port}" in checks["server"]["detail"]


def test_the_example_file_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Settings.model_fields:
        monkeypatch.delenv(f"KVPROXY_{name.upper()}", raising=False)
    s = load_settings({}, EXAMPLE)
    assert s.model == "default" and s.port == 8081 and s.slots == 2
    assert s.server_args == ["--threads", "2"]
    assert int(s.max_disk) == 50 * 2**30 and s.ttl == 3 * 86400


def test_the_example_names_only_real_settings() -> None:
    """Its commented-out keys too: uncommented, each must load."""
    keys = re.findall(r"^#?([a-z_]+) = ", EXAMPLE.read_text(), re.M)
    assert len(keys) > 15
    assert [k for k in keys if k not in Settings.model_fields] == []
