"""The aiohttp application: where each incoming request goes."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import orjson
from aiohttp import web

from kvproxy import readable
from kvproxy.cache.decisions.policy import Decision as CacheDecision
from kvproxy.cache.reports.events import Events
from kvproxy.config import Settings
from kvproxy.edge import routes, status
from kvproxy.edge.guards import admin_refusal, client_refusal, host_refusal
from kvproxy.edge.heldbodies import HeldBodies
from kvproxy.edge.inflight import InFlight
from kvproxy.edge.routes import Decision, Role, RouteTable, Treatment, normal_path, predict_routes
from kvproxy.http.bodies import refused_encoding
from kvproxy.http.errors import error_response, loading_response
from kvproxy.http.relay import relay
from kvproxy.http.session import Upstream
from kvproxy.lanes.cache import ConversationCache
from kvproxy.obs.metrics import CONTENT_TYPE, Metrics
from kvproxy.obs.recent import Recent
from kvproxy.obs.requestlog import RequestLog
from kvproxy.store import presence
from kvproxy.wire import WireAdapter
from kvproxy.wire.chat import ChatAdapter
from kvproxy.wire.messages import MessagesAdapter
from kvproxy.wire.prompts import PromptAdapter
from kvproxy.wire.responses import ResponsesAdapter

log = logging.getLogger("kvproxy.proxy")

# The X-KVProxy-Cache of a slot-using request kvproxy sent on as it came.
BYPASS = {"X-KVProxy-Cache": CacheDecision.BYPASS.value}
# The routes metrics label one by one: those that use a slot.
SLOT_PATHS = routes.paths(Treatment.KEYED) | routes.paths(Treatment.EVERY_SLOT)


def adapters(keep_reasoning: bool) -> dict[str, WireAdapter]:
    """Each wire API the route table names (`Route.api`), with the adapter that reads it."""
    return {
        "chat": ChatAdapter(keep_reasoning),
        "responses": ResponsesAdapter(keep_reasoning),
        "messages": MessagesAdapter(),
        "completion": PromptAdapter("completion"),
        "infill": PromptAdapter("infill"),
    }


class Service:
    """Everything one running proxy owns; lives on the app object."""

    def __init__(self, settings: Settings, upstream_urls: str | Sequence[str]) -> None:
        self.settings = settings
        # kvproxy's environment is the managed server's, and usually the sidecar's too.
        self.routes = RouteTable(
            settings.allow_route, predict_routes(os.environ), settings.allow_model_management
        )
        for path in self.routes.refused_allowances():
            log.warning("--allow-route %s names a route kvproxy refuses; it stays refused", path)
        urls = [upstream_urls] if isinstance(upstream_urls, str) else list(upstream_urls)
        # One session per llama-server; the cache keeps a lane (slot pool, identity) for each.
        self.upstreams = [Upstream(url, settings.api_key) for url in urls]
        self.events = Events()
        self.metrics = Metrics(SLOT_PATHS)
        self.cache = ConversationCache(settings, self.upstreams, self.events)
        self.metrics.watch(self.cache)
        # What the status page shows of the last requests.
        self.recent = Recent(excerpts=not settings.tenants)
        self.held_bodies = HeldBodies(settings.max_body_memory)
        self.in_flight = InFlight()  # named when a managed server dies
        # Managed mode: None while a server runs, else the seconds until one starts again.
        self.servers_down_for: Callable[[], float | None] = lambda: None
        # Managed mode: the servers' last N log lines (GET /kvproxy/server-log).
        self.server_log: Callable[[int], Awaitable[list[str]]] | None = None
        # time.monotonic() by which saving at shutdown must end (kvproxy serve sets it at
        # SIGTERM, from --shutdown-timeout, with room left to stop the managed server).
        self.stop_by: float | None = None
        self.presence: int | None = None  # the cache dir's lock while serving (presence.py)
        self.events.listeners += [self.metrics, RequestLog(), self.recent]
        self.adapters = adapters(settings.keep_reasoning)

    def stats(self) -> dict[str, Any]:
        """`/kvproxy/stats`: the cache's state, and the counters `/metrics` shows."""
        return {
            **self.cache.state(),
            **self.metrics.snapshot(),
            "server_deaths": self.in_flight.snapshot(),
        }

    def status(self) -> dict[str, Any]:
        """`/kvproxy/status.json`, what the status page polls: the stats, the last requests,
        weak hits and misses, and the last hour's totals."""
        stats = self.stats()
        del stats["histograms"]
        return {
            **stats,
            "requests_total": sum(stats["requests"].values()),
            "settings": status.shown_settings(self.settings),
            **self.recent.snapshot(),
        }

    async def start(self) -> None:
        # For as long as this proxy serves: `kvproxy doctor` leaves the slots alone meanwhile.
        self.presence = await asyncio.to_thread(presence.hold, self.settings.cache_dir)
        for upstream in self.upstreams:
            await upstream.start()
        await self.cache.start()

    async def stop(self) -> None:
        try:
            await self.cache.stop(self.save_budget())
        finally:
            for upstream in self.upstreams:
                await upstream.close()
            presence.release(self.presence)

    def save_budget(self) -> float:
        """What is left for saving slots: until `stop_by` when kvproxy serve set it (the
        requests in flight took their part of the deadline, however long), else the part
        after the requests' third, with room to stop."""
        if self.stop_by is None:
            return self.settings.shutdown_timeout * 0.6
        return max(0.0, self.stop_by - time.monotonic())


SERVICE = web.AppKey("service", Service)


async def own_route(request: web.Request, service: Service, path: str) -> web.StreamResponse:
    """kvproxy's own endpoints under /kvproxy/, and /metrics."""
    refusal = admin_refusal(request, service.settings)
    if refusal is not None:
        return refusal
    if request.method == "GET" and path == "/kvproxy/stats":
        return web.json_response(service.stats(), dumps=lambda o: orjson.dumps(o).decode())
    if request.method == "GET" and path == "/kvproxy/status.json":
        return web.json_response(service.status(), dumps=lambda o: orjson.dumps(o).decode())
    if request.method == "GET" and path == "/kvproxy/server-log":
        return await status.server_log_response(request, service.server_log)
    if request.method == "GET" and path == "/kvproxy":
        # normal_path drops the slash; the page's relative URLs need it.
        return status.page_response() if request.path.endswith("/") else status.to_page()
    if request.method == "GET" and path == "/metrics":
        # Shadows llama-server's own /metrics (scrape the server directly for those).
        return web.Response(
            body=service.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE}
        )
    return error_response(404, f"No kvproxy route {request.method} {path}.", "not_found")


async def dispatch(request: web.Request) -> web.StreamResponse:
    service = request.app[SERVICE]
    refusal = host_refusal(request, service.settings)
    if refusal is not None:
        return error_response(403, refusal, "host_not_allowed")
    path = normal_path(request.path)
    if path == "/" and request.method in ("GET", "HEAD"):
        return status.root_answer()
    own = path == "/kvproxy" or path.startswith("/kvproxy/")
    if not (own or path == "/metrics"):
        refused = client_refusal(request, service.settings)
        if refused is not None:
            return refused
    if own or (path == "/metrics" and request.method == "GET"):
        return await own_route(request, service, path)
    decision = service.routes.decide(request.method, path)
    if decision.treatment is Treatment.REFUSED:
        return error_response(403, f"Forbidden: {decision.reason}.", "forbidden_route")
    if decision.treatment is None:
        return error_response(
            404,
            f"kvproxy does not forward {request.method} {path}: not a route it knows for this "
            "llama-server (the operator can allow it with --allow-route).",
            "not_found",
        )
    encoding = refused_encoding(request.headers.get("Content-Encoding"))
    if encoding is not None:
        return error_response(
            415,
            f"Content-Encoding {encoding!r} is not accepted: send the request body "
            "uncompressed (llama-server does not decompress request bodies).",
            "unsupported_content_encoding",
        )
    if request.content_length is not None and request.content_length > service.settings.max_body:
        return _too_large(service.settings)
    if not request.body_exists:
        return await _serve(request, service, path, decision)
    size = request.content_length
    held = size if size is not None else service.settings.max_body
    if not service.held_bodies.take(held):
        return _bodies_full(service.settings)
    try:
        late = await read_body(request, service.settings.client_timeout)
        if late is not None:
            return late
        ticket = service.in_flight.start(request.method, path, await request.read())
        try:
            return await _serve(request, service, path, decision)
        finally:
            service.in_flight.end(ticket)
    finally:
        service.held_bodies.give_back(held)


def _bodies_full(settings: Settings) -> web.Response:
    response = error_response(
        503,
        "kvproxy holds as many request bytes as it may "
        f"(--max-body-memory {readable.size(settings.max_body_memory)}); try again.",
        "body_memory_full",
    )
    response.headers["Retry-After"] = "1"
    return response


async def _serve(
    request: web.Request, service: Service, path: str, decision: Decision
) -> web.StreamResponse:
    """A request whose body (if any) was read whole, as the route table decided."""
    down_for = service.servers_down_for()
    if down_for is not None:
        # Between a managed server's death and its next start nothing listens: a client
        # told when to come back beats a 502 it may treat as final.
        response = error_response(
            503,
            "llama-server died and is being started again; try again in a few seconds.",
            "server_restarting",
        )
        response.headers["Retry-After"] = str(max(1, math.ceil(down_for)))
        return response
    lanes = service.cache.dispatch
    path_qs = _path_qs(path, request)
    if decision.role is Role.HEALTH:
        if not service.cache.looked:
            # The server answers 503 until it is ready; kvproxy is ready once it has looked
            # for the server: a client that waits for 200 then sends requests kvproxy can pin.
            return loading_response()
        for lane in lanes.lanes:
            await lane.backend.rediscover_if_off(wake=False)
        return await forward(request, service, path_qs, faults_header(service))
    if decision.treatment is Treatment.KEYED and request.method == "POST":
        return await lanes.keyed(request, path_qs, service.adapters[decision.api])
    if decision.role is Role.MANAGES_MODELS:
        # Allowed (--allow-model-management): a model the router unloads takes its slots'
        # state with it, so every slot is held and what would be lost is saved first.
        body = await request.read()
        lane = await lanes.management_lane(path, body)
        return await lane.unkeyed.hold_all(request, path_qs, body)
    if decision.treatment is Treatment.EVERY_SLOT and request.method == "POST":
        async with lanes.lane_for(request) as (lane, as_it_is):
            if as_it_is:  # the router's refusal is the answer; nothing was cached
                return await forward(request, service, path_qs, BYPASS, lane.backend.upstream)
            not_yet = await lanes.ready(lane)
            if not_yet is not None:
                return not_yet
            return await lane.unkeyed.handle_unpinnable(request, path_qs, path)
    if decision.role is Role.MODEL_LIST and request.query.get("reload"):
        # A router reads its models dir again (server-models.cpp: any non-empty value).
        return await reload_every_router(request, service, path_qs)
    if lanes.models and decision.role is Role.LOADS_MODEL:
        # A router loads the model this names, unloading another past --models-max: that
        # one's slots are saved first, as before a chat turn (lanes/models.py).
        async with lanes.lane_for(request) as (lane, _):
            return await forward(request, service, path_qs, upstream=lane.backend.upstream)
    return await forward(request, service, path_qs)


async def reload_every_router(
    request: web.Request, service: Service, path_qs: str
) -> web.StreamResponse:
    """`GET /models?reload=1` makes a router read its models dir again. Forwarded, it would
    reach one router: with several behind kvproxy, a model copied in would be found on that
    one only. The others are asked first; the client gets the last one's answer."""
    *others, last = service.cache.dispatch.routers() or [service.cache.dispatch.pick()]
    outcomes = await asyncio.gather(
        *(lane.backend.upstream.get_json(path_qs) for lane in others), return_exceptions=True
    )
    for lane, outcome in zip(others, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            log.warning("reloading the model list of %s: %s", lane.name, outcome)
    return await forward(request, service, path_qs, upstream=last.backend.upstream)


async def forward(
    request: web.Request,
    service: Service,
    path_qs: str,
    extra_headers: Mapping[str, str] | None = None,
    upstream: Upstream | None = None,
) -> web.StreamResponse:
    """Plain pass-through of a request whose body was read whole (read_body), to `upstream`
    or the server `Dispatch.pick` gives."""
    data = await request.read() if request.body_exists else None
    upstream = upstream or service.cache.dispatch.pick().backend.upstream
    result = await relay(
        request, upstream, path_qs, data, body_replaced=True, extra_headers=extra_headers
    )
    return result.response


def faults_header(service: Service) -> dict[str, str]:
    """`/health` stays the server's answer; while some work of kvproxy's keeps failing (a full
    disk, a read-only cache dir: cache/reports/faults.py) it also names what, in a header. The
    errors themselves are in /kvproxy/stats, which off loopback needs the admin token."""
    failing = service.cache.faults.failing()
    return {"X-KVProxy-Faults": ", ".join(sorted(failing))} if failing else {}


async def read_body(request: web.Request, within: float) -> web.Response | None:
    """Reads the whole body now (aiohttp keeps it for every later `request.read()`), within
    `within` seconds, else a 408 that closes the connection. Nothing is forwarded before the
    body is whole: a client trickling one never holds a llama-server HTTP thread. A body past
    --max-body, chunked too, raises HTTPRequestEntityTooLarge (the guard answers 413)."""
    if request.content.is_eof():
        await request.read()  # it all came with the head: nothing to wait for, no timer
        return None
    try:
        async with asyncio.timeout(within):
            await request.read()
    except TimeoutError:
        response = error_response(
            408,
            f"The request body did not arrive within {within:g} s (--client-timeout).",
            "request_timeout",
        )
        response.force_close()
        return response
    return None


def _path_qs(path: str, request: web.Request) -> str:
    qs = request.rel_url.raw_query_string
    return quote(path, safe="/:@!$&'()*+,;=-._~") + (f"?{qs}" if qs else "")


def _too_large(settings: Settings) -> web.Response:
    return error_response(
        413,
        f"Request body is larger than the proxy's limit of {readable.size(settings.max_body)} "
        "(raise it with --max-body).",
        "request_too_large",
    )


@web.middleware
async def guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Whatever goes wrong inside, the client gets an OpenAI-style error, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        return _too_large(request.app[SERVICE].settings)
    except web.HTTPException:
        raise
    except ConnectionResetError:
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error_response(500, "kvproxy internal error; see the proxy's log.", "proxy_error")


def build_app(settings: Settings, upstream_urls: str | Sequence[str]) -> web.Application:
    app = web.Application(client_max_size=settings.max_body, middlewares=[guard])
    service = Service(settings, upstream_urls)
    app[SERVICE] = service

    async def lifecycle(_app: web.Application):  # type: ignore[no-untyped-def]
        await service.start()
        yield
        await service.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    return app
