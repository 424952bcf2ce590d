"""The models of a router-mode llama-server, one lane each, and what kvproxy does before the
router swaps them (docs/how-it-works.md, "Router mode").

A router unloads a model, and every slot state with it, when a request needs a model it has
not loaded while `--models-max` are running: the least recently used one with no request in
flight. So before a request goes to a model that is not loaded, kvproxy saves the unsaved
slots of the model the router will unload (`victim`, the router's own rule on what kvproxy
saw), then makes the router load the model, and forgets what the unloaded model's slots
held: its conversations come back from disk when it does. A model that falls asleep or that
the router unloads on its own (another client, `/models/unload`) is noticed in GET /models
and its slots are forgotten the same way.

While a request is on its way to a model, that model counts as busy: no swap for another
model unloads it under the request (such a swap waits for it, as the router would).

Every look at GET /models (housekeeping's, a request's) also takes in models the router
lists that kvproxy had no lane for (a file added to `--models-dir` or a preset, after the
router reloaded its list): each gets a lane then. GET /models neither loads nor wakes a model
(server-models.cpp answers it from the router's own records).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.lanes.lane import Lane
from kvproxy.server.api import LlamaClient
from kvproxy.server.modellist import RouterModel, is_router, list_models

log = logging.getLogger("kvproxy.cache")

# Statuses whose child process runs and counts against --models-max.
RUNNING = frozenset({"loaded", "loading", "sleeping"})
# Statuses a router may unload to make room (server_lru_sched::pick_victim: ready or asleep).
EVICTABLE = frozenset({"loaded", "sleeping"})


@dataclass(frozen=True)
class ModelView:
    name: str
    status: str
    busy: bool  # a request of kvproxy's is on its way to it, or in it
    last_post: float  # when kvproxy last sent it a POST (what makes a router model "used")


def victim(models: Sequence[ModelView], target: str, models_max: int) -> str | None:
    """The model the router unloads to load `target`, None when it unloads none (the
    target runs, or there is room). A busy model is never unloaded; when every other model
    is busy the router waits, and so does kvproxy: `Swap.WAIT` is returned as the name."""
    if models_max <= 0:
        return None
    running = [m for m in models if m.status in RUNNING]
    if any(m.name == target for m in running) or len(running) < models_max:
        return None
    idle = [m for m in running if m.status in EVICTABLE and not m.busy and m.name != target]
    if not idle:
        return WAIT
    return min(idle, key=lambda m: m.last_post).name


WAIT = "\0wait"  # victim(): a swap must wait until a model is idle


class RouterModels:
    """The lanes of one router's models, by every name a request may use. `make_lane(model
    id)` builds a model's lane; `on_new()`, once set, is called when a look added lanes (the
    cache lists them among its own)."""

    def __init__(
        self,
        upstream: Upstream,
        models_max: int,
        make_lane: Callable[[str], Lane],
    ) -> None:
        self.upstream = upstream
        self.lanes: dict[str, Lane] = {}  # model id -> lane
        self._make_lane = make_lane
        self.on_new: Callable[[], None] | None = None
        self.names: dict[str, str] = {}  # a name or alias -> model id
        self.models_max = models_max
        self.autoload = True  # False under --no-models-autoload (GET /props "models_autoload")
        self.status: dict[str, str] = {}
        self._busy: dict[str, int] = {}
        self._changed = asyncio.Condition()

    def add_names(self, model: RouterModel) -> None:
        for name in model.names():
            self.names[name] = model.id

    def lane_for(self, name: object) -> Lane | None:
        model = self.names.get(name) if isinstance(name, str) else None
        return self.lanes.get(model) if model is not None else None

    def views(self) -> list[ModelView]:
        return [
            ModelView(
                name,
                self.status.get(name, "unloaded"),
                self._busy.get(name, 0) > 0,
                lane.backend.client.last_post,
            )
            for name, lane in self.lanes.items()
        ]

    def notice(self, models: Sequence[RouterModel]) -> list[str]:
        """GET /models as it is now: a model that stopped running or fell asleep since the
        last look lost its slots' state; a model listed for the first time gets a lane.
        Returns the ids of the new models."""
        new = [m.id for m in models if m.id and m.id not in self.lanes]
        for name in new:
            self.lanes[name] = self._make_lane(name)
        for model in models:
            # Every look: a reloaded list may have given a model other aliases.
            self.add_names(model)
            before = self.status.get(model.id)
            self.status[model.id] = model.status
            lane = self.lanes.get(model.id)
            if lane is None or before is None or before == model.status:
                continue
            if model.status == "sleeping":
                lane.backend.model_gone("fell asleep")
            elif model.status not in RUNNING:
                lane.backend.model_gone("was unloaded by the router")
        if new and self.on_new is not None:
            log.info("router %s lists new models: %s", self.upstream.base_url, ", ".join(new))
            self.on_new()
        return new

    async def look(self) -> list[str]:
        """Read GET /models (see `notice`); the ids of models new since the last look."""
        return self.notice(await list_models(self.upstream))

    def running(self, lane: Lane) -> bool:
        """Whether the router ran `lane`'s model at the last look."""
        return self.status.get(lane.backend.model or "") in RUNNING

    def has_room(self, lane: Lane) -> bool:
        """Whether the router can load `lane`'s model without unloading another."""
        return victim(self.views(), lane.backend.model or "", self.models_max) is None

    async def serve(self, lane: Lane, asked: str | None = None) -> bool:
        """Before a request goes to `lane`'s model: it runs, loaded if need be, and the
        model that load unloads had its unsaved slots saved. Call `done(lane)` after the
        request (it counts as busy from here). False, with nothing loaded and nothing to
        call after: the router answers the request "model is not loaded" (server-models.cpp
        is_autoload: its `?autoload=` given as `asked`, else the router's own setting, says
        load none, and the model does not run), so it goes as it is."""
        model = lane.backend.model
        assert model is not None
        self._busy[model] = self._busy.get(model, 0) + 1
        try:
            loads = asked in ("true", "1") if asked else self.autoload
            runs = await self._bring_up(lane, model, loads)
        except BaseException:
            await self.done(lane)
            raise
        if not runs:
            await self.done(lane)
        return runs

    async def done(self, lane: Lane) -> None:
        model = lane.backend.model
        assert model is not None
        self._busy[model] = max(0, self._busy.get(model, 0) - 1)
        async with self._changed:
            self._changed.notify_all()

    async def _bring_up(self, lane: Lane, model: str, loads: bool) -> bool:
        # A model that runs needs no lock: counted busy already, no swap unloads it now.
        if await self._running_or_unknown(model):
            return True
        if not loads:
            return False
        async with self._changed:
            while True:
                if await self._running_or_unknown(model):
                    return True
                unloads = victim(self.views(), model, self.models_max)
                if unloads != WAIT:
                    break
                # Every other model has a request in flight: the router would wait too.
                await self._changed.wait()
            await self._save_victims(model, unloads)
            log.info("loading model %s on the router", model)
            try:
                await lane.backend.client.load()
            except UpstreamError as exc:
                log.warning("the router could not load model %s: %s", model, exc)
                return True  # the request goes as it is: the router answers it
            await self.look()
        await lane.backend.rediscover_if_off()
        return True

    async def _running_or_unknown(self, model: str) -> bool:
        """Whether GET /models shows `model` running, or does not answer (the request then
        goes as it is)."""
        try:
            await self.look()
        except UpstreamError as exc:
            log.debug("GET /models failed (%s): the request goes as it is", exc)
            return True
        return self.status.get(model) in RUNNING

    async def _save_victims(self, model: str, unloads: str | None) -> None:
        """Save the unsaved slots of the model the router unloads to load `model`. Each save
        is a POST, which makes its model the most recently used one: saved until the model
        the router will unload has nothing unsaved."""
        saved: set[str] = set()
        while unloads is not None and unloads != WAIT and unloads not in saved:
            saved.add(unloads)
            await self.lanes[unloads].save_unsaved()
            unloads = victim(self.views(), model, self.models_max)

    async def before_management(self, path: str, name: object) -> Lane | None:
        """Before a client's /models/load or /models/unload (--allow-model-management) of
        the model `name`: what the router will unload for a load is saved; the lane of the
        named model is returned (the caller holds its slots, saving them, while the route
        runs)."""
        lane = self.lane_for(name)
        if lane is None or lane.backend.model is None:
            return None
        if path == "/models/load":
            async with self._changed:
                with contextlib.suppress(UpstreamError):
                    await self.look()
                unloads = victim(self.views(), lane.backend.model, self.models_max)
                await self._save_victims(lane.backend.model, unloads)
        return lane


async def find_models(
    upstream: Upstream,
    make_lane: Callable[[str], Lane],
    on_new: Callable[[], None] | None = None,
) -> RouterModels | None:
    """The models of the server at `upstream`, each with a lane `make_lane(model id)`, when
    it is a router (GET /props says so); None for a server of one model, one that does not
    answer, or a router that lists no model yet (it is then served as one server, and looked
    at again later)."""
    try:
        props = await LlamaClient(upstream).props()
        if not is_router(props):
            return None
        models = await list_models(upstream)
    except UpstreamError as exc:
        log.debug("GET /props or /models failed (%s): not looking for router models", exc)
        return None
    if not models:
        # Nothing to route by model: the router is served as one server (uncached, as it
        # pins no slots of its own), never left without a lane. Asked again at every look.
        log.debug("llama-server %s is a router with no models", upstream.base_url)
        return None
    limit = props.get("max_instances")
    found = RouterModels(upstream, limit if isinstance(limit, int) else 0, make_lane)
    found.autoload = props.get("models_autoload") is not False
    found.notice(models)
    found.on_new = on_new  # for models listed later: these are the caller's to list now
    log.info(
        "llama-server %s is a router: %d models (%s), at most %s loaded at once",
        upstream.base_url,
        len(models),
        ", ".join(found.lanes),
        found.models_max or "any number",
    )
    return found
