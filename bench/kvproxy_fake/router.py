"""A fake router-mode llama-server: one FakeLlamaServer child per model, started when a
request needs it, as llama-server's router does (tools/server/server-models.cpp; the facts
kvproxy relies on are in docs/how-it-works.md, "Router mode"):

- GET /props without `?model=` is the router's own (`"role": "router"`); GET /models lists
  each model with `status.value` (loaded, loading, unloaded, sleeping) and `status.args`
  (the child's command line, also before its first load), plus the child's `meta` while it
  runs; /models/sse streams `model_status` (a child spawned) and `status_change` events.
  Neither loads a model.
- Other GETs (/props, /slots, /metrics) go to the child named by `?model=`; POSTs
  (completions, /tokenize, /apply-template, /slots/{id}) to the child named by the body's
  "model". No name: 400 "model name is missing from the request"; an unknown one: 400
  "model 'x' not found"; `?autoload=false` and a model not running: 400 "model is not
  loaded". A POST makes its model the most recently used; a GET does not.
- Loading a model beyond `models_max` first unloads the least recently used model that has
  no request in flight; an unloaded child's slots are gone. POST /models/load and
  /models/unload do it on demand.
- The list is read once, at start: a model added to the models dir later (`add_file`) is
  listed, and served, only after GET /models?reload=1 (server_models::load_models), which
  loads nothing and sends a `models_reload` event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvproxy_fake.model import error_response
from kvproxy_fake.server import FakeLlamaServer

# What the router answers itself; every other route goes to a child.
ROUTER_GETS = ("/health", "/v1/health", "/models", "/v1/models", "/models/sse")
# Hop-by-hop headers not relayed between the router and a child.
HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


@dataclass
class FakeModel:
    name: str
    path: str
    child: FakeLlamaServer | None = None
    status: str = "unloaded"
    last_used: float = 0.0
    req_count: int = 0
    loads: int = 0
    child_args: dict[str, Any] = field(default_factory=dict)


class FakeRouter:
    """In-process fake of `llama-server --models-dir DIR [--models-max N]`. `models`: model
    name → GGUF path (the file need not exist). `child_args`: FakeLlamaServer arguments every
    child gets (the router's own flags, which real children inherit)."""

    def __init__(
        self,
        models: dict[str, str],
        *,
        models_max: int = 4,
        slot_save_path: Path | None = None,
        n_slots: int = 2,
        n_ctx: int = 4096,
        autoload: bool = True,
        **child_args: Any,
    ) -> None:
        self.models = {
            name: FakeModel(name, path, child_args=dict(child_args))
            for name, path in models.items()
        }
        self.child_args = child_args
        self.models_max = models_max
        self.slot_save_path = slot_save_path
        self.n_slots = n_slots
        self.n_ctx = n_ctx
        self.autoload = autoload
        self.requests: list[tuple[str, str, Any]] = []
        self.files: dict[str, str] = {}  # added to the models dir, not yet listed (add_file)
        self.unloads: list[str] = []  # model names, in the order the router unloaded them
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock = asyncio.Lock()
        self._listeners: list[asyncio.Queue[dict[str, Any]]] = []

    # ----------------------------------------------------------------- lifecycle

    async def start(self, port: int = 0) -> str:
        app = web.Application(client_max_size=64 * 2**20)
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/v1/health", self._health)
        r.add_get("/models", self._list)
        r.add_get("/v1/models", self._list)
        r.add_get("/models/sse", self._sse)
        r.add_post("/models/load", self._load_route)
        r.add_post("/models/unload", self._unload_route)
        r.add_get("/props", self._props)
        r.add_route("GET", "/{tail:.*}", self._proxy_get)
        r.add_route("POST", "/{tail:.*}", self._proxy_post)
        self._session = aiohttp.ClientSession(auto_decompress=False)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for model in self.models.values():
            if model.child is not None:
                await model.child.stop()
                model.child = None
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeRouter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def child(self, name: str) -> FakeLlamaServer:
        """The running child of a model (tests look at its slots and requests)."""
        child = self.models[name].child
        if child is None:
            raise RuntimeError(f"model {name} is not loaded")
        return child

    # ----------------------------------------------------------------- models

    def add_file(self, name: str, path: str | None = None) -> None:
        """A GGUF copied into the models dir while the router runs: listed after a reload."""
        self.files[name] = path or f"/models/{name}.gguf"

    def reload(self) -> None:
        for name, path in self.files.items():
            self.models.setdefault(name, FakeModel(name, path, child_args=dict(self.child_args)))
        self.files.clear()
        self._notify("*", "models_reload")

    def args(self, model: FakeModel) -> list[str]:
        """The child's command line, as GET /models shows it."""
        args = ["llama-server", "--model", model.path, "--parallel", str(self.n_slots)]
        args += ["--ctx-size", str(self.n_slots * self.n_ctx), "--no-kv-unified"]
        if self.slot_save_path is not None:
            args += ["--slot-save-path", str(self.slot_save_path)]
        return [*args, "--host", "127.0.0.1", "--alias", model.name]

    def status(self, model: FakeModel) -> str:
        if model.child is not None and model.status == "loaded" and model.child.is_sleeping:
            return "sleeping"
        return model.status

    def _notify(self, name: str, event: str, data: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"model": name, "event": event}
        if data is not None:
            message["data"] = data
        for queue in self._listeners:
            queue.put_nowait(message)

    async def load(self, name: str) -> None:
        """server_models::load: unload the LRU model first when `models_max` are running."""
        async with self._lock:
            model = self.models[name]
            if model.child is not None:
                return
            running = [m for m in self.models.values() if m.child is not None]
            if 0 < self.models_max <= len(running):
                idle = [m for m in running if m.req_count == 0]
                if not idle:
                    raise web.HTTPServiceUnavailable(text="model limit reached, try again later")
                await self._unload(min(idle, key=lambda m: m.last_used))
            model.status = "loading"
            self._notify(name, "model_status", {"status": "loading"})
            child = FakeLlamaServer(
                n_slots=self.n_slots,
                n_ctx=self.n_ctx,
                slot_save_path=self.slot_save_path,
                model_path=model.path,
                **model.child_args,
            )
            await child.start()
            model.child, model.status, model.last_used = child, "loaded", time.monotonic()
            model.loads += 1
            self._notify(name, "status_change", {"status": "loaded"})

    async def unload(self, name: str) -> None:
        async with self._lock:
            await self._unload(self.models[name])

    async def _unload(self, model: FakeModel) -> None:
        if model.child is None:
            return
        child, model.child, model.status = model.child, None, "unloaded"
        await child.stop()
        self.unloads.append(model.name)
        self._notify(model.name, "status_change", {"status": "unloaded", "exit_code": 0})

    # ----------------------------------------------------------------- router routes

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("model"):
            return await self._proxy_get(request)
        self.requests.append(("GET", request.path_qs, None))
        return web.json_response(
            {
                "role": "router",
                "max_instances": self.models_max,
                "models_autoload": self.autoload,
                "model_alias": "llama-server",
                "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0},
                "build_info": "fake",
            }
        )

    async def _list(self, request: web.Request) -> web.Response:
        self.requests.append(("GET", request.path_qs, None))
        if request.query.get("reload"):
            self.reload()
        data = []
        for model in self.models.values():
            info: dict[str, Any] = {
                "id": model.name,
                "aliases": [],
                "tags": [],
                "object": "model",
                "owned_by": "llamacpp",
                "created": int(time.time()),
                "status": {"value": self.status(model), "args": self.args(model)},
                "source": "local",
            }
            if model.child is not None:
                child = model.child
                info["meta"] = {
                    "n_ctx": child.n_ctx,
                    "n_ctx_train": child.n_ctx,
                    "size": 1,
                    "ftype": "F16",
                }
            data.append(info)
        return web.json_response({"data": data, "object": "list"})

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._listeners.append(queue)
        try:
            while True:
                message = await queue.get()
                await resp.write(b"data: " + json.dumps(message).encode() + b"\n\n")
        finally:
            self._listeners.remove(queue)

    async def _load_route(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("POST", request.path_qs, body))
        model = self.models.get(str(body.get("model", "")))
        if model is None:
            return error_response("model is not found", "not_found_error")
        if model.child is not None:
            return error_response("model is already running")
        await self.load(model.name)
        return web.json_response({"success": True})

    async def _unload_route(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(("POST", request.path_qs, body))
        model = self.models.get(str(body.get("model", "")))
        if model is None:
            return error_response("model is not found")
        if model.child is None:
            return error_response("model is not running")
        await self.unload(model.name)
        return web.json_response({"success": True})

    # ----------------------------------------------------------------- proxying

    async def _proxy_get(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(("GET", request.path_qs, None))
        return await self._proxy(request, request.query.get("model", ""), b"", False)

    async def _proxy_post(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            return error_response("[json.exception.parse_error] not JSON")
        self.requests.append(("POST", request.path_qs, body))
        name = str(body.get("model", "")) if isinstance(body, dict) else ""
        return await self._proxy(request, name, raw, True)

    async def _proxy(
        self, request: web.Request, name: str, raw: bytes, post: bool
    ) -> web.StreamResponse:
        if not name:
            return error_response("model name is missing from the request")
        model = self.models.get(name)
        if model is None:
            return error_response(f"model '{name}' not found")
        autoload = request.query.get("autoload")
        wants_load = autoload in ("true", "1") if autoload else self.autoload
        if model.child is None:
            if not wants_load:
                return error_response("model is not loaded")
            await self.load(name)
        child = model.child
        assert child is not None and self._session is not None
        if post:
            model.last_used = time.monotonic()
        model.req_count += 1
        try:
            return await self._relay(request, child.url + request.path_qs, raw)
        finally:
            model.req_count -= 1

    async def _relay(self, request: web.Request, url: str, raw: bytes) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        async with self._session.request(
            request.method, url, data=raw or None, headers=headers
        ) as upstream:
            resp = web.StreamResponse(status=upstream.status)
            for key, value in upstream.headers.items():
                if key.lower() not in HOP_HEADERS:
                    resp.headers[key] = value
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):
                async for chunk in upstream.content.iter_any():
                    await resp.write(chunk)
            await resp.write_eof()
            return resp


def fake_models(names: Sequence[str], root: str = "/models") -> dict[str, str]:
    """Model name → path, as --models-dir names a model after its file (`NAME.gguf`)."""
    return {name: f"{root}/{name}.gguf" for name in names}
