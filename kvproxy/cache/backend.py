"""One llama-server: its client, its slot pool, and the identity of the model it serves.

Discovery asks the server what it is (GET /props) and whether slots can be pinned
(GET /slots). A server whose model or slot count changed invalidates everything kvproxy
knew about its slots; one that refuses GET /slots is served uncached.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvproxy.cache.liveness import Liveness, no_answer
from kvproxy.cache.slotpool import SlotPool
from kvproxy.config import Settings
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient, ModelRoute
from kvproxy.server.modelinfo import ModelInfo, model_identity, read_model_info, swa_note
from kvproxy.server.modellist import is_router

log = logging.getLogger("kvproxy.cache")

# Routes the server serves on slots it picks itself (they ignore `id_slot`), each with the
# route that probes whether the server serves that kind at all. An embedding or rerank task
# takes a slot and replaces its cached prompt (server-context.cpp: stateless tasks start from
# n_past 0), a transcription is a completion: served, they hold every slot (unkeyed.py). A
# server not started for them (no --embeddings, --reranking, audio model) answers 501 at
# once without a task: then they pass straight through, never queued behind every slot.
# Probed when such a request comes, at most every PROPS_CHECK_INTERVAL.
SLOT_PICKING_ROUTES = {
    "/embedding": "/embeddings",
    "/embeddings": "/embeddings",
    "/v1/embeddings": "/embeddings",
    "/rerank": "/rerank",
    "/reranking": "/rerank",
    "/v1/rerank": "/rerank",
    "/v1/reranking": "/rerank",
    "/audio/transcriptions": "/v1/audio/transcriptions",
    "/v1/audio/transcriptions": "/v1/audio/transcriptions",
}
# Statuses of a request the server refused without a slot.
REFUSED_STATUSES = frozenset({404, 501})

# How often a running proxy checks that the server is still the one it knows.
PROPS_CHECK_INTERVAL = 15.0
# While the server refuses GET /slots (caching off), how often a request may look again.
REDISCOVER_INTERVAL = 1.0


# With several servers, how often each is checked: one that died leaves rotation within
# this (a request that finds it unreachable takes it out at once), one that returns rejoins.
SEVERAL_CHECK_INTERVAL = 2.0
# With several servers, how long a check waits for GET /props (which a healthy server answers
# at once, even mid-decode): a server stopped (SIGSTOP) or wedged accepts connections and never
# answers, and must leave rotation within seconds, not after the 30 s of a lone server's
# check, while the others serve the new conversations.
SEVERAL_CHECK_TIMEOUT = 5.0


class Backend:
    """`model`: one model of a router-mode server (a lane of its own, reached by name; one
    the router has not loaded answers its GETs 400 and counts as down meanwhile)."""

    def __init__(
        self,
        upstream: Upstream,
        settings: Settings,
        several: bool = False,
        model: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.managed = bool(settings.model or settings.models_dir)  # kvproxy started it
        # One of several servers: checked more often, and distrusted when it returns (its
        # requests went elsewhere meanwhile; it may have been restarted, empty).
        self.several = several or model is not None
        self.check_interval = SEVERAL_CHECK_INTERVAL if self.several else PROPS_CHECK_INTERVAL
        self.model = model
        self.client = LlamaClient(upstream, ModelRoute(model) if model else None)
        self.pool = SlotPool(1, settings.max_queue, settings.queue_timeout)
        self.enabled = False  # slot pinning works (GET /slots answered)
        self.disk_enabled = True  # slot save/restore works (--slot-save-path set)
        # The cache dir is open (the cache sets it false while it opens): until then nothing
        # discovers the server, so requests pass through uncached.
        self.store_open = True
        self.model_identity = ""
        self.model_info: ModelInfo | None = None
        self._last_props_check = 0.0
        # Probe route (SLOT_PICKING_ROUTES) -> (the server refuses it, when that was seen).
        self._refusals: dict[str, tuple[bool, float]] = {}
        # When a server that answered /props last refused GET /slots: requests then look again
        # at most every REDISCOVER_INTERVAL. A server that was not up is asked at once.
        self._no_slots_seen = 0.0
        # Why the last look found no server (GET /props failed): None once one answered.
        self.down: UpstreamError | None = None
        self.sleeping = False  # the server's /props said `is_sleeping` (--sleep-idle-seconds)
        # The server's own /props said it is a router: its models get lanes (models.py).
        self.router = False
        # A request could not reach the server: what its slots held is distrusted once it
        # answers again (it may have been restarted, empty).
        self._lost = False
        # Whether its last look got no answer at all: requests waiting on it go elsewhere.
        self.liveness = Liveness()

    def refuses_slot_actions(self) -> None:
        """The server answered a slot action 501 (no --slot-save-path): no saves or restores."""
        self.disk_enabled = False

    def store_opening(self, opening: bool) -> None:
        """While the cache dir opens, nothing discovers the server: requests pass through."""
        self.store_open = not opening

    @property
    def name(self) -> str:
        """The server's address (host:port, then /model for a router's), as logs, metrics
        and stats name it."""
        address = self.upstream.base_url.split("://", 1)[-1]
        return f"{address}/{self.model}" if self.model else address

    @property
    def model_name(self) -> str:
        """The model as `kvproxy ls` and the stats name it: a router's model by its name,
        else the server's GGUF file by its file name ("" before the server was seen)."""
        if self.model is not None:
            return self.model
        return self.model_info.path.name if self.model_info is not None else ""

    @property
    def label(self) -> str | None:
        """The server's name where a request's report names it: only among several."""
        return self.name if self.several else None

    @property
    def model_class(self) -> str:
        return self.model_info.model_class if self.model_info else "unknown"

    def props_check_due(self) -> bool:
        return time.monotonic() - self._last_props_check > self.check_interval

    def unreachable(self, reason: str) -> None:
        """A request could not reach the server (with several, it goes to another): out of
        rotation until the server answers a look again, and its slots distrusted then."""
        self.down = UpstreamError(reason)
        self.enabled = False
        self._lost = True

    def model_gone(self, why: str) -> None:
        """The router unloaded this model, or it fell asleep: its KV went with it. What the
        slots held is forgotten now (a saved copy is restored when it comes back), and once
        more when it answers again."""
        log.info("model %s %s: its slots are forgotten", self.model, why)
        for slot in self.pool.slots:
            if not slot.busy:
                slot.forget()
        self._lost = True

    async def rediscover_if_off(self, wake: bool = True) -> None:
        """Called per request while caching is off: a server that came up is used at once.
        `wake`: the request will wake a sleeping server anyway (a health check would not)."""
        if not self.store_open:
            return
        if not self.enabled and time.monotonic() - self._no_slots_seen > REDISCOVER_INTERVAL:
            try:
                await self.discover(wake=wake)
            except UpstreamError:
                pass

    async def discover(self, wake: bool = False) -> None:
        """Look at the server. GET /props neither wakes a server asleep (--sleep-idle-seconds)
        nor counts as activity that keeps it awake; GET /slots does both. So /slots is read
        only when caching is off, or /props shows another server (model, slot count, slots
        endpoint), or `wake` (a request is coming that wakes it anyway); never while it sleeps
        unless `wake`."""
        # Every attempt counts as the check, failed ones too: housekeeping's 15 s work (the
        # props check, noticing removals) must not run every second while the server is down.
        self._last_props_check = time.monotonic()
        try:
            props = await self.client.props(SEVERAL_CHECK_TIMEOUT if self.several else 30.0)
        except UpstreamError as exc:
            self.down = exc
            self._lost = self._lost or self.several
            if no_answer(exc):
                self.liveness.found_hung()
            raise
        self.down = None
        self.liveness.answered()
        self.router = self.model is None and is_router(props)
        if self._lost:
            self._lost = False
            log.info(
                "llama-server %s answers again: its slots are distrusted", self.upstream.base_url
            )
            for slot in self.pool.slots:
                if not slot.busy:
                    slot.forget()
        if self._notice_sleep(props) and not wake:
            return
        identity = await asyncio.to_thread(model_identity, props)
        if (
            not wake
            and self.enabled
            and identity == self.model_identity
            and props.get("total_slots", len(self.pool.slots)) == len(self.pool.slots)
            and props.get("endpoint_slots", True) is not False
        ):
            return  # the server kvproxy knows
        try:
            slots = await self.client.slots()
        except UpstreamError as exc:
            if self.enabled or self.model_identity != identity:
                log.warning("GET /slots failed (%s): caching is off, requests pass through", exc)
            self._no_slots_seen = time.monotonic()
            self.enabled = False
            self.model_identity = identity
            return
        if identity != self.model_identity or len(slots) != len(self.pool.slots):
            if self.model_identity:
                log.info("llama-server changed (model or slots): forgetting what slots held")
            self.pool.resize(len(slots))
            self.pool.forget_all()
            self._refusals.clear()
            self.model_identity = identity
            self.model_info = await asyncio.to_thread(
                read_model_info, str(props.get("model_path") or "")
            )
        self.pool.seen_empty(slots)
        if not self.enabled:
            info = self.model_info
            log.info(
                "llama-server has %d slots; model %s (%s%s)",
                len(slots),
                props.get("model_path"),
                self.model_class,
                swa_note(info, self.managed),
            )
        self.enabled = True
        self._last_props_check = time.monotonic()

    def _notice_sleep(self, props: dict[str, Any]) -> bool:
        """Whether the server is asleep, as /props says. Falling asleep it unloads the model
        and its KV: what kvproxy knew the slots held is gone (they are empty once it wakes)."""
        asleep = props.get("is_sleeping") is True
        if asleep and not self.sleeping:
            log.info("llama-server is asleep: its slots were emptied; watching without waking it")
            for slot in self.pool.slots:
                if not slot.busy:
                    slot.forget()
        elif self.sleeping and not asleep:
            log.info("llama-server woke up")
        self.sleeping = asleep
        return asleep

    async def asleep(self) -> bool:
        """Ask the server (GET /props, which does not wake it) whether it sleeps now."""
        try:
            return self._notice_sleep(await self.client.props())
        except UpstreamError:
            return False

    def not_ready(self) -> UpstreamError | None:
        """With caching off because no server answered GET /props: why, when the client would
        get an error from the server at this moment (a loading server's 503, or no answer),
        so that no slot-using request goes unpinned to a server that comes up in between
        (handlers/answers.py words it). None when the request may go as it is (pinned, or
        uncached by design)."""
        if self.enabled or self.down is None or not self.store_open:
            return None
        if self.down.status == 503 or self.down.status is None:
            return self.down
        return None

    async def refuses(self, path: str) -> bool:
        """Whether the server answers `path` without a slot (see SLOT_PICKING_ROUTES)."""
        probe = SLOT_PICKING_ROUTES.get(path)
        if probe is None:
            return False
        known = self._refusals.get(probe)
        if known is None or time.monotonic() - known[1] > PROPS_CHECK_INTERVAL:
            known = (await self.client.refuses(probe), time.monotonic())
            self._refusals[probe] = known
        return known[0]

    def served(self, path: str) -> None:
        """The server served `path` after all (restarted for it since it was probed)."""
        probe = SLOT_PICKING_ROUTES.get(path)
        if probe is not None:
            self._refusals[probe] = (False, time.monotonic())
