"""The layer rule, checked on every import statement of the package (lazy ones and those under
TYPE_CHECKING too):

    cli → edge → obs → lanes → handlers → cache → server → store, http → wire → keys, config,
    readable → settingvalues

A module imports kvproxy modules of its own layer or of a lower one, never of a higher one:
requests go down one layer per hop, and nothing imports `cli/`. Inside `cache/` the same rule
holds between its floors (its sub-packages, and `context`):

    scheduling → prefixes → slotio → disk → context → habits → servers → reports → decisions,
    canonical
 `wire/`, `keys` and the pure
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
# cache/'s floors, the same way: a floor imports its own or lower ones.
CACHE_RANK = {
    "scheduling": 8,  # slot work beside the requests: saves in moments, prefetches
    "prefixes": 7,  # what of a request is held already: reuse, openings, stems
    "slotio": 6,  # the I/O a slot goes through: verify, save, restore, clear
    "disk": 5,  # a state's life on disk: commits, saves under way, room, lineage
    "context": 4,  # what every part of the cache is given
    "habits": 3,  # what clients do to a conversation between turns
    "servers": 2,  # each llama-server as the cache knows it: its slots, the pool, leases
    "reports": 1,  # what the cache tells: events, explained misses, faults
    "decisions": 0,  # the rules, on plain data (all of it in PURE)
    "canonical": 0,  # the canonical prefix and the tokenising it rests on
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


def floor(module: str) -> str:
    """The floor of a module of cache/ ("" for the package itself)."""
    return module.split(".")[2] if module.count(".") >= 2 else ""


def cache_modules() -> list[tuple[Path, str]]:
    return [(p, m) for p, m in runtime_modules() if layer(m) == "cache" and m != "kvproxy.cache"]


def test_every_cache_module_is_on_a_floor() -> None:
    assert [m for _, m in cache_modules() if floor(m) not in CACHE_RANK] == []


def test_imports_run_down_the_cache_floors() -> None:
    names = {m for _, m in runtime_modules()}
    offenders = []
    for path, name in cache_modules():
        own = floor(name)
        for target, line, _ in imports(path, name):
            if target not in names or layer(target) != "cache" or target == "kvproxy.cache":
                continue
            other = floor(target)
            if other != own and CACHE_RANK[other] >= CACHE_RANK[own]:
                offenders.append(f"{name}:{line} imports {target} ({own} → {other})")
    assert offenders == []


def test_the_cache_packages_hand_nothing_on() -> None:
    """cache/__init__.py and its floors' are a docstring only: a name is imported from the module
    that holds it, and no package's face can close a circle (habits/__init__.py holds the habits
    themselves)."""
    faces = [PACKAGE / "cache" / "__init__.py"] + [
        PACKAGE / "cache" / f / "__init__.py"
        for f in CACHE_RANK
        if f != "habits" and (PACKAGE / "cache" / f).is_dir()
    ]
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in faces
        if imports(path, module_name(path, PACKAGE, "kvproxy"))
    ]
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
# slot's picture changes in cache/servers/slots.py, a backend's state in cache/servers/backend.py.
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
