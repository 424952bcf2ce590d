"""examples/openclaw.json against OpenClaw itself (pinned in bench/kvproxy_bench/agentclients.py), not from memory.

OpenClaw reads `~/.openclaw/openclaw.json` (`openclaw config file` prints the path) and
rejects keys its schema does not know, so `openclaw config validate` under a HOME of our own
is the check. No llama-server is needed. Installing OpenClaw needs PyPI and npm: when they
are unreachable these tests fail, they do not skip.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvproxy.config import Settings

from .agents import OPENCLAW, client_env, install

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openclaw.json"


@pytest.fixture(scope="module")
def openclaw() -> Path:
    return install(OPENCLAW)


def example() -> dict[str, Any]:
    config: dict[str, Any] = json.loads(EXAMPLE.read_text())
    return config


def openclaw_run(exe: Path, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *args],
        env=client_env(home),
        cwd=home,
        capture_output=True,
        text=True,
        timeout=240,
    )


def validate(exe: Path, home: Path, config: dict[str, Any]) -> dict[str, Any]:
    """`openclaw config validate --json` on `config` placed where OpenClaw reads it."""
    path = home / ".openclaw" / "openclaw.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    done = openclaw_run(exe, home, "config", "validate", "--json")
    result: dict[str, Any] = json.loads(done.stdout)
    result["returncode"] = done.returncode
    assert result["path"] == str(path), result
    return result


def kvproxy_model(config: dict[str, Any]) -> dict[str, Any]:
    model: dict[str, Any] = config["models"]["providers"]["kvproxy"]["models"][0]
    return model


def test_where_openclaw_reads_its_config(openclaw: Path, tmp_path: Path) -> None:
    done = openclaw_run(openclaw, tmp_path, "config", "file")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(tmp_path / ".openclaw" / "openclaw.json")
    elsewhere = tmp_path / "elsewhere.json"
    done = subprocess.run(
        [str(openclaw), "config", "file"],
        env=client_env(tmp_path, OPENCLAW_CONFIG_PATH=str(elsewhere)),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(elsewhere)


def test_example_config_is_valid_and_points_at_kvproxy(openclaw: Path, tmp_path: Path) -> None:
    result = validate(openclaw, tmp_path, example())
    assert result["returncode"] == 0 and result["valid"] is True, result
    assert result.get("warnings") == [], result
    # The same check as a user runs it.
    done = openclaw_run(openclaw, tmp_path, "config", "validate")
    assert done.returncode == 0 and "Config valid" in done.stdout + done.stderr, done

    # The provider as OpenClaw resolves it.
    defaults = Settings.model_fields
    kvproxy_url = f"http://{defaults['host'].default}:{defaults['port'].default}/v1"
    done = openclaw_run(openclaw, tmp_path, "config", "get", "models.providers.kvproxy", "--json")
    assert done.returncode == 0, done.stderr
    provider = json.loads(done.stdout)
    assert provider["baseUrl"] == kvproxy_url
    assert provider["api"] == "openai-completions"
    assert provider["models"][0]["compat"]["toolSchemaProfile"] == "llamacpp"

    # The agent's default model is kvproxy's, and OpenClaw counts it as a local model.
    done = openclaw_run(openclaw, tmp_path, "models", "list", "--json")
    assert done.returncode == 0, done.stderr
    listed = {m["key"]: m for m in json.loads(done.stdout[done.stdout.index("{") :])["models"]}
    assert listed["kvproxy/local"]["local"] is True, listed
    assert "default" in listed["kvproxy/local"]["tags"], listed
    assert listed["kvproxy/local"]["contextWindow"] == kvproxy_model(example())["contextWindow"]


def test_invented_compat_key_is_rejected(openclaw: Path, tmp_path: Path) -> None:
    """`appendOnlyRuntimeContext` is an internal replay-policy name in OpenClaw's code, not a
    config key: the example once set it and OpenClaw refused the whole file."""
    config = example()
    kvproxy_model(config)["compat"]["appendOnlyRuntimeContext"] = True
    result = validate(openclaw, tmp_path, config)
    assert result["returncode"] != 0 and result["valid"] is False, result
    issues = {issue["path"]: issue["message"] for issue in result["issues"]}
    assert "appendOnlyRuntimeContext" in issues["models.providers.kvproxy.models.0.compat"]


@pytest.mark.parametrize(
    ("path", "value", "valid"),
    [
        # The knobs docs/troubleshooting.md names for OpenClaw.
        (("agents", "defaults", "contextInjection"), "always", True),
        (("agents", "defaults", "contextInjection"), "never", True),
        (("agents", "defaults", "contextInjection"), "continuation-skip", True),
        (("agents", "entries", "main", "contextInjection"), "always", True),
        (("agents", "defaults", "userTimezone"), "UTC", True),
        # Takes OpenClaw's per-turn runtime-context message away (no process, no subagents).
        (("tools", "deny"), ["process", "sessions_spawn"], True),
        # Envelope settings of older OpenClaw releases: gone, envelopes are built in.
        (("agents", "defaults", "envelopeTimestamp"), "off", False),
        (("agents", "defaults", "envelopeElapsed"), "off", False),
    ],
)
def test_documented_keys(
    openclaw: Path, tmp_path: Path, path: tuple[str, ...], value: object, valid: bool
) -> None:
    config = copy.deepcopy(example())
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    result = validate(openclaw, tmp_path, config)
    assert result["valid"] is valid and (result["returncode"] == 0) is valid, result
