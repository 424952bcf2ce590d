"""Which lane (llama-server, or model of a router) a request goes to, and the one door of
every keyed request (`keyed`): its body read once, the lane chosen by routing.py's rule (the
server holding the conversation, else one that can restore it now, else the least loaded),
readied once, and served there by the lane's keyed driver. A server that cannot be reached
before any byte of the reply went out leaves rotation, and the request goes to another server
(restored there from the shared cache dir); so does one found hung while the request waited
on it (cache/servers/liveness.py). Requests the cache does not key get their lane from `pick` (the
least loaded) or `lane_for` (a router's model).

With router-mode servers, a request goes to a lane of the model its body names; with several
routers (`--servers N --models-dir`), every router has a lane of each model, and the same rule
picks among the routers that run the model, else those that can load it without unloading
another, else all of them (routing.py, `model_candidates`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

from kvproxy.cache.servers.backend import Backend
from kvproxy.handlers.answers import not_ready_response
from kvproxy.handlers.incoming import Incoming, read_incoming
from kvproxy.http import bodies as jsonbody
from kvproxy.http.errors import Unreachable
from kvproxy.lanes.lane import Lane
from kvproxy.lanes.models import RouterModels
from kvproxy.lanes.routing import LaneView, choose_lane, least_loaded, model_candidates
from kvproxy.wire import Conversation, NotKeyed, WireAdapter

log = logging.getLogger("kvproxy.cache")


class Dispatch:
    def __init__(
        self,
        lanes: list[Lane],
        models: list[RouterModels],
        opened: Callable[[], Awaitable[web.Response | None]],
        find_new: Callable[[], Awaitable[None]],
    ) -> None:
        self.lanes = lanes  # the cache's own list: a router's models, once found, change it
        # Router-mode servers: their models' lanes, by the name a request gives (models.py);
        # the cache's own list (discovery.py).
        self.models = models
        # Waits until the cache dir is open and every server was looked for once (or answers
        # what the client gets instead).
        self._opened = opened
        # Looks for router models kvproxy has no lane for yet (rate-limited by the cache).
        self._find_new = find_new

    async def ready(self, lane: Lane) -> web.Response | None:
        """Before a slot-using request goes to `lane`: the cache is open, and a server that
        was not found is looked for again. None when the request may go; else the answer
        to give instead (what the server would say)."""
        not_yet = await self._opened()
        if not_yet is not None:
            return not_yet
        await lane.backend.rediscover_if_off()
        down = lane.backend.not_ready()
        return None if down is None else not_ready_response(down)

    def elsewhere(self, backend: Backend) -> bool:
        """Whether a request waiting on `backend`'s server could go to another one now: one
        in rotation that serves the same model (for a router's lanes, the same one)."""
        return any(
            lane.in_rotation
            and lane.backend.upstream.base_url != backend.upstream.base_url
            and lane.backend.model == backend.model
            for lane in self.lanes
        )

    def pick(self) -> Lane:
        """The server for a request the cache does not key."""
        if len(self.lanes) == 1:
            return self.lanes[0]
        return self.lanes[least_loaded([_view(lane, None) for lane in self.lanes])]

    def model_lanes(self, payload: Any) -> list[tuple[RouterModels, Lane]]:
        """The lanes of the router model a request body names ("model"), one per router."""
        name = _model_named(payload)
        found = []
        for group in self.models:
            lane = group.lane_for(name)
            if lane is not None:
                found.append((group, lane))
        return found

    async def _model_lanes(self, payload: Any) -> list[tuple[RouterModels, Lane]]:
        """`model_lanes`; for a name no lane serves, after looking for new router models
        (one the router listed since the last look gets its lane now)."""
        found = self.model_lanes(payload)
        name = _model_named(payload)
        if not found and isinstance(name, str) and name:
            await self._find_new()
            found = self.model_lanes(payload)
        return found

    def _choose_model(
        self,
        found: Sequence[tuple[RouterModels, Lane]],
        request: web.Request | None = None,
        adapter: WireAdapter | None = None,
        payload: dict[str, Any] | None = None,
    ) -> tuple[RouterModels, Lane]:
        """Of one model's lanes on several routers, the one for this request."""
        if len(found) == 1:
            return found[0]
        picks = model_candidates(
            [group.running(lane) for group, lane in found],
            [group.has_room(lane) for group, lane in found],
        )
        lanes = [found[i][1] for i in picks]
        if payload is None or request is None or adapter is None:
            return found[picks[least_loaded([_view(lane, None) for lane in lanes])]]
        views = []
        for lane in lanes:
            # Only a lane whose model kvproxy has looked at knows its namespace.
            conv = lane.keyed.read(request, adapter, payload) if lane.in_rotation else None
            views.append(_view(lane, conv if isinstance(conv, Conversation) else None))
        return found[picks[choose_lane(views)]]

    def routers(self) -> list[Lane]:
        """A lane of each router-mode server (its models' lanes share its address)."""
        seen: dict[str, Lane] = {}
        for lane in self.lanes:
            if lane.backend.router or lane.backend.model is not None:
                seen.setdefault(lane.backend.upstream.base_url, lane)
        return list(seen.values())

    async def management_lane(self, path: str, body: bytes) -> Lane:
        """The lane whose slots a model-management route holds (and saves) while it runs:
        with router models, the named model's, after saving what a load will unload."""
        parsed = jsonbody.parse(body)
        name = parsed.value.get("model") if isinstance(parsed.value, dict) else None
        for group in self.models:
            lane = await group.before_management(path, name)
            if lane is not None:
                return lane
        return self.pick()

    @contextlib.asynccontextmanager
    async def lane_for(self, request: web.Request) -> AsyncIterator[tuple[Lane, bool]]:
        """The lane for a request the cache does not key (pinned, or passed through to a
        route on which a router loads a model): with router models, the one it names,
        brought up (models.py: what that unloads saved first) and busy until it is done.
        With it, whether the request must go as it is: it names a model the router will not
        load for it (`?autoload=false`), and the router's refusal is the answer."""
        found = []
        if self.models:
            found = await self._model_lanes(await _naming(request))
        if not found:
            yield self.pick(), False
            return
        group, lane = self._choose_model(found)
        if not await group.serve(lane, request.query.get("autoload")):
            yield lane, True
            return
        try:
            yield lane, False
        finally:
            await group.done(lane)

    async def keyed(
        self, request: web.Request, path_qs: str, adapter: WireAdapter
    ) -> web.StreamResponse:
        """The one door of every keyed request: its body read and parsed once, the server
        chosen (the one holding its conversation, by routing.py's rule), readied, and the
        request served there by the lane's driver (handlers/keyed.py). With several servers,
        one that cannot be reached before any byte of the reply went out leaves rotation and
        the request goes to another."""
        incoming = await read_incoming(request)
        if isinstance(incoming, web.Response):
            return incoming
        not_yet = await self._opened()
        if not_yet is not None:
            return not_yet
        if not self.models and any(lane.backend.router for lane in self.lanes):
            # A router whose models kvproxy has not seen (it was down at start, or listed
            # none): they may be there now.
            await self._find_new()
        if self.models:
            return await self._keyed_on_model(request, path_qs, adapter, incoming)
        parsed = incoming.parsed
        payload = parsed.value if not parsed.opaque and isinstance(parsed.value, dict) else None
        left = list(self.lanes)
        while True:
            lane, conv = self._choose(left, request, adapter, payload)
            identity = lane.backend.model_identity
            answer: web.StreamResponse | None = await self.ready(lane)
            if answer is None and lane.backend.router and not self.models:
                # Found to be a router just now (it was down at start, or listed no model).
                await self._find_new()
                if self.models:
                    return await self._keyed_on_model(request, path_qs, adapter, incoming)
            if answer is None:
                if lane.backend.model_identity != identity:
                    conv = None  # read as another model's: read again on the server found
                answer = await lane.keyed.serve(request, path_qs, adapter, incoming, conv)
                if not (isinstance(answer, Unreachable) and not answer.prepared):
                    return answer
                if len(self.lanes) > 1:
                    lane.backend.unreachable("a request found it unreachable")
                    log.warning("llama-server %s is unreachable: out of rotation", lane.name)
            left.remove(lane)
            if not left:
                return answer

    async def _keyed_on_model(
        self, request: web.Request, path_qs: str, adapter: WireAdapter, incoming: Incoming
    ) -> web.StreamResponse:
        """With router models: to a lane of the model the body names, once its router runs
        it; a body naming none of them goes as it is (the router answers it). With several
        routers, one that cannot be reached before any byte went out leaves rotation and the
        request goes to another."""
        parsed = incoming.parsed
        value = None if parsed.opaque else parsed.value
        left = await self._model_lanes(value)
        if not left:
            bypass = await self.pick().unkeyed.relay_bypass(request, path_qs, incoming.raw())
            return bypass.response
        payload = value if isinstance(value, dict) else None
        while True:
            group, lane = self._choose_model(left, request, adapter, payload)
            if not await group.serve(lane, request.query.get("autoload")):
                bypass = await lane.unkeyed.relay_bypass(request, path_qs, incoming.raw())
                return bypass.response
            try:
                answer: web.StreamResponse | None = await self.ready(lane)
                if answer is None:
                    # Read as a conversation of the model now that it runs (its identity).
                    answer = await lane.keyed.serve(request, path_qs, adapter, incoming, None)
                    if len(left) == 1 or not (
                        isinstance(answer, Unreachable) and not answer.prepared
                    ):
                        return answer
                    lane.backend.unreachable("a request found it unreachable")
                    log.warning("llama-server %s is unreachable: out of rotation", lane.name)
            finally:
                await group.done(lane)
            left = [(g, other) for g, other in left if other is not lane]
            if not left:
                return answer

    def _choose(
        self,
        lanes: list[Lane],
        request: web.Request,
        adapter: WireAdapter,
        payload: dict[str, Any] | None,
    ) -> tuple[Lane, Conversation | NotKeyed | None]:
        """The lane for the request and the request read as a conversation of its model (one
        lane: read there, after it is readied)."""
        if len(lanes) == 1:
            return lanes[0], None
        if payload is None:
            return lanes[least_loaded([_view(lane, None) for lane in lanes])], None
        # One reading per model identity (servers of one model share it).
        read: dict[str, Conversation | NotKeyed] = {}
        convs: list[Conversation | NotKeyed] = []
        for lane in lanes:
            identity = lane.backend.model_identity
            if identity not in read:
                read[identity] = lane.keyed.read(request, adapter, payload)
            convs.append(read[identity])
        views = [
            _view(lane, conv if isinstance(conv, Conversation) else None)
            for lane, conv in zip(lanes, convs, strict=True)
        ]
        index = choose_lane(views)
        return lanes[index], convs[index]


async def _naming(request: web.Request) -> Any:
    """What names the model a router sends `request` to (server-models.cpp): a GET's query
    (proxy_get reads `?model=`), else the JSON body (proxy_post reads its "model")."""
    if request.method in ("GET", "HEAD"):
        return {"model": request.query.get("model")}
    if not request.body_exists:
        return None
    parsed = jsonbody.parse(await request.read())
    return None if parsed.opaque else parsed.value


def _model_named(payload: Any) -> object:
    """The "model" a request body names (None: no object, or no such field)."""
    return payload.get("model") if isinstance(payload, dict) else None


def _view(lane: Lane, conv: Conversation | None) -> LaneView:
    pool = lane.pool
    idle_depth = busy_depth = 0
    if conv is not None:
        for slot in pool.slots:
            depth = slot.shared_depth(conv.keys, conv.namespace)
            if not slot.busy:
                idle_depth = max(idle_depth, depth)
            elif not slot.saved:
                busy_depth = max(busy_depth, depth)
    return LaneView(
        in_rotation=lane.in_rotation,
        resident_idle=idle_depth,
        resident_busy=busy_depth,
        idle_slots=sum(1 for s in pool.slots if not s.busy),
        waiting=pool.waiting,
        empty_slots=sum(1 for s in pool.slots if not s.busy and s.holding is None),
        slots=len(pool.slots),
        saving_slots=sum(1 for s in pool.slots if s.busy and s.saving),
    )
