"""Every file and module the docs and docstrings name exists, and the module map in
docs/how-it-works.md is the one the code's docstrings make (tools/modulemap.py).

A name that outlives its file sends a reader to nothing: each file name ending in .py and
each dotted kvproxy module that a docstring (of kvproxy/, bench/, tests/, tools/) or a user's document
(README.md, docs/, deploy/, examples/) names must be a file of this repository (a path
ending so, or a file of that name) or an importable module or name. CHANGELOG.md is history
and names what was."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import modulemap  # noqa: E402

PY_FILE = re.compile(r"(?<![\w/.-])([\w./-]*\w\.py)\b")
MODULE = re.compile(r"\bkvproxy(?:\.[A-Za-z_]\w*)+")
DOCUMENTS = ("README.md", "docs/*.md", "deploy/README.md", "examples/README.md")
SOURCES = ("kvproxy", "bench", "tests", "tools")
# Files of other projects the docs cite: llama.cpp's tools, and its server test suite
# (tools/server/tests/unit/test_*.py), which `make differential` runs (docs/differential.md).
ELSEWHERE = frozenset({"utils.py", "conftest.py", "convert_hf_to_gguf.py"})
UPSTREAM_SUITE = re.compile(r"^(unit/)?test_\w+\.py$")
UPSTREAM_CITERS = ("docs/differential.md", "tools/differential")
# Logger names (`logging.getLogger("kvproxy.x")`) look like modules and are named in docs.
LOGGER = re.compile(r"getLogger\(\"(kvproxy[\w.]*)\"\)")


def repo_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = out.stdout.split()
    # Files added but not committed yet count too (a change under review).
    return files + [str(p.relative_to(ROOT)) for p in ROOT.glob("*/**/*.py")]


def texts() -> list[tuple[str, str]]:
    """(where, text): every docstring of the sources, and every user's document."""
    found: list[tuple[str, str]] = []
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(
                    node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
                ):
                    doc = ast.get_docstring(node)
                    if doc:
                        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}"
                        found.append((where, doc))
    for pattern in DOCUMENTS:
        for path in sorted(ROOT.glob(pattern)):
            found.append((str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")))
    return found


def file_exists(name: str, files: list[str]) -> bool:
    name = name.lstrip("./")
    if "/" not in name:
        return name in ELSEWHERE or any(f.rsplit("/", 1)[-1] == name for f in files)
    return any(f == name or f.endswith("/" + name) for f in files)


def module_exists(dotted: str, files: list[str]) -> bool:
    if any(f.rsplit("/", 1)[-1] == dotted for f in files):
        return True  # a file named so (deploy/kvproxy.service, kvproxy.env)
    parts = dotted.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def loggers() -> set[str]:
    return {
        name
        for path in (ROOT / "kvproxy").rglob("*.py")
        for name in LOGGER.findall(path.read_text(encoding="utf-8"))
    }


def test_every_file_and_module_named_exists() -> None:
    files, logger_names = repo_files(), loggers()
    missing = []
    for where, text in texts():
        upstream = where.startswith(UPSTREAM_CITERS)
        for name in set(PY_FILE.findall(text)):
            if upstream and UPSTREAM_SUITE.match(name):
                continue
            if not file_exists(name, files):
                missing.append(f"{where}: {name}")
        for dotted in set(MODULE.findall(text)):
            dotted = dotted.rstrip(".")
            if dotted not in logger_names and not module_exists(dotted, files):
                missing.append(f"{where}: {dotted}")
    assert sorted(missing) == []


def test_the_module_map_is_the_one_the_docstrings_make() -> None:
    doc = modulemap.DOC.read_text(encoding="utf-8")
    assert modulemap.written(doc) == doc, "run `python tools/modulemap.py --write`"
    mapped = re.findall(r"^\| `([\w/]+\.py)` \|", doc, re.M)
    package = ROOT / "kvproxy"
    every = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name != "__main__.py" and p != package / "__init__.py"
    }
    assert set(mapped) == every
