"""The cache's lanes: each server's own, or, for a router-mode server, one per model it lists
(models.py). Looked for at start, then again while kvproxy runs, so a router that was down at
start, or a model it lists later (a file added to `--models-dir` or a preset, after the
router reloaded its list), is served cached without a restart: at housekeeping's looks, and
at once for a request naming a model no lane serves. Every look reads GET /props and
GET /models of the router itself, which neither load nor wake a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial

from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.lanes.lane import Lane
from kvproxy.lanes.models import RouterModels, find_models

log = logging.getLogger("kvproxy.cache")

# A request naming a model no lane serves makes kvproxy look for new router models at once,
# at most this often however many such requests come (the router answers them meanwhile).
FIND_MODELS_INTERVAL = 1.0


class Discovery:
    """`lanes`: the cache's own list, one lane per server, changed in place from then on;
    `make_lane(upstream, model)` builds a router model's lane."""

    def __init__(self, lanes: list[Lane], make_lane: Callable[[Upstream, str], Lane]) -> None:
        self.lanes = lanes
        # Each server's own lane, in the order given: the one it is served by until it is
        # found to be a router with models (then its models' lanes stand in its place).
        self._servers = list(lanes)
        self.groups: list[RouterModels] = []  # the routers found, their models' lanes
        self._make_lane = make_lane
        # Set once the cache serves: a lane that joins later starts its background saves.
        self.serving = False
        self._finding = asyncio.Lock()
        self._found_at = 0.0

    async def find(self) -> None:
        """Look for router models on each server not yet found as a router with models."""
        found = {group.upstream for group in self.groups}
        for lane in self._servers:
            upstream = lane.backend.upstream
            if upstream in found:
                continue
            group = await find_models(upstream, partial(self._make_lane, upstream), self.relist)
            if group is not None:
                self.groups.append(group)
        self.relist()

    def relist(self) -> None:
        """The lanes: each server's, or its router models' where it has them. A lane that
        joins once the cache serves does at once what every lane did at start."""
        groups = {group.upstream: group for group in self.groups}
        before = set(self.lanes)
        lanes: list[Lane] = []
        for server in self._servers:
            group = groups.get(server.backend.upstream)
            lanes += list(group.lanes.values()) if group is not None else [server]
        self.lanes[:] = lanes
        if self.serving:
            for lane in lanes:
                if lane not in before:
                    lane.serving(True)

    async def find_new(self) -> None:
        """A request named a model no lane serves: look at each router's models now (a
        router that came up, a model it lists since), at most every FIND_MODELS_INTERVAL."""
        async with self._finding:
            if time.monotonic() - self._found_at < FIND_MODELS_INTERVAL:
                return
            try:
                for group in self.groups:
                    with contextlib.suppress(UpstreamError):
                        await group.look()
                await self.find()
            finally:
                self._found_at = time.monotonic()

    async def look(self) -> None:
        """Housekeeping's look: each router's models (one unloaded or asleep has its slots
        forgotten, a new one gets a lane), then servers that answer as routers but were not
        found as ones with models."""
        for group in self.groups:
            try:
                await group.look()
            except UpstreamError as exc:  # down: its lanes' own looks take them out of rotation
                log.debug("GET /models of %s failed: %s", group.upstream.base_url, exc)
        if any(lane.backend.router for lane in self.lanes):
            await self.find()
