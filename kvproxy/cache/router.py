"""Where a request goes when kvproxy fronts several llama-servers (lanes), by routing.py's
rule: to the server holding the conversation, else one that can restore it now, else the
least loaded. A server that cannot be reached before any byte of the reply went out leaves
rotation, and the request goes to another server (restored there from the shared cache dir).

With one server, every request goes to it exactly as before: no body is read here.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from kvproxy.cache.keyed import Incoming, invalid_json
from kvproxy.cache.lane import Lane
from kvproxy.cache.models import RouterModels
from kvproxy.cache.routing import LaneView, choose_lane, least_loaded
from kvproxy.http import bodies as jsonbody
from kvproxy.http.errors import Unreachable
from kvproxy.wire import Conversation, NotKeyed, WireAdapter

log = logging.getLogger("kvproxy.cache")


class Router:
    def __init__(
        self,
        lanes: list[Lane],
        opened: Callable[[], Awaitable[web.Response | None]],
    ) -> None:
        self.lanes = lanes  # the cache's own list: a router found at start changes it
        # Router-mode servers: their models' lanes, by the name a request gives (models.py).
        self.models: list[RouterModels] = []
        # Waits until the cache dir is open and every server was looked for once (or answers
        # what the client gets instead).
        self._opened = opened

    async def ready(self, lane: Lane) -> web.Response | None:
        """Before a slot-using request goes to `lane`: the cache is open, and a server that
        was not found is looked for again. None when the request may go; else the answer
        to give instead (what the server would say)."""
        not_yet = await self._opened()
        if not_yet is not None:
            return not_yet
        await lane.backend.rediscover_if_off()
        return lane.backend.not_ready()

    def pick(self) -> Lane:
        """The server for a request the cache does not key."""
        if len(self.lanes) == 1:
            return self.lanes[0]
        return self.lanes[least_loaded([_view(lane, None) for lane in self.lanes])]

    def model_lane(self, payload: Any) -> tuple[RouterModels, Lane] | None:
        """The lane of the router model a request body names ("model"), if any."""
        name = payload.get("model") if isinstance(payload, dict) else None
        for group in self.models:
            lane = group.lane_for(name)
            if lane is not None:
                return group, lane
        return None

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
    async def lane_for(self, request: web.Request) -> AsyncIterator[Lane]:
        """The lane for a request the cache does not key but pins: with router models, the
        one its body names, brought up (models.py) and busy until the request is done."""
        found = None
        if self.models and request.body_exists:
            parsed = jsonbody.parse(await request.read())
            found = self.model_lane(None if parsed.opaque else parsed.value)
        if found is None:
            yield self.pick()
            return
        group, lane = found
        await group.serve(lane)
        try:
            yield lane
        finally:
            await group.done(lane)

    async def handle_keyed(
        self, request: web.Request, path_qs: str, adapter: WireAdapter
    ) -> web.StreamResponse:
        if self.models:
            not_yet = await self._opened()
            if not_yet is not None:
                return not_yet
            return await self._handle_model(request, path_qs, adapter)
        if len(self.lanes) == 1:
            lane = self.lanes[0]
            not_yet = await self.ready(lane)
            if not_yet is not None:
                return not_yet
            return await lane.conversations.handle_keyed(request, path_qs, adapter)
        not_yet = await self._opened()
        if not_yet is not None:
            return not_yet
        started = time.perf_counter()
        body = await request.read()
        parsed = jsonbody.parse(body)
        if parsed.invalid is not None:
            return invalid_json(parsed.invalid)
        incoming = Incoming(body, parsed, started)
        payload = parsed.value if not parsed.opaque and isinstance(parsed.value, dict) else None
        left = list(self.lanes)
        while True:
            lane, conv = self._choose(left, request, adapter, payload)
            answer: web.StreamResponse | None = await self.ready(lane)
            if answer is None:
                answer = await lane.conversations.serve(request, path_qs, adapter, incoming, conv)
                if not (isinstance(answer, Unreachable) and not answer.prepared):
                    return answer
                lane.backend.unreachable("a request found it unreachable")
                log.warning("llama-server %s is unreachable: out of rotation", lane.name)
            left.remove(lane)
            if not left:
                return answer

    async def _handle_model(
        self, request: web.Request, path_qs: str, adapter: WireAdapter
    ) -> web.StreamResponse:
        """With router models: to the lane of the model the body names, once the router runs
        it; a body naming none of them goes as it is (the router answers it)."""
        started = time.perf_counter()
        body = await request.read()
        parsed = jsonbody.parse(body)
        if parsed.invalid is not None:
            return invalid_json(parsed.invalid)
        found = self.model_lane(None if parsed.opaque else parsed.value)
        if found is None:
            return (await self.pick().unkeyed.relay_bypass(request, path_qs, body)).response
        group, lane = found
        await group.serve(lane)
        try:
            answer = await self.ready(lane)
            if answer is not None:
                return answer
            incoming = Incoming(body, parsed, started)
            return await lane.conversations.serve(request, path_qs, adapter, incoming, None)
        finally:
            await group.done(lane)

    def _choose(
        self,
        lanes: list[Lane],
        request: web.Request,
        adapter: WireAdapter,
        payload: dict[str, Any] | None,
    ) -> tuple[Lane, Conversation | NotKeyed | None]:
        """The lane for the request and the request read as a conversation of its model."""
        if payload is None:
            return lanes[least_loaded([_view(lane, None) for lane in lanes])], None
        # One reading per model identity (servers of one model share it).
        read: dict[str, Conversation | NotKeyed] = {}
        convs: list[Conversation | NotKeyed] = []
        for lane in lanes:
            identity = lane.backend.model_identity
            if identity not in read:
                read[identity] = lane.conversations.read(request, adapter, payload)
            convs.append(read[identity])
        views = [
            _view(lane, conv if isinstance(conv, Conversation) else None)
            for lane, conv in zip(lanes, convs, strict=True)
        ]
        index = choose_lane(views)
        return lanes[index], convs[index]


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
