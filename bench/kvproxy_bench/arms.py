"""The three arms a benchmark compares, each started by the benchmark itself:

- `direct, no cache`: llama-server with `--cache-ram 0`;
- `direct, RAM cache`: llama-server with its default RAM prompt cache (`--cache-ram` 8 GiB);
- `kvproxy`: `kvproxy serve --model …` in managed mode (it starts llama-server with
  `--cache-ram 0`), as a subprocess, so that a restart really loses everything in memory.

Every arm runs llama-server with the same flags apart from the caching ones: the same slots,
context, threads, `--no-kv-unified`, and `--swa-full` for sliding-window models (kvproxy's
managed mode adds it, so the direct arms get it too and differ only in caching).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy.server.managed import (
    ManagedServer,
    find_server_binary,
    free_port,
    resolve_model,
    server_command,
)
from kvproxy.server.modelinfo import ModelInfo, read_model_info
from kvproxy_bench.process import LoggedProcess

log = logging.getLogger("kvproxy.bench")

DIRECT_NO_CACHE = "direct, no cache"
DIRECT_RAM_CACHE = "direct, RAM cache"
KVPROXY = "kvproxy"
ALL_ARMS = (DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY)
# What `--arms` takes: the names have commas in them, and the flag is comma-separated.
ARM_FLAGS = {"no-cache": DIRECT_NO_CACHE, "ram-cache": DIRECT_RAM_CACHE, "kvproxy": KVPROXY}


@dataclass
class BenchEnv:
    """What every arm of every scenario shares."""

    binary: Path
    model: Path
    info: ModelInfo
    workdir: Path  # cache dirs and logs of this run
    threads: int
    server_args: list[str] = field(default_factory=list)  # the user's extra llama-server flags
    start_timeout: float = 300.0

    @classmethod
    def create(
        cls,
        workdir: Path,
        model: str = "default",
        server_bin: Path | None = None,
        threads: int | None = None,
        server_args: list[str] | None = None,
    ) -> BenchEnv:
        """Blocking (it may assemble the bundled model): call it in a thread."""
        path = resolve_model(model)
        return cls(
            binary=find_server_binary(server_bin),
            model=path,
            info=read_model_info(path),
            workdir=workdir,
            threads=threads or os.cpu_count() or 2,
            server_args=list(server_args or []),
        )

    def common_flags(self) -> list[str]:
        flags = ["--threads", str(self.threads), *self.server_args]
        if self.info.has_swa and "--swa-full" not in flags:
            flags.append("--swa-full")
        return flags

    _dirs: itertools.count[int] = field(default_factory=itertools.count)

    def new_dir(self, name: str) -> Path:
        """A fresh path in the work dir (created by whoever uses it, off the event loop)."""
        return self.workdir / f"{next(self._dirs):02d}-{name}"


class Arm:
    """One way of serving the same requests; `url` is where clients send them."""

    name: str
    url: str
    cache_dir: Path

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def restart(self) -> None:
        """Everything this arm keeps in memory is lost; only what is on disk survives."""
        await self.stop()
        await self.start()

    async def __aenter__(self) -> Arm:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class DirectArm(Arm):
    """llama-server alone, with (`ram_cache`) or without its RAM prompt cache."""

    def __init__(
        self,
        env: BenchEnv,
        slots: int,
        ctx_per_slot: int,
        ram_cache: bool,
        cache_ram_mib: int | None = None,  # the RAM cache's size; None: the server's default
        name: str | None = None,
    ) -> None:
        self.env = env
        self.name = name or (DIRECT_RAM_CACHE if ram_cache else DIRECT_NO_CACHE)
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.ram_cache = ram_cache
        self.cache_ram_mib = cache_ram_mib
        self.cache_dir = env.new_dir("ram" if ram_cache else "nocache")
        # Where the server's own lines go (None: kvproxy's "llama-server" logger, which the
        # bench silences).
        self.log_path: Path | None = None
        self.server: ManagedServer | None = None
        self.url = ""

    def command(self, port: int) -> list[str]:
        extra = self.env.common_flags()
        if not self.ram_cache:
            extra += ["--cache-ram", "0"]
        elif self.cache_ram_mib is not None:
            extra += ["--cache-ram", str(self.cache_ram_mib)]
        return server_command(
            self.env.binary,
            self.env.model,
            port,
            self.cache_dir,
            self.slots,
            self.ctx_per_slot,
            None,
            extra,
        )

    async def start(self) -> None:
        await asyncio.to_thread(self.cache_dir.mkdir, 0o700, True, True)
        port = free_port()
        self.server = ManagedServer(self.command(port), port, log_path=self.log_path)
        await self.server.start(self.env.start_timeout)
        self.url = self.server.url

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()
            self.server = None


class ProxyArm(Arm):
    """`kvproxy serve --model M` (managed mode) as a subprocess: kvproxy starts llama-server
    with `--cache-ram 0` (or `server_cache_ram_mib`: the server's RAM cache as a first tier),
    and a restart stops both processes (slots saved on SIGTERM)."""

    def __init__(
        self,
        env: BenchEnv,
        slots: int,
        ctx_per_slot: int,
        proxy_args: list[str] | None = None,
        server_cache_ram_mib: int = 0,
        name: str = KVPROXY,
    ) -> None:
        self.env = env
        self.name = name
        self.server_cache_ram_mib = server_cache_ram_mib
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot
        self.proxy_args = list(proxy_args or [])
        self.cache_dir = env.new_dir("kvproxy-cache")
        self.log_path = self.cache_dir.parent / f"{self.cache_dir.name}.log"
        self.proc = LoggedProcess(self.log_path)
        self.url = ""

    def model_args(self) -> list[str]:
        """What kvproxy serves: the benchmark's model."""
        return ["--model", str(self.env.model)]

    def command(self, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "kvproxy.cli",
            "serve",
            *self.model_args(),
            "--server-bin",
            str(self.env.binary),
            "--slots",
            str(self.slots),
            "--ctx-size",
            str(self.ctx_per_slot),
            "--cache-dir",
            str(self.cache_dir),
            "--port",
            str(port),
            *self.proxy_args,
            "--",
            *self.env.common_flags(),
            "--cache-ram",
            str(self.server_cache_ram_mib),
        ]

    async def start(self) -> None:
        await asyncio.to_thread(self.cache_dir.mkdir, 0o700, True, True)
        port = free_port()
        await self.proc.start(self.command(port))
        self.url = f"http://127.0.0.1:{port}"
        await self._wait_ready()

    async def _wait_ready(self) -> None:
        """Ready when the proxy answers and its cache is on (it found the server's slots)."""
        deadline = time.monotonic() + self.env.start_timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while True:
                if self.proc.exited is not None:
                    tail = await asyncio.to_thread(_tail, self.log_path)
                    raise RuntimeError(f"kvproxy exited with {self.proc.exited}:\n{tail}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    if await self.answers(session):
                        return
                if time.monotonic() > deadline:
                    await self.stop()
                    raise RuntimeError(f"kvproxy not ready after {self.env.start_timeout:g}s")
                await asyncio.sleep(0.2)

    async def answers(self, session: aiohttp.ClientSession) -> bool:
        """The proxy answers and its cache is on (it found the server's slots)."""
        async with session.get(self.url + "/kvproxy/stats") as resp:
            return resp.status == 200 and bool((await resp.json()).get("enabled"))

    async def stats(self) -> dict[str, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(self.url + "/kvproxy/stats") as resp,
        ):
            return dict(await resp.json())

    async def stop(self) -> None:
        await self.proc.stop(grace=120)  # saving every slot may take a while


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def make_arm(
    name: str, env: BenchEnv, slots: int, ctx_per_slot: int, proxy_args: list[str] | None = None
) -> Arm:
    if name == KVPROXY:
        return ProxyArm(env, slots, ctx_per_slot, proxy_args)
    return DirectArm(env, slots, ctx_per_slot, ram_cache=name == DIRECT_RAM_CACHE)


def side_by_side(env: BenchEnv, slots: int, ctx_per_slot: int) -> list[Arm]:
    """The server alone with its RAM cache, then kvproxy in front of it: the pair a
    scenario runs when it reports kvproxy against what the server does by itself."""
    return [
        make_arm(DIRECT_RAM_CACHE, env, slots, ctx_per_slot),
        make_arm(KVPROXY, env, slots, ctx_per_slot),
    ]
