"""The docs check: every header, route and cache label the docs name is one the code has and
a test exercises, and every test the docs cite exists. A sentence that stops being true, or
a name that drifts, fails here rather than misleading a reader.

What counts as a claim: a backticked `/path` (optionally after its method) outside the
filesystem; an `X-KVProxy-*` header or `Retry-After`; a backticked cache label (`resident`,
`restored`, `miss`, `bypass`); a backticked test file name, alone or with `::` and a test's
name (with `…` for a shared prefix or suffix, `*` for a family)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvproxy.cache.decisions.policy import Decision
from kvproxy.edge.routes import ROUTES, RouteTable, Treatment

from .conftest import Maker

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    ROOT / "deploy" / "README.md",
    ROOT / "examples" / "README.md",
]
# llama.cpp's own server tests, which docs/differential.md names (not kvproxy's).
FOREIGN_TESTS = ROOT / "docs" / "differential.md"
FILESYSTEM = ("/etc/", "/home", "/opt/", "/proc/", "/srv/", "/var/", "/tmp/", "/usr/", "/dev/")
# kvproxy's own endpoints (edge/app.py own_route), each exercised below.
OWN = {
    "/kvproxy": 302,
    "/kvproxy/": 200,
    "/kvproxy/stats": 200,
    "/kvproxy/status.json": 200,
    "/kvproxy/server-log": 200,
    "/metrics": 200,
}
METHODS = ("GET", "POST", "DELETE", "PUT", "HEAD", "OPTIONS")
HEADERS = re.compile(r"X-KVProxy-[A-Za-z-]*[A-Za-z]|Retry-After")
LABELS = {d.value for d in Decision} - {Decision.BUSY.value}  # busy: a 503, no header


def ticked(doc: Path) -> Iterator[str]:
    yield from re.findall(r"`([^`\n]+)`", doc.read_text(encoding="utf-8"))


def functions_of_tests() -> dict[str, set[str]]:
    """Each test file's test functions."""
    found = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found[path.name] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.name.startswith("test")
        }
    return found


def cited_tests(doc: Path) -> Iterator[tuple[str, str]]:
    """(file, name) for each test a doc cites; name "" for a whole file. A piece starting
    with `…` goes on from the last file named."""
    last = ""
    for piece in ticked(doc):
        whole = re.fullmatch(r"(?:tests/)?(test_\w+\.py)(?:::(\S+))?", piece)
        if whole:
            last = whole.group(1)
            yield last, whole.group(2) or ""
        elif piece.startswith("…") and last and re.fullmatch(r"[\w…:*]+", piece):
            yield last, piece


def names_a_test(name: str, tests: set[str]) -> bool:
    if not name:
        return True
    core = name.removeprefix("…").removeprefix("::")
    if name.startswith("…"):  # a part of a name, after a shared prefix
        return any(core.strip("…") in t for t in tests)
    if "…" in core:
        head, tail = core.split("…", 1)
        return any(t.startswith(head) and tail.strip("…") in t for t in tests)
    if core.endswith("*"):
        return any(t.startswith(core[:-1]) for t in tests)
    return core in tests


def test_every_test_the_docs_cite_exists() -> None:
    tests = functions_of_tests()
    missing = []
    for doc in DOCS:
        for file, name in cited_tests(doc):
            if file not in tests:
                if doc != FOREIGN_TESTS:
                    missing.append(f"{doc.name}: {file}")
            elif not names_a_test(name, tests[file]):
                missing.append(f"{doc.name}: {file}::{name}")
    assert missing == []


def test_the_guarantees_are_one_table() -> None:
    lines = (ROOT / "docs" / "guarantees.md").read_text(encoding="utf-8").splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("|")]
    assert rows == list(range(rows[0], rows[-1] + 1)), "a row outside the table"


def documented_routes() -> Iterator[tuple[str, str | None, str]]:
    """(doc, method or None, path) for each route a doc names."""
    for doc in DOCS:
        for piece in ticked(doc):
            found = re.fullmatch(r"(?:([A-Z]+)(?:\|[A-Z]+)* )?(/[^\s`]*)", piece)
            if not found or found.group(1) not in (None, *METHODS):
                continue
            path = found.group(2).split("?", 1)[0].replace("{id}", "0")
            if not path.startswith(FILESYSTEM) and not path.endswith((".gguf", ".yaml", ".env")):
                yield doc.name, found.group(1), path


def test_every_route_the_docs_name_is_in_the_route_table() -> None:
    table = RouteTable()
    patterns = {r.path for r in ROUTES}
    unknown = []
    for doc, method, path in documented_routes():
        if path in OWN or path in patterns:
            continue
        if path == "/v1" or path.endswith("/"):  # the API's base, a prefix of routes
            if any(r.path.startswith(path) for r in ROUTES):
                continue
        methods = (method,) if method else ("GET", "POST")
        if all(table.decide(m, path).treatment is None for m in methods):
            unknown.append(f"{doc}: {method or ''} {path}")
    assert unknown == []


async def test_kvproxys_own_routes_answer(make: Maker) -> None:
    _, proxy = await make()
    async with aiohttp.ClientSession() as s:
        for path, status in OWN.items():
            async with s.get(proxy.url + path, allow_redirects=False) as resp:
                assert resp.status == status, path


def test_every_header_the_docs_name_is_set_by_the_code_and_checked_by_a_test() -> None:
    named = {h for doc in DOCS for h in HEADERS.findall(doc.read_text(encoding="utf-8"))}
    assert "X-KVProxy-Cache" in named and "X-KVProxy-Faults" in named
    code = "\n".join(p.read_text() for p in (ROOT / "kvproxy").rglob("*.py"))
    tests = "\n".join(
        p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name
    )
    for header in named:
        assert f'"{header}"' in code, f"{header}: no code sets it"
        assert f'"{header}"' in tests or f"'{header}'" in tests, f"{header}: no test checks it"


def test_the_cache_labels_are_defined_once_and_are_the_codes() -> None:
    defined: dict[str, set[str]] = {}
    for doc in DOCS:
        for line in doc.read_text(encoding="utf-8").splitlines():
            row = re.match(r"\| `([a-z]+)` \|", line)
            if row and row.group(1) in {*LABELS, "hit", "busy"}:
                defined.setdefault(doc.name, set()).add(row.group(1))
    assert defined == {"clients.md": LABELS}, defined  # one table, every value of the code
    mentioned = {p for doc in DOCS for p in ticked(doc) if p in LABELS}
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    for label in mentioned:
        assert f'"{label}"' in tests, f"no test expects {label!r}"


# One request for each route that uses a slot; the answer carries X-KVProxy-Cache.
SLOT_ROUTES = sorted(
    r.path for r in ROUTES if r.treatment in (Treatment.KEYED, Treatment.EVERY_SLOT)
)
BODIES = {
    "/v1/messages": {
        "model": "m",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/responses": {"input": "hi", "max_output_tokens": 4},
    "/infill": {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 4},
}


@pytest.mark.parametrize("path", SLOT_ROUTES)
async def test_a_route_that_uses_a_slot_answers_with_the_cache_header(
    make: Maker, path: str
) -> None:
    """clients.md: every answer on a route that uses a slot carries X-KVProxy-Cache."""
    _, proxy = await make()
    body = BODIES.get(
        path,
        {
            "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi",
            "input": "hi",
            "query": "q",
            "documents": ["d"],
            "max_tokens": 4,
            "n_predict": 4,
        },
    )
    async with aiohttp.ClientSession() as s, s.post(proxy.url + path, json=body) as resp:
        await resp.read()
        assert resp.headers.get("X-KVProxy-Cache") in LABELS, (path, resp.status)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/health"),
        ("GET", "/props"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("GET", "/slots"),
        ("POST", "/nowhere"),
        ("GET", "/"),
    ],
)
async def test_other_routes_and_kvproxys_refusals_carry_no_cache_header(
    make: Maker, method: str, path: str
) -> None:
    _, proxy = await make()
    body = {"content": "hi"} if method == "POST" else None
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, proxy.url + path, json=body) as resp,
    ):
        await resp.read()
        assert "X-KVProxy-Cache" not in resp.headers, (path, resp.status)
