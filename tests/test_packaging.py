"""What the runtime distribution ships: the wheel and sdist built from the repo (offline, with the
venv's own setuptools and wheel: the dev extra installs them) hold every runtime package and
none of the benchmarks, the fake llama-server or the tests; no runtime module grows past 400
lines."""

from __future__ import annotations

import email.parser
import importlib.metadata
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

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
def sdist(source: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    out = tmp_path_factory.mktemp("sdist")
    backend = f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"
    build([sys.executable, "-c", backend], source)
    [built] = out.glob("kvproxy-*.tar.gz")
    with tarfile.open(built) as tf:
        top = built.name.removesuffix(".tar.gz") + "/"
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
