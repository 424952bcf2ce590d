"""The layer rule, checked on every import statement of the package (lazy ones and those under
TYPE_CHECKING too):

    cli → edge → obs → lanes → handlers → cache → server → store, http → wire → keys, config,
    readable → settingvalues

A module imports kvproxy modules of its own layer or of a lower one, never of a higher one:
requests go down one layer per hop, and nothing imports `cli/`. `wire/`, `keys` and the pure
policy modules import no I/O module (no aiohttp, asyncio, sqlite3, files, processes), so the
cache's decisions and the client APIs are tested on plain data. The runtime never imports the
benchmarks or the fake server (a separate distribution under bench/) except `kvproxy bench`'s
own `run`, and the fake server imports nothing of kvproxy: it stands for llama-server.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kvproxy_fake

import kvproxy

PACKAGE = Path(kvproxy.__file__).parent

# Higher imports lower. Layers of one rank do not import each other.
RANK = {
    "cli": 8,
    "edge": 7,
    "obs": 6,
    "lanes": 5,
    "handlers": 4,
    "cache": 3,
    "server": 2,
    "store": 1,
    "http": 1,
    "wire": 0,
    "keys": -1,
    "config": -1,
    "readable": -1,
    "settingvalues": -2,
    "__main__": 9,
}
PURE = (
    "kvproxy.wire",
    "kvproxy.keys",
    "kvproxy.settingvalues",
    "kvproxy.readable",
    "kvproxy.cache.decisions",
    "kvproxy.handlers.plan",
    "kvproxy.lanes.routing",
)
IO_MODULES = ("aiohttp", "asyncio", "sqlite3", "socket", "subprocess", "os", "pathlib", "shutil")
OUTSIDE = ("kvproxy_bench", "kvproxy_fake")


def module_name(path: Path, root: Path, top: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([top, *parts])


def imports(path: Path, name: str) -> list[tuple[str, int, bool]]:
    """(absolute module imported, line, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - child.level + 1]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                found.append((mod, child.lineno, in_function))
                # `from kvproxy.x import module` names a module too.
                found.extend((f"{mod}.{a.name}", child.lineno, in_function) for a in child.names)
            visit(child, nested)

    visit(tree, False)
    return found


def layer(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def runtime_modules() -> list[tuple[Path, str]]:
    return [(p, module_name(p, PACKAGE, "kvproxy")) for p in sorted(PACKAGE.rglob("*.py"))]


def test_every_runtime_module_is_in_a_layer() -> None:
    unplaced = [m for _, m in runtime_modules() if m != "kvproxy" and layer(m) not in RANK]
    assert unplaced == []


def test_imports_run_down_the_layers() -> None:
    names = {m for _, m in runtime_modules()}
    offenders = []
    for path, name in runtime_modules():
        own = layer(name)
        if name == "kvproxy":
            continue
        for target, line, lazy in imports(path, name):
            if target in OUTSIDE or target.startswith(tuple(o + "." for o in OUTSIDE)):
                if not (name == "kvproxy.cli.bench" and lazy):
                    offenders.append(f"{name}:{line} imports {target} (benchmarks or fakes)")
                continue
            if target not in names or target == "kvproxy":
                continue  # a name imported from a module, or not kvproxy's
            other = layer(target)
            if other == own:
                continue
            if RANK[other] >= RANK[own]:
                offenders.append(f"{name}:{line} imports {target} ({own} → {other})")
    assert offenders == []


def test_pure_modules_import_no_io() -> None:
    offenders = []
    for path, name in runtime_modules():
        if not name.startswith(PURE):
            continue
        for target, line, _ in imports(path, name):
            top = target.split(".")[0]
            if top in IO_MODULES:
                offenders.append(f"{name}:{line} imports {target}")
            elif top == "kvproxy" and target != "kvproxy" and not target.startswith(PURE):
                offenders.append(f"{name}:{line} imports {target}")
    assert offenders == []


def test_the_fake_server_imports_nothing_of_kvproxy() -> None:
    root = Path(kvproxy_fake.__file__).parent
    offenders = [
        f"{name}:{line} imports {target}"
        for path in sorted(root.rglob("*.py"))
        for name in [module_name(path, root, "kvproxy_fake")]
        for target, line, _ in imports(path, name)
        if target.split(".")[0] == "kvproxy"
    ]
    assert offenders == []


# Fields that change only through their owner's methods, so what the README says holds: a
# slot's picture changes in slots.py, a backend's state in backend.py.
OWNED = {
    "kvproxy.cache.servers.slots": (
        "slot",
        {"holding", "saved", "busy", "last_used", "changed_at", "snapshot", "seen_at"}
        | {"started_at", "occupant", "saving", "claimed", "taken", "pending", "action"}
        | {"serving", "finishing"},
    ),
    "kvproxy.cache.servers.backend": (
        "backend",
        {"enabled", "slot_actions", "doubt", "store_open", "model_identity", "model_info"}
        | {"fingerprint", "identity", "life", "life_started"},
    ),
}


def test_slot_and_backend_fields_change_only_in_their_owners() -> None:
    offenders = []
    for path, name in runtime_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                owner_text = ast.unparse(target.value).lower()
                for owner, (word, fields) in OWNED.items():
                    if name != owner and target.attr in fields and word in owner_text:
                        offenders.append(f"{name}:{target.lineno}: {ast.unparse(target)}")
    assert offenders == []


def test_the_cache_proper_imports_no_aiohttp() -> None:
    """What outlives a request (cache/) knows no HTTP server: no aiohttp, no relay, no error
    bodies. The lanes and the handlers above it answer clients."""
    web_side = ("aiohttp", "kvproxy.http.relay", "kvproxy.http.errors", "kvproxy.http.bodies")
    offenders = [
        f"{name}:{line} imports {target}"
        for path, name in runtime_modules()
        if layer(name) == "cache"
        for target, line, _ in imports(path, name)
        if target == web_side[0] or target.startswith(("aiohttp.", *web_side[1:]))
    ]
    assert offenders == []
